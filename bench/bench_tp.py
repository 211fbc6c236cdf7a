#!/usr/bin/env python3
"""Tensor parallelism: TP=N against TP=1 on the same machine, random weights in a real shape.

For each tensor-parallel size of ``--tp`` (one LLM at a time, same process):

* batch-1 time per output token: (generate of 1 + 64 tokens - generate of 1) / 64,
  128-token prompt, medians of three;
* throughput: the shape's workload of bench_e2e_gpu (``--requests``, lognormal
  prompts, EOS ignored), output tokens per second;
* with ``--allreduce nccl,symm_mem``, each TP > 1 once per all-reduce kind
  (PAGEDCORE_TP_ALLREDUCE: NCCL, or torch's symmetric-memory one-shot kernel for
  the all-reduces of up to 512 KiB);
* with ``--one-rank``, TP=1 also through the tensor-parallel path, once per
  all-reduce kind (PAGEDCORE_TP_ONE_RANK=1: the driver alone in a group of one
  rank, its collectives real calls in the CUDA graphs): what that path costs
  without a peer, on a machine of one GPU;
* the driver's per-step send (the step message through the shared-memory ring,
  or the gloo control group with PAGEDCORE_TP_CONTROL=gloo): median time per step
  on the driver and median message size.

Then ``--collectives``: the collectives of one decode step alone (through the
engine's own TensorParallelGroup, per all-reduce kind), between ``N`` spawned
ranks, at batch 1 and ``--requests``: ``2 x layers + 1`` all-reduces of
``[batch, hidden]`` and the all-gather of the logits ``[batch, vocab / N]``,
captured in one CUDA graph on GPUs (as the decode graphs hold them), timed over
replays, beside a graph of as many plain kernels over the same rows (the graph's own
cost, no collective); plus the bus bandwidth of a 256 MiB all-reduce, to set beside the
physical link (``nvidia-smi nvlink``).

``--control``: the step message's latency alone between two spawned processes
(one message of ``INLINE`` ints each way, one-way time = round trip / 2, median
of 2000): through shared-memory rings with the reader polling, with the reader
asleep on its pipe (``PAGEDCORE_TP_SPIN_US=0``), and as gloo broadcasts.

Ratios are printed last. CPU figures (gloo) say what the control plane costs;
the CPU's tokens per second under TP say nothing about speed (the ranks share
the cores).

Usage: python bench/bench_tp.py --shape llama3-8b --tp 1,2 [--device cuda] [--collectives]
       [--allreduce nccl,symm_mem] [--one-rank]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_e2e_gpu import SHAPES, _free, checkpoint_dir, workload  # noqa: E402


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def measure(path: Path, fields: dict, tp: int, args, allreduce: str = "nccl", one_rank: bool = False) -> dict:
    from pagedcore import LLM, SamplingParams

    os.environ["PAGEDCORE_TP_ALLREDUCE"] = allreduce
    os.environ["PAGEDCORE_TP_ONE_RANK"] = "1" if one_rank else "0"
    llm = LLM(model=str(path), load_format="dummy", dtype=args.dtype, device=args.device,
              max_model_len=args.max_model_len, gpu_memory_utilization=args.gpu_memory_utilization,
              max_num_seqs=args.max_num_seqs, enable_prefix_caching=False, tensor_parallel_size=tp,
              **({"kv_cache_memory_bytes": 2 << 30} if args.device == "cpu" else {}))
    sends: list[float] = []
    sizes: list[int] = []
    driver = llm.llm_engine.tp
    if driver is not None:  # time the step broadcast on the driver
        real = driver.send_step

        def timed(batch, block_size, previous):
            t = time.perf_counter()
            real(batch, block_size, previous)
            sends.append(time.perf_counter() - t)
            sizes.append(int(driver._buf[1]))

        driver.send_step = timed
    rng = np.random.default_rng(args.seed)
    prompt = [rng.integers(3, fields["vocab_size"], 128).tolist()]

    def gen(ps, k: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=k, ignore_eos=True)
        _sync(args.device)
        t = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
        _sync(args.device)
        return time.perf_counter() - t

    def median(fn) -> float:
        fn()
        return statistics.median(fn() for _ in range(3))

    steps = args.tpot_tokens
    tpot = (median(lambda: gen(prompt, 1 + steps)) - median(lambda: gen(prompt, 1))) / steps
    decode_sends = list(sends)
    _, requests, mean_prompt, out = SHAPES[args.shape]
    requests = args.requests or requests
    out = args.output_tokens or out
    ps = workload(requests, mean_prompt, fields["vocab_size"], args.seed)
    gen(ps[:8], 4)  # warm-up
    sends.clear()
    sizes.clear()
    seconds = gen(ps, out)
    label = "-" if tp == 1 and not one_rank else allreduce if args.device == "cuda" else "gloo"
    result = {"tp": tp, "one_rank": one_rank, "allreduce": label, "tpot_ms": tpot * 1e3,
              "tok_s": requests * out / seconds,
              "send_us_batch1": statistics.median(decode_sends) * 1e6 if decode_sends else 0.0,
              "send_us_load": statistics.median(sends) * 1e6 if sends else 0.0,
              "msg_kib_load": statistics.median(sizes) * 4 / 1024 if sizes else 0.0,
              "graph_replays": llm.llm_engine.runner.graph_replays}
    llm.shutdown()
    del llm, driver
    _free()  # (the next size's KV sizing sees this one's memory given back)
    return result


# ---- the collectives of one decode step, alone -------------------------------------------------


def _collectives_rank(rank: int, size: int, port: int, fields: dict, batches: list[int], device_type: str,
                      dtype: torch.dtype, queue, allreduce: str = "nccl") -> None:
    import torch.distributed as dist

    from pagedcore.distributed.group import TensorParallelGroup

    if device_type == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)
    # The engine's own group: NCCL (or gloo) and, with "symm_mem", its symmetric-memory all-reduce.
    group = TensorParallelGroup(rank, size, port, device, symm_dtype=dtype if allreduce == "symm_mem" else None)
    hidden, layers, vocab = fields["hidden_size"], fields["num_hidden_layers"], fields["vocab_size"]
    results = {}
    for b in batches:
        x = torch.randn(b, hidden, device=device).to(dtype)
        local = torch.randn(b, -(-vocab // size), device=device).to(dtype)

        def step() -> None:
            y = x
            for _ in range(2 * layers + 1):  # o and down of each layer, the embedding
                y = group.all_reduce(y)
            group.all_gather_rows(local)

        def floor() -> None:  # as many kernels of the all-reduces' size, no collective: the graph's own cost
            for _ in range(2 * layers + 2):
                x.mul_(1)

        for name, fn in (("step", step), ("floor", floor)):
            if device_type == "cuda":
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    fn()
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    fn()
                run = graph.replay
            elif name == "floor":
                continue
            else:
                run = fn
            for _ in range(5):
                run()
            _sync(device_type)
            dist.barrier()
            reps = 50 if device_type == "cuda" else 10
            t = time.perf_counter()
            for _ in range(reps):
                run()
            _sync(device_type)
            results[f"{name}_us_b{b}"] = (time.perf_counter() - t) / reps * 1e6
    big = torch.empty((128 if device_type == "cuda" else 4) << 20,
                      dtype=torch.bfloat16 if device_type == "cuda" else torch.float32, device=device)
    nbytes = big.numel() * big.element_size()
    for _ in range(3):
        dist.all_reduce(big)
    _sync(device_type)
    reps = 10 if device_type == "cuda" else 2
    t = time.perf_counter()
    for _ in range(reps):
        dist.all_reduce(big)
    _sync(device_type)
    seconds = (time.perf_counter() - t) / reps
    # nccl-tests' convention: bus bandwidth = algbw x 2 (N - 1) / N.
    results["allreduce_busbw_gbs"] = nbytes / seconds * 2 * (size - 1) / size / 1e9
    results["allreduce_mib"] = nbytes / 2**20
    if rank == 0:
        queue.put(results)
    group.destroy()


def collectives(fields: dict, size: int, batches: list[int], args, allreduce: str = "nccl") -> dict:
    import torch.multiprocessing as mp

    from pagedcore.distributed.group import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    dtype = getattr(torch, args.dtype) if args.dtype != "auto" else torch.float32
    port = free_port()
    procs = [ctx.Process(target=_collectives_rank,
                         args=(r, size, port, fields, batches, args.device, dtype, queue, allreduce))
             for r in range(size)]
    for p in procs:
        p.start()
    result = queue.get(timeout=300)
    for p in procs:
        p.join(60)
    return result


# ---- the step message's latency alone -----------------------------------------------------------

CONTROL_ROUNDS = 2000


def _control_peer(mode: str, port: int, ring_paths: tuple, wake_in, wake_out, spin_us: str) -> None:
    """The worker's side of the ping-pong: each message back as it came."""
    os.environ["PAGEDCORE_TP_SPIN_US"] = spin_us
    from pagedcore.distributed import step_message as msg

    buf = np.zeros(msg.INLINE, dtype=np.int32)
    if mode == "gloo":
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=1, world_size=2)
        t = torch.from_numpy(buf)
        for _ in range(CONTROL_ROUNDS + 10):
            dist.broadcast(t, 0)
            dist.broadcast(t, 1)
        dist.destroy_process_group()
        return
    from pagedcore.distributed.control_ring import ControlRing

    inbound = ControlRing.attach(ring_paths[0], 1, 0)
    outbound = ControlRing.attach(ring_paths[1], 1, 0)  # (this side writes the second ring)
    for _ in range(CONTROL_ROUNDS + 10):
        inbound.recv_into(buf, wake_in)
        outbound.send(buf, [wake_out], check=lambda: None)


def control_latency(mode: str, spin_us: str = "1000") -> float:
    """Median one-way time (us) of an INLINE-int message between two processes."""
    import multiprocessing

    from pagedcore.distributed import step_message as msg
    from pagedcore.distributed.control_ring import ControlRing
    from pagedcore.distributed.group import free_port

    os.environ["PAGEDCORE_TP_SPIN_US"] = spin_us
    ctx = multiprocessing.get_context("spawn")
    port = free_port()
    rings = (ControlRing.create(1), ControlRing.create(1)) if mode == "shm" else (None, None)
    to_peer_r, to_peer_w = ctx.Pipe(duplex=False)
    to_me_r, to_me_w = ctx.Pipe(duplex=False)
    paths = tuple(r.path for r in rings) if mode == "shm" else ()
    peer = ctx.Process(target=_control_peer, args=(mode, port, paths, to_peer_r, to_me_w, spin_us))
    peer.start()
    buf = np.zeros(msg.INLINE, dtype=np.int32)
    times = []
    try:
        if mode == "gloo":
            import torch.distributed as dist

            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=2)
            t = torch.from_numpy(buf)
            for i in range(CONTROL_ROUNDS + 10):
                start = time.perf_counter()
                dist.broadcast(t, 0)
                dist.broadcast(t, 1)
                times.append(time.perf_counter() - start)
            dist.destroy_process_group()
        else:
            outbound, inbound = rings
            inbound.reader = 0  # (this side reads the second ring, which it made)
            for i in range(CONTROL_ROUNDS + 10):
                buf[0] = i
                start = time.perf_counter()
                outbound.send(buf, [to_peer_w], check=lambda: None)
                inbound.recv_into(buf, to_me_r)
                times.append(time.perf_counter() - start)
                if spin_us == "0":
                    time.sleep(0.0005)  # (the peer falls asleep on its pipe before the next)
    finally:
        peer.join(30)
        for r in rings:
            if r is not None:
                r.unlink()
    return statistics.median(times[10:]) / 2 * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
    parser.add_argument("--tp", default="1,2", help="comma list of tensor-parallel sizes")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on the CPU")
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--output-tokens", type=int, default=None)
    parser.add_argument("--tpot-tokens", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--collectives", action="store_true", help="also time one decode step's collectives")
    parser.add_argument("--allreduce", default="nccl",
                        help="comma list of PAGEDCORE_TP_ALLREDUCE values for TP > 1 (nccl, symm_mem)")
    parser.add_argument("--one-rank", action="store_true",
                        help="also TP=1 through the tensor-parallel path (a group of one rank), per all-reduce kind")
    parser.add_argument("--control", action="store_true",
                        help="only the step message's latency between two processes (shared memory, gloo)")
    args = parser.parse_args()
    if args.control:
        polling, asleep, gloo = control_latency("shm"), control_latency("shm", "0"), control_latency("gloo")
        print(f"step message ({4 * 4096 // 1024} KiB) one way, median of {CONTROL_ROUNDS}: shared memory "
              f"{polling:.1f} us (reader polling), {asleep:.1f} us (reader asleep on its pipe); gloo {gloo:.1f} us")
        return
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    fields = SHAPES[args.shape][0]
    sizes = [int(s) for s in args.tp.split(",")]
    kinds = [k for k in args.allreduce.split(",") if k]
    for kind in kinds:
        if kind not in ("nccl", "symm_mem"):
            parser.error(f"--allreduce: 'nccl' or 'symm_mem', got {kind!r}")
    rows = []
    with tempfile.TemporaryDirectory() as root:
        path = checkpoint_dir(fields, Path(root))
        for tp in sizes:
            for kind in (kinds if tp > 1 else ["nccl"]):
                rows.append(measure(path, fields, tp, args, kind))
                print(rows[-1], flush=True)
            for kind in (kinds if tp == 1 and args.one_rank else []):
                rows.append(measure(path, fields, tp, args, kind, one_rank=True))
                print(rows[-1], flush=True)
    coll = {}
    if args.collectives:
        batch_max = args.requests or SHAPES[args.shape][1]
        for tp in sizes:
            for kind in (kinds if tp > 1 or args.one_rank else []):
                coll[tp, kind] = collectives(fields, tp, [1, batch_max], args, kind)
                print({"tp": tp, "allreduce": kind if args.device == "cuda" else "gloo", **coll[tp, kind]}, flush=True)
    print(f"\n{args.shape} on {args.device} ({args.dtype}), tensor parallelism")
    print(f"{'tp':>3}{'all-reduce':>13}{'TPOT b1 ms':>12}{'tok/s':>10}{'bcast us b1':>13}{'bcast us load':>15}"
          f"{'msg KiB':>9}{'graphs':>8}")
    for r in rows:
        label = r["allreduce"] + (" 1r" if r["one_rank"] else "")
        print(f"{r['tp']:>3}{label:>13}{r['tpot_ms']:12.2f}{r['tok_s']:10.0f}{r['send_us_batch1']:13.1f}"
              f"{r['send_us_load']:15.1f}{r['msg_kib_load']:9.1f}{r['graph_replays']:8d}")
    for (tp, kind), c in coll.items():
        steps = ", ".join(
            f"batch {k[len('step_us_b'):]}: {v:.1f} us"
            + (f" (as many plain kernels in a graph: {c['floor' + k[4:]]:.1f})" if "floor" + k[4:] in c else "")
            for k, v in c.items() if k.startswith("step_us"))
        name = (kind if args.device == "cuda" else "gloo") + (", one rank" if tp == 1 else "")
        print(f"TP={tp} ({name}) collectives of one decode step "
              f"({2 * fields['num_hidden_layers'] + 1} all-reduces + the logits' all-gather): {steps}"
              + (f"; all-reduce of {c['allreduce_mib']:.0f} MiB: bus bandwidth {c['allreduce_busbw_gbs']:.1f} GB/s"
                 if tp > 1 else ""))
    base = next((r for r in rows if r["tp"] == 1 and not r["one_rank"]), None)
    if base is not None:
        for r in rows:
            if r["one_rank"]:
                print(f"TP=1 through the tensor-parallel path ({r['allreduce']}, one rank) vs TP=1: TPOT "
                      f"x{r['tpot_ms'] / base['tpot_ms']:.3f}, throughput x{r['tok_s'] / base['tok_s']:.3f}")
            if r["tp"] > 1:
                print(f"TP={r['tp']} ({r['allreduce']}) vs TP=1: TPOT x{r['tpot_ms'] / base['tpot_ms']:.2f} "
                      f"(target <= 0.6), throughput x{r['tok_s'] / base['tok_s']:.2f} (target >= 1.6)")


if __name__ == "__main__":
    main()
