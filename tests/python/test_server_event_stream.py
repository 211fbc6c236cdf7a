"""The streamed response and the hang-up watch of server/event_stream.py, driven
in-process as the ASGI server drives them: the client goes before the first
output, mid-stream, or between the two (the work is cancelled, the engine's
requests closed, no task left behind, the request's task itself never
cancelled); a cancellation of the request's task from elsewhere (a shutdown)
goes on as one; errors of the work come out as they are."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("starlette")

from pagedcore.server.event_stream import EventStream, Hangup  # noqa: E402


class Client:
    """The ASGI receive/send pair of one request whose body was read: receive()
    waits until the client hangs up (or the response completes, as uvicorn's
    does), send() records the messages."""

    def __init__(self) -> None:
        self.gone = asyncio.Event()
        self.sent: list[dict] = []
        self.receives = 0

    async def receive(self) -> dict:
        self.receives += 1
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict) -> None:
        self.sent.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            self.gone.set()  # (uvicorn: receive() says disconnect once the response is complete)

    def bodies(self) -> list[bytes]:
        return [m["body"] for m in self.sent if m["type"] == "http.response.body"]


class Engine:
    """Stands in for the engine's request: outputs handed over by the test; its
    generator's finally is where the server aborts the engine's request."""

    def __init__(self) -> None:
        self.outputs: asyncio.Queue = asyncio.Queue()
        self.aborted = 0

    async def stream(self):
        try:
            while True:
                item = await self.outputs.get()
                if item is None:
                    return
                yield item
        finally:
            self.aborted += 1


async def events(first, gen):
    yield f"data: {first}\n\n"
    async for text in gen:
        yield f"data: {text}\n\n"
    yield "data: [DONE]\n\n"


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def others() -> set:
    return asyncio.all_tasks() - {asyncio.current_task()}


def run(coro):
    async def timed():
        async with asyncio.timeout(10):  # (in the same task: others() stays the test's)
            return await coro

    return asyncio.run(timed())


async def request(client: Client, engine: Engine) -> tuple[bool, EventStream | None]:
    """A streamed request's handler: the wait for the first output under the
    watch, then the response, which takes the watch over (as app.py's
    until_disconnect and routes do)."""
    hangup = Hangup(client.receive)
    gen = engine.stream()

    async def work():
        first = await gen.__anext__()
        return EventStream(events(first, gen), closing=gen)

    try:
        answered, response = await hangup.guard(work())
    except BaseException:
        hangup.stop()
        raise
    if not answered:
        hangup.stop()
        return False, None
    response.hangup = hangup
    return True, response


def test_a_whole_stream_is_written_and_leaves_no_task_behind() -> None:
    async def main():
        client, engine = Client(), Engine()
        for text in ("a", "b", None):
            engine.outputs.put_nowait(text)
        answered, response = await request(client, engine)
        assert answered
        await response({"type": "http"}, client.receive, client.send)
        assert client.sent[0]["type"] == "http.response.start" and client.sent[0]["status"] == 200
        assert (b"content-type", b"text/event-stream; charset=utf-8") in client.sent[0]["headers"]
        assert client.bodies() == [b"data: a\n\n", b"data: b\n\n", b"data: [DONE]\n\n", b""]
        assert engine.aborted == 1  # (its generator's finally ran: here at its end)
        await settle()
        assert not others()
        assert asyncio.current_task().cancelling() == 0

    run(main())


def test_a_hang_up_before_the_first_output_cancels_the_wait() -> None:
    async def main():
        client, engine = Client(), Engine()
        handler = asyncio.create_task(request(client, engine))
        await settle()
        assert client.receives == 1  # the watch is on while the prompt runs
        client.gone.set()
        answered, response = await handler
        assert (answered, response) == (False, None)
        assert not handler.cancelled() and handler.cancelling() == 0
        assert engine.aborted == 1  # cancelled where it waited: its finally ran
        await settle()
        assert not others()

    run(main())


def test_a_hang_up_mid_stream_ends_the_response_and_aborts_the_request() -> None:
    async def main():
        client, engine = Client(), Engine()
        engine.outputs.put_nowait("a")
        answered, response = await request(client, engine)
        writing = asyncio.create_task(response({"type": "http"}, client.receive, client.send))
        await settle()
        assert client.bodies() == [b"data: a\n\n"]
        client.gone.set()
        await writing  # returns: no CancelledError into the server's task
        assert not writing.cancelled() and writing.cancelling() == 0
        assert engine.aborted == 1
        assert client.bodies() == [b"data: a\n\n"]  # nothing after the hang-up, no end of body
        engine.outputs.put_nowait("b")
        await settle()
        assert not others()

    run(main())


def test_a_hang_up_between_the_wait_and_the_response_writes_nothing_and_aborts() -> None:
    async def main():
        client, engine = Client(), Engine()
        engine.outputs.put_nowait("a")
        answered, response = await request(client, engine)
        assert answered and engine.aborted == 0
        client.gone.set()
        await settle()  # the watch sees it with no work running: noted only
        await response({"type": "http"}, client.receive, client.send)
        assert client.sent == []
        assert engine.aborted == 1  # (closing: the engine's generator was closed)
        await settle()
        assert not others()

    run(main())


def test_a_cancellation_of_the_request_task_from_elsewhere_goes_on() -> None:
    async def main():
        client, engine = Client(), Engine()
        handler = asyncio.create_task(request(client, engine))
        await settle()
        handler.cancel()  # (a shutdown), the client still there
        with pytest.raises(asyncio.CancelledError):
            await handler
        assert engine.aborted == 1  # the work went with it
        await settle()
        assert not others()

        # Both at once: still the shutdown's cancellation, not a quiet return.
        client, engine = Client(), Engine()
        handler = asyncio.create_task(request(client, engine))
        await settle()
        handler.cancel()
        client.gone.set()
        with pytest.raises(asyncio.CancelledError):
            await handler
        assert engine.aborted == 1
        await settle()
        assert not others()

        # Mid-stream: the writing task cancelled from elsewhere, the client there.
        client, engine = Client(), Engine()
        engine.outputs.put_nowait("a")
        answered, response = await request(client, engine)
        writing = asyncio.create_task(response({"type": "http"}, client.receive, client.send))
        await settle()
        writing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await writing
        assert engine.aborted == 1
        await settle()
        assert not others()

    run(main())


def test_errors_of_the_work_come_out_as_they_are() -> None:
    async def main():
        client = Client()
        hangup = Hangup(client.receive)

        async def bad():
            raise ValueError("prompt too long")

        with pytest.raises(ValueError, match="prompt too long"):
            await hangup.guard(bad())
        hangup.stop()
        await settle()
        assert not others()

        # A hang-up already seen: the work is not started (and not left unawaited).
        client = Client()
        hangup = Hangup(client.receive)
        client.gone.set()
        await settle()
        started = []

        async def work():
            started.append(1)

        assert await hangup.guard(work()) == (False, None)
        assert not started
        await settle()
        assert not others()

    run(main())
