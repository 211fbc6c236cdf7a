"""``pagedcore`` command line: ``pagedcore generate "prompt" [--model M] ...``."""

from __future__ import annotations

import argparse
import logging
import signal
import sys


def _generate(args: argparse.Namespace) -> int:
    # NOTE: every argument is checked before torch and the model load (seconds):
    # a bad flag is refused at once.
    from .sampling_params import SamplingParams

    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens, seed=args.seed)
    if args.max_model_len is not None and args.max_model_len < 1:
        raise ValueError(f"--max-model-len must be a positive integer, got {args.max_model_len}")
    if args.model is not None:
        import os

        if not os.path.isdir(args.model):
            from .model_path import resolve_model_path

            resolve_model_path(args.model)  # a cached hub id, or a clear refusal
    from .llm import LLM

    llm = LLM(model=args.model, max_model_len=args.max_model_len, seed=args.seed)
    if args.chat:
        outputs = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)
    else:
        outputs = llm.generate([args.prompt], params, use_tqdm=False)
    print(outputs[0].outputs[0].text)
    return 0


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from .llm_engine import EngineArgs, LLMEngine
    from .server.app import build_app
    from .server.async_engine import AsyncEngine

    model = args.model
    if model is None:
        from .default_model import default_model_path

        model = default_model_path()
    engine = LLMEngine(EngineArgs(
        model=model, tokenizer=args.tokenizer, dtype=args.dtype, device=args.device,
        block_size=args.block_size, gpu_memory_utilization=args.gpu_memory_utilization,
        num_kv_blocks=args.num_kv_blocks, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=args.enable_prefix_caching,
        preemption_mode=args.preemption_mode, swap_space=args.swap_space, kv_cache_dtype=args.kv_cache_dtype,
        seed=args.seed, enforce_eager=args.enforce_eager,
        async_output_proc=False if args.disable_async_output_proc else None,
    ))
    async_engine = AsyncEngine(engine, max_queue_len=args.max_queue_len)
    name = args.served_model_name or model
    app = build_app(async_engine, name, api_key=args.api_key)

    @app.on_event("shutdown")
    def _stop() -> None:
        async_engine.shutdown()

    logging.getLogger("pagedcore").info(
        "serving %s on http://%s:%d (OpenAI API under /v1)", name, args.host, args.port)
    # NOTE: once it has drained, uvicorn restores the previous handler and raises
    # the signal that stopped it again; with the default SIGTERM action the process
    # would then die with 143 after a clean shutdown. This handler makes that no-op.
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level.lower(),
                timeout_graceful_shutdown=args.shutdown_timeout, access_log=False)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagedcore", description="pagedcore: LLM inference over a paged KV cache")
    parser.add_argument("--log-level", default="WARNING", help="logging level (default WARNING)")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate a completion for one prompt")
    gen.add_argument("prompt")
    gen.add_argument("--model", default=None, help="Hugging Face model directory (default: SmolLM2-135M-Instruct)")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--max-model-len", type=int, default=None)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    srv = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    srv.add_argument("--model", default=None, help="Hugging Face model directory (default: SmolLM2-135M-Instruct)")
    srv.add_argument("--tokenizer", default=None)
    srv.add_argument("--served-model-name", default=None, help="the model name clients use (default: --model)")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    srv.add_argument("--block-size", type=int, default=16)
    srv.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    srv.add_argument("--num-kv-blocks", type=int, default=None)
    srv.add_argument("--kv-cache-memory-bytes", type=int, default=None, help="CPU KV-cache budget")
    srv.add_argument("--max-model-len", type=int, default=None)
    srv.add_argument("--max-num-seqs", type=int, default=256)
    srv.add_argument("--max-num-batched-tokens", type=int, default=None)
    srv.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    srv.add_argument("--preemption-mode", choices=["recompute", "swap"], default="recompute")
    srv.add_argument("--swap-space", type=float, default=4)
    srv.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3"])
    srv.add_argument("--enforce-eager", action="store_true", help="CUDA: no CUDA graphs for decode steps")
    srv.add_argument("--disable-async-output-proc", action="store_true",
                     help="CUDA: make a step's outputs before launching the next step")
    srv.add_argument("--dtype", default="auto")
    srv.add_argument("--device", default="auto")
    srv.add_argument("--seed", type=int, default=0)
    srv.add_argument("--max-queue-len", type=int, default=None, help="waiting requests before 429")
    srv.add_argument("--shutdown-timeout", type=float, default=30.0,
                     help="seconds SIGTERM waits for in-flight requests")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    # The start-up lines the README shows (# KV cache blocks, the cache size, the
    # weights loaded) are INFO: the pagedcore logger gets INFO, or what --log-level
    # asks for when that is more verbose (DEBUG: the time of each start-up phase).
    logging.getLogger("pagedcore").setLevel(min(logging.INFO, logging.getLogger().level))
    try:
        if args.command == "serve":
            return _serve(args)
        return _generate(args)
    except ValueError as e:
        print(f"pagedcore: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
