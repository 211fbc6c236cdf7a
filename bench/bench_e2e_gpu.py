#!/usr/bin/env python3
"""End-to-end throughput: pagedcore against transformers on the same shapes, one GPU.

Random weights in a real shape (``--shape smollm2`` or ``llama3-8b``; ``tiny`` for a
smoke run), prompts of seeded lognormal lengths made of random token ids, a fixed
number of output tokens with EOS ignored, all requests submitted at once:

* pagedcore: ``LLM(load_format="dummy")``, one ``generate`` call;
* transformers ``generate`` on left-padded batches of ``--hf-batch`` prompts;
* transformers ``generate_batch`` (its paged continuous batching).

Prints output and total tokens/s, peak memory, the ratios, and the physical floor of
the run: for one batch holding every request, the weights read once per output step
plus each step's KV over the copy bandwidth, plus the prefill FLOPs over the matmul
rate, both measured in the same run; pagedcore's time as a multiple of it.

With ``--latency``: time per output token at batch 1 and 16 (128-token prompts) and
time to first token at prompts of 512 and 4096 tokens, pagedcore against transformers
``generate``: each the difference of two timed calls (max_tokens 1 and 129), medians
of three.

With ``--overhead``: the fraction of wall time the GPU sits idle between decode steps
(256 requests of 128-token prompts, 256 outputs): each step's GPU span is timed with
events recorded before the model runs and after sampling, against the host's clock
from the first decode step to the last.

With ``--shared-prefix``: 256 requests behind one 1,000-token system prompt (tails of
20-200 tokens, 128 outputs), prefix caching on against off: hit rate and the ratio of
output tokens per second.

With ``--profile``: where the time of a decode step goes, as run (CUDA graphs on): a
generate call at batch 1 and at 16 (128-token prompts, 64 outputs) under torch.profiler,
the kernel time per step by kernel name, their sum against the step's wall time.

With ``--kernels``: the CUDA kernels one model forward launches, counted with
torch.profiler for a batch-1 decode step (128 tokens cached) and a 512-token
prefill step, in all and per decoder layer (the difference between the model with
all its layers and with one, over the layers removed), with one layer's kernel
names.

With ``--mixed``: what a step that carries prompt tokens costs against a decode-only
step while ``--mixed-rows`` requests decode (issue 14's serving case: a request arrives
while others stream), as the engine runs them (CUDA graphs, async scheduling): each
step's wall time (``LLMEngine.step``), the host time inside the model runner's
``execute``, the GPU span from before the forward pass to after sampling (events), and
under torch.profiler the sum of the step's kernel times and their count. Kernels far
shorter than the GPU span mean the device waits for launches (host-bound pieces).

Usage: python bench/bench_e2e_gpu.py --shape smollm2 [--peers generate,generate_batch]
       [--latency | --overhead | --shared-prefix | --kernels | --profile | --mixed]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

SHAPES = {
    # name: (config fields, requests, mean prompt, output tokens)
    "smollm2": (dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                     num_attention_heads=9, num_key_value_heads=3, head_dim=64, rope_theta=100000.0,
                     tie_word_embeddings=True), 512, 270, 128),
    "llama3-8b": (dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=500000.0,
                       tie_word_embeddings=False), 256, 400, 256),
    "tiny": (dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, rope_theta=10000.0,
                  tie_word_embeddings=True), 16, 40, 8),
}


def checkpoint_dir(fields: dict, root: Path) -> Path:
    """config.json plus a word-level tokenizer over the vocabulary (outputs only decode)."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    config = transformers.LlamaConfig(architectures=["LlamaForCausalLM"], max_position_embeddings=8192,
                                      rms_norm_eps=1e-5, bos_token_id=1,
                                      eos_token_id=2, pad_token_id=0, **fields)
    config.save_pretrained(root)
    vocab = {f"t{i}": i for i in range(fields["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t2", bos_token="t1",
                                         pad_token="t0").save_pretrained(root)
    return root


def workload(n: int, mean_prompt: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    sigma = 0.6
    lens = np.clip(rng.lognormal(np.log(mean_prompt) - sigma**2 / 2, sigma, n), 16, 2048).astype(int)
    return [rng.integers(3, vocab, int(k)).tolist() for k in lens]


def measured_rates(device: str) -> tuple[float, float]:
    """Copy bandwidth (bytes read + written per second) and bf16 matmul FLOP/s."""
    if device != "cuda":
        return float("nan"), float("nan")
    a = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    x = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    y = torch.randn_like(x)

    def timed(fn, reps: int = 10) -> float:
        fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return statistics.median(times)

    bw = 2 * a.numel() / timed(lambda: b.copy_(a))
    flops = 2 * 8192**3 / timed(lambda: x @ y)
    del a, b, x, y
    torch.cuda.empty_cache()
    return bw, flops


def floor_seconds(fields: dict, prompts: list[list[int]], out: int, bw: float, flops: float) -> float:
    h, layers, inter = fields["hidden_size"], fields["num_hidden_layers"], fields["intermediate_size"]
    q, kv = fields["num_attention_heads"] * fields["head_dim"], fields["num_key_value_heads"] * fields["head_dim"]
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * inter
    params = layers * per_layer + fields["vocab_size"] * h * (1 if fields["tie_word_embeddings"] else 2)
    kv_bytes_per_token = 2 * layers * kv * 2
    lens = np.array([len(p) for p in prompts], dtype=np.float64)
    # Decode: every output step reads the weights once and each request's KV so far.
    kv_read = kv_bytes_per_token * np.sum(out * lens + out * (out - 1) / 2)
    decode = (out * 2 * params + kv_read) / bw
    # Prefill: 2 FLOPs per parameter and token, plus causal attention (QK and PV).
    attn = 2 * layers * fields["num_attention_heads"] * fields["head_dim"] * np.sum(lens * lens)
    prefill = (2 * params * lens.sum() + attn) / flops
    return float(decode + prefill)


def run_pagedcore(path: Path, prompts, out: int, args) -> dict:
    from pagedcore import LLM, SamplingParams

    llm = LLM(model=str(path), load_format="dummy", dtype="bfloat16", device=args.device,
              max_model_len=args.max_model_len, gpu_memory_utilization=args.gpu_memory_utilization,
              max_num_seqs=args.max_num_seqs, enforce_eager=args.enforce_eager)
    params = SamplingParams(temperature=0.0, max_tokens=out, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:8]], params, use_tqdm=False)  # warm-up
    if args.device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    if args.device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    assert produced == out * len(prompts), (produced, out * len(prompts))
    stats = llm.stats()
    result = {"seconds": seconds, "output_tokens": produced, "steps": stats["num_steps"],
              "preemptions": stats["num_preemptions"], "peak_gib": _peak(args.device),
              "graph_replays": llm.llm_engine.runner.graph_replays}
    del llm, outs
    _free()
    return result


def hf_model(path: Path, args, attn: str | None = None):
    import transformers

    config = transformers.AutoConfig.from_pretrained(path)
    kw = {"attn_implementation": attn} if attn else {}
    with torch.device(args.device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, **kw)
    return model.eval()


def run_generate(path: Path, prompts, out: int, args) -> dict:
    model = hf_model(path, args)
    model.generation_config.eos_token_id = None
    with torch.inference_mode():  # warm-up
        x = torch.tensor([prompts[0]], device=args.device)
        model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=2, pad_token_id=0)
    start = time.perf_counter()
    produced = 0
    with torch.inference_mode():
        for i in range(0, len(prompts), args.hf_batch):
            batch = prompts[i:i + args.hf_batch]
            width = max(len(p) for p in batch)
            ids = torch.zeros((len(batch), width), dtype=torch.long)
            mask = torch.zeros_like(ids)
            for r, p in enumerate(batch):  # left padding
                ids[r, width - len(p):] = torch.tensor(p)
                mask[r, width - len(p):] = 1
            y = model.generate(ids.to(args.device), attention_mask=mask.to(args.device), do_sample=False,
                               max_new_tokens=out, min_new_tokens=out, pad_token_id=0)
            produced += (y.shape[1] - width) * len(batch)
    if args.device == "cuda":
        torch.cuda.synchronize()
    result = {"seconds": time.perf_counter() - start, "output_tokens": produced, "peak_gib": _peak(args.device)}
    del model
    _free()
    return result


def run_generate_batch(path: Path, prompts, out: int, args) -> dict:
    from transformers.generation import GenerationConfig

    model = None
    for attn in ("paged|sdpa", "sdpa_paged", "paged|eager"):  # the name changed across transformers versions
        try:
            model = hf_model(path, args, attn=attn)
            break
        except ValueError:
            continue
    if model is None:
        raise RuntimeError("no paged attention implementation in this transformers")
    config = GenerationConfig(max_new_tokens=out, min_new_tokens=out, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
    model.generate_batch(inputs=prompts[:8], generation_config=config, progress_bar=False)  # warm-up
    start = time.perf_counter()
    outs = model.generate_batch(inputs=prompts, generation_config=config, progress_bar=False)
    if args.device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    produced = sum(len(o.generated_tokens) for o in outs.values())
    result = {"seconds": seconds, "output_tokens": produced, "peak_gib": _peak(args.device)}
    del model, outs
    _free()
    return result


def latency(path: Path, fields: dict, args) -> None:
    """Time per output token (batch 1, 16) and time to first token (512, 4096)."""
    from pagedcore import LLM, SamplingParams

    rng = np.random.default_rng(args.seed)
    vocab = fields["vocab_size"]

    def prompts_of(n: int, length: int) -> list[list[int]]:
        return [rng.integers(3, vocab, length).tolist() for _ in range(n)]

    def sync() -> None:
        if args.device == "cuda":
            torch.cuda.synchronize()

    def median_time(fn) -> float:
        fn()  # warm-up
        times = []
        for _ in range(3):
            sync()
            t = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - t)
        return statistics.median(times)

    cases = [("TPOT batch 1", 1, 128), ("TPOT batch 16", 16, 128), ("TTFT prompt 512", 1, 512),
             ("TTFT prompt 4096", 1, 4096)]
    # NOTE: no prefix caching: every timed call repeats its case's prompts, and a cached
    # prompt would make the time to first token that of a single token.
    llm = LLM(model=str(path), load_format="dummy", dtype="bfloat16", device=args.device,
              max_model_len=args.max_model_len + 256, gpu_memory_utilization=args.gpu_memory_utilization,
              max_num_seqs=args.max_num_seqs, enforce_eager=args.enforce_eager, enable_prefix_caching=False)
    model = None
    rows = []
    for name, batch, length in cases:
        ps = prompts_of(batch, length)
        steps = 128 if name.startswith("TPOT") else 0

        def ours(k: int) -> float:
            params = SamplingParams(temperature=0.0, max_tokens=k, ignore_eos=True)
            return median_time(lambda: llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False))

        t1 = ours(1)
        mine = (ours(1 + steps) - t1) / steps if steps else t1
        rows.append([name, mine])
    del llm
    _free()
    if "generate" not in args.peers.split(","):  # --peers '': pagedcore alone (a quick look, no ratio)
        print(f"\n{args.shape} latency (ms), pagedcore alone")
        for name, mine in rows:
            print(f"{name:<20}{mine * 1e3:12.2f}")
        return
    model = hf_model(path, args)
    model.generation_config.eos_token_id = None
    for row, (name, batch, length) in zip(rows, cases):
        ps = torch.tensor(prompts_of(batch, length), device=args.device)
        steps = 128 if name.startswith("TPOT") else 0

        def theirs(k: int) -> float:
            with torch.inference_mode():
                return median_time(lambda: model.generate(ps, attention_mask=torch.ones_like(ps), do_sample=False,
                                                          max_new_tokens=k, min_new_tokens=k, pad_token_id=0))

        t1 = theirs(1)
        row.append((theirs(1 + steps) - t1) / steps if steps else t1)
    del model
    _free()
    print(f"\n{args.shape} latency (ms): pagedcore against transformers generate")
    print(f"{'case':<20}{'pagedcore':>12}{'transformers':>14}{'ratio':>8}")
    for name, mine, hf in rows:
        print(f"{name:<20}{mine * 1e3:12.2f}{hf * 1e3:14.2f}{hf / mine:7.2f}x")


def overhead(path: Path, fields: dict, args) -> None:
    """GPU idle fraction between decode steps, and the device's time of a decode
    step against its wall time, at each batch size of --overhead-batches. Events:
    one before each step's CUDA graph is replayed (after the host staged its
    inputs) and one after its sampler; the device idles between a step's end and
    the next one's replay."""
    from pagedcore import LLM, SamplingParams

    batches = [int(b) for b in args.overhead_batches.split(",")]
    llm = LLM(model=str(path), load_format="dummy", dtype="bfloat16", device=args.device,
              max_model_len=args.max_model_len, gpu_memory_utilization=args.gpu_memory_utilization,
              max_num_seqs=max(batches), enforce_eager=args.enforce_eager)
    engine = llm.llm_engine
    rng = np.random.default_rng(args.seed)
    params = SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=True)
    llm.generate([{"prompt_token_ids": rng.integers(3, fields["vocab_size"], 128).tolist()} for _ in range(16)],
                 SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    spans: list[dict] = []  # per step: decode, wall (host time at execute()), launch and end events
    execute, sampler = engine.runner.execute, engine.sampler
    replay = torch.cuda.CUDAGraph.replay

    def timed_execute(batch, *args):  # (async scheduling passes the previous step's sampled ids)
        spans.append({"decode": batch.num_tokens == batch.num_seqs, "wall": time.perf_counter(),
                      "launch": None, "end": None})
        return execute(batch, *args)

    def timed_replay(graph):
        if spans and spans[-1]["launch"] is None:
            spans[-1]["launch"] = torch.cuda.Event(enable_timing=True)
            spans[-1]["launch"].record()
        return replay(graph)

    def timed_sample(*a, **kw):
        out = sampler(*a, **kw)
        spans[-1]["end"] = torch.cuda.Event(enable_timing=True)
        spans[-1]["end"].record()
        return out

    engine.runner.execute, engine.sampler = timed_execute, timed_sample
    torch.cuda.CUDAGraph.replay = timed_replay
    try:
        for b in batches:
            spans.clear()
            prompts = [{"prompt_token_ids": rng.integers(3, fields["vocab_size"], 128).tolist()} for _ in range(b)]
            replays = engine.runner.graph_replays
            llm.generate(prompts, params, use_tqdm=False)
            torch.cuda.synchronize()
            decode = [i for i, sp in enumerate(spans) if sp["decode"] and sp["launch"] and sp["end"]]
            first, last = decode[len(decode) // 10], decode[-2]  # steady state: skip the first tenth
            steady = [spans[i] for i in decode if first <= i < last]
            busy = [sp["launch"].elapsed_time(sp["end"]) / 1e3 for sp in steady]
            wall = spans[last]["wall"] - spans[first]["wall"]
            steps = last - first
            print(f"\n{args.shape}: {b} requests, 128-token prompts, 256 outputs; {len(spans)} steps, "
                  f"{len(decode)} decode steps, {engine.runner.graph_replays - replays} from CUDA graphs")
            print(f"decode steps {first}..{last}: wall {wall * 1e3:.1f} ms, device busy {sum(busy) * 1e3:.1f} ms, "
                  f"idle {1 - sum(busy) / wall:.1%} of the wall time (target <= 5% at 256); "
                  f"{wall / steps * 1e3:.3f} ms per step, of which the device's (graph replay to sampler's end) "
                  f"{sum(busy) / len(busy) * 1e3:.3f} (median {statistics.median(busy) * 1e3:.3f})")
    finally:
        engine.runner.execute, engine.sampler = execute, sampler
        torch.cuda.CUDAGraph.replay = replay
    del llm, engine
    _free()


def shared_prefix(path: Path, fields: dict, args) -> None:
    """Prefix caching on against off over requests that share a system prompt."""
    from pagedcore import LLM, SamplingParams

    rng = np.random.default_rng(args.seed)
    vocab = fields["vocab_size"]
    system = rng.integers(3, vocab, 1000).tolist()
    prompts = [{"prompt_token_ids": system + rng.integers(3, vocab, int(n)).tolist()}
               for n in rng.integers(20, 200, 256)]
    params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    rows = []
    for caching in (True, False):
        llm = LLM(model=str(path), load_format="dummy", dtype="bfloat16", device=args.device,
                  max_model_len=args.max_model_len, gpu_memory_utilization=args.gpu_memory_utilization,
                  max_num_seqs=args.max_num_seqs, enable_prefix_caching=caching, enforce_eager=args.enforce_eager)
        llm.generate(prompts[:4], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        if args.device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        if args.device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        produced = sum(len(o.outputs[0].token_ids) for o in outs)
        rows.append((caching, produced / seconds, llm.stats()["prefix_cache_hit_rate"]))
        del llm, outs
        _free()
    print(f"\n{args.shape}: 256 requests sharing a 1,000-token system prompt, 128 outputs each")
    for caching, tok_s, hit in rows:
        print(f"prefix caching {'on ' if caching else 'off'}: {tok_s:9.0f} output tok/s, hit rate {hit:.1%}")
    print(f"on / off: {rows[0][1] / rows[1][1]:.2f}x output tokens/s")


def kernel_counts(path: Path, fields: dict, args) -> None:
    """CUDA kernels per forward and per layer: batch-1 decode step and 512-token prefill."""
    from collections import Counter

    from torch import nn
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from pagedcore import LLM, ops
    from pagedcore.models import AttentionMetadata

    llm = LLM(model=str(path), load_format="dummy", dtype="bfloat16", device=args.device,
              max_model_len=args.max_model_len, gpu_memory_utilization=args.gpu_memory_utilization,
              max_num_seqs=args.max_num_seqs, enforce_eager=True)
    runner = llm.llm_engine.runner
    model, spec, dev, bs = runner.model, runner.spec, runner.device, runner.block_size

    def step(q_len: int, cached: int):
        seq = cached + q_len
        table = torch.arange(1, -(-seq // bs) + 1, dtype=torch.int32, device=dev)[None]
        positions = torch.arange(cached, seq, dtype=torch.int32, device=dev)
        slots = (table[0, positions.long() // bs] * bs + positions % bs).to(torch.int32)
        md = AttentionMetadata(slot_mapping=slots, block_tables=table,
                               seq_lens=torch.tensor([seq], dtype=torch.int32, device=dev),
                               query_start_loc=torch.tensor([0, q_len], dtype=torch.int32, device=dev))
        if dev.type == "cuda":
            md.plan = ops.plan_attention(np.array([0, q_len]), np.array([seq]), spec.num_heads, spec.num_kv_heads,
                                         dev, spec.head_dim, model.dtype)
        ids = torch.randint(3, spec.vocab_size, (q_len,), dtype=torch.int32, device=dev)

        def run() -> None:
            with ops.unchecked_indices():
                model.compute_logits(model(ids, positions, md, runner.kv_caches)[-1:])
        return run

    def kernels(fn) -> list[str]:
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        return [e.name for e in prof.events() if e.device_type == DeviceType.CUDA
                and not e.name.startswith(("Memcpy", "Memset"))]

    layers = model.layers
    print(f"\n{args.shape}: CUDA kernels of one forward (bf16, eager), {len(layers)} layers")
    print(f"{'step':<28}{'kernels':>9}{'per layer':>11}{'outside layers':>16}")
    one_layer: list[str] = []
    for name, q_len, cached in (("decode, batch 1", 1, 128), ("prefill, 512 tokens", 512, 0)):
        run = step(q_len, cached)
        full = kernels(run)
        model.layers = nn.ModuleList(layers[:1])
        try:
            single = kernels(run)
        finally:
            model.layers = layers
        per_layer = (len(full) - len(single)) / max(1, len(layers) - 1)
        print(f"{name:<28}{len(full):>9}{per_layer:>11.1f}{len(single) - per_layer:>16.1f}")
        if not one_layer:
            one_layer = single
    print("kernels of a decode step with one layer (name: count):")
    for kname, n in Counter(one_layer).most_common():
        print(f"  {n:3d}  {kname[:110]}")


def decode_profile(path: Path, fields: dict, args) -> None:
    """Kernel time per decode step by name, batch 1 and 16, as the engine runs them."""
    from collections import defaultdict

    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from pagedcore import LLM, SamplingParams

    llm = LLM(model=str(path), load_format="dummy", dtype="bfloat16", device=args.device,
              max_model_len=args.max_model_len, gpu_memory_utilization=args.gpu_memory_utilization,
              max_num_seqs=args.max_num_seqs, enforce_eager=args.enforce_eager, enable_prefix_caching=False)
    rng = np.random.default_rng(args.seed)
    if args.profile_prefill:
        _prefill_profile(llm, fields, args, rng)
        return
    for batch in (1, 16):
        prompts = [{"prompt_token_ids": rng.integers(3, fields["vocab_size"], 128).tolist()} for _ in range(batch)]

        def run(k: int) -> None:
            llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=k, ignore_eos=True), use_tqdm=False)
            if args.device == "cuda":
                torch.cuda.synchronize()
        run(8)
        t = time.perf_counter()
        run(1)
        first = time.perf_counter() - t
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            t = time.perf_counter()
            run(65)
            wall = time.perf_counter() - t
        per_step = (wall - first) / 64
        totals: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
        for e in prof.events():
            if e.device_type == DeviceType.CUDA:
                totals[e.name][0] += 1
                totals[e.name][1] += e.device_time_total
        steps = 65
        kernel_us = sum(v[1] for v in totals.values()) / steps
        launches = sum(v[0] for v in totals.values()) / steps
        print(f"\n{args.shape}, batch {batch}: {per_step * 1e3:.3f} ms per decode step (wall, profiled), "
              f"{kernel_us / 1e3:.3f} ms of kernels per step, {launches:.0f} kernels per step")
        print(f"{'us/step':>9}{'calls/step':>11}  kernel")
        for name, (n, us) in sorted(totals.items(), key=lambda kv: -kv[1][1])[:25]:
            print(f"{us / steps:9.1f}{n / steps:11.1f}  {name[:100]}")


def _prefill_profile(llm, fields: dict, args, rng) -> None:
    """Kernel time by name of one prompt of ``--profile-prefill`` tokens (max_tokens 1:
    the time to first token), median wall of 3 unprofiled runs beside it."""
    from collections import defaultdict

    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from pagedcore import SamplingParams

    prompt = [{"prompt_token_ids": rng.integers(3, fields["vocab_size"], args.profile_prefill).tolist()}]

    def run() -> float:
        t = time.perf_counter()
        llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True), use_tqdm=False)
        if args.device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t

    run()
    wall = statistics.median(run() for _ in range(3))
    runs = 3
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            run()
    totals: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            totals[e.name][0] += 1
            totals[e.name][1] += e.device_time_total
    kernel_us = sum(v[1] for v in totals.values()) / runs
    print(f"\n{args.shape}, one prompt of {args.profile_prefill} tokens: {wall * 1e3:.2f} ms to the first token "
          f"(wall, median of 3, unprofiled), {kernel_us / 1e3:.2f} ms of kernels, "
          f"{sum(v[0] for v in totals.values()) / runs:.0f} kernels")
    print(f"{'us':>9}{'calls':>7}  kernel")
    for name, (n, us) in sorted(totals.items(), key=lambda kv: -kv[1][1])[:30]:
        print(f"{us / runs:9.1f}{n / runs:7.1f}  {name[:110]}")
    if args.device == "cuda":
        _prefill_timeline(run)


def _prefill_timeline(run) -> None:
    """Where one run's wall time goes outside the kernels: from the generate() call to
    the first kernel, the GPU's idle gaps between kernels, from the last kernel to the
    call's return (torch.profiler, CPU and CUDA activity, one clock)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            run()
            wall_us = (time.perf_counter() - t0) * 1e6
        cpu = [e.time_range for e in prof.events() if e.device_type == DeviceType.CPU]
        gpu = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                     if e.device_type == DeviceType.CUDA)
        if not cpu or not gpu:
            print("timeline: no events")
            return
        first_cpu, last_cpu = min(r.start for r in cpu), max(r.end for r in cpu)
        idle, big, busy_until = 0.0, [], gpu[0][1]
        for start, end in gpu[1:]:
            if start > busy_until:
                idle += start - busy_until
                big.append((start - busy_until, start - gpu[0][0]))
            busy_until = max(busy_until, end)
        big.sort(reverse=True)
        print(f"timeline of one run ({wall_us / 1e3:.2f} ms wall, profiled): first CPU op to first kernel "
              f"{(gpu[0][0] - first_cpu) / 1e3:.2f} ms, kernels' span {(busy_until - gpu[0][0]) / 1e3:.2f} ms with "
              f"{idle / 1e3:.2f} ms idle inside, last kernel to last CPU op {(last_cpu - busy_until) / 1e3:.2f} ms")
        print("largest idle gaps (us, at ms into the kernels): "
              + ", ".join(f"{g:.0f} @ {at / 1e3:.2f}" for g, at in big[:8]))
    except Exception as exc:  # a diagnostic: never the call's end
        print(f"timeline: {type(exc).__name__}: {exc}")


def mixed_steps(path: Path, fields: dict, args) -> None:
    """Steps with prompt tokens against decode-only steps, ``--mixed-rows`` rows
    decoding, once per value of ``--mixed-graphs`` (PAGEDCORE_MIXED_GRAPHS)."""
    import os

    for tokens in args.mixed_graphs.split(","):
        os.environ["PAGEDCORE_MIXED_GRAPHS"] = tokens
        _mixed_steps(path, fields, args, tokens)
        _free()  # (after the call: its closures hold the engine until it returns)


def _mixed_steps(path: Path, fields: dict, args, mixed_graphs: str) -> None:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from pagedcore import LLM, SamplingParams

    cuda = args.device == "cuda"
    llm = LLM(model=str(path), load_format="dummy", dtype="bfloat16", device=args.device,
              max_model_len=args.max_model_len, gpu_memory_utilization=args.gpu_memory_utilization,
              max_num_seqs=args.max_num_seqs, enforce_eager=args.enforce_eager, enable_prefix_caching=False)
    engine, rng = llm.llm_engine, np.random.default_rng(args.seed)
    vocab, rows = fields["vocab_size"], args.mixed_rows
    execute, sampler = engine.runner.execute, engine.sampler
    sample = sampler.__call__
    # per execute() call: host seconds inside it, its prompt tokens, [start, end] events
    calls: list[list] = []

    # --host-profile: cProfile around execute() of the steps with prompt tokens only
    host_prof: list = [None]

    def timed_execute(batch, *a):
        start = torch.cuda.Event(enable_timing=True) if cuda else None
        if cuda:
            start.record()
        prof = host_prof[0] if batch.num_tokens > batch.num_decode_seqs else None
        t = time.perf_counter()
        if prof is not None:
            prof.enable()
        out = execute(batch, *a)
        if prof is not None:
            prof.disable()
        calls.append([time.perf_counter() - t, batch.num_tokens - batch.num_decode_seqs, start, None])
        return out

    def timed_sample(*a, **kw):
        out = sample(*a, **kw)
        if cuda and calls:
            calls[-1][3] = torch.cuda.Event(enable_timing=True)
            calls[-1][3].record()
        return out

    engine.runner.execute, engine.sampler = timed_execute, timed_sample
    decode_params = SamplingParams(temperature=0.0, max_tokens=args.max_model_len - 256, ignore_eos=True)
    for i in range(rows):
        engine.add_request(f"d{i}", None, rng.integers(3, vocab, 256).tolist(), decode_params)
    for _ in range(8):  # the rows' prefills and a few decode steps
        engine.step()
    tag = iter(range(1 << 30))

    def rounds(prompt: int, k: int) -> list[float]:
        """k rounds of: a request of ``prompt`` tokens (max_tokens 1) added, then 4
        engine steps; returns the steps' wall times (``calls`` gets their execute calls)."""
        calls.clear()
        walls = []
        for _ in range(k):
            for _ in range(args.mixed_split if prompt else 0):  # (--mixed-split requests of P / K tokens)
                engine.add_request(f"p{next(tag)}", None, rng.integers(3, vocab, prompt // args.mixed_split).tolist(),
                                   SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
            for _ in range(4):
                t = time.perf_counter()
                engine.step()
                walls.append(time.perf_counter() - t)
        if cuda:
            torch.cuda.synchronize()
        return walls

    by_name: dict[int, dict[str, list[float]]] = {}  # prompt -> kernel name -> [us, calls] a round

    def kernels(prompt: int) -> tuple[float, float]:
        """(kernel ms, launches) of one round of 4 steps, under torch.profiler."""
        if not cuda:
            return float("nan"), float("nan")
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            rounds(prompt, 4)
        events = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
        names = by_name.setdefault(prompt, {})
        for e in events:
            entry = names.setdefault(e.name, [0.0, 0.0])
            entry[0] += e.device_time_total / 4
            entry[1] += 0.25
        return sum(e.device_time_total for e in events) / 1e3 / 4, len(events) / 4

    def med(values) -> float:
        values = list(values)
        return statistics.median(values) if values else float("nan")

    arrive = "a request of P prompt tokens arrives" if args.mixed_split == 1 else \
        f"{args.mixed_split} requests of P / {args.mixed_split} prompt tokens arrive"
    print(f"\n{args.shape}: {rows} rows decoding (256-token prompts); every 4 steps {arrive} "
          f"(max_tokens 1); PAGEDCORE_MIXED_GRAPHS={mixed_graphs}; medians, ms per step")
    print(f"{'P':>5}{'step':>8}{'wall':>8}{'host in execute':>17}{'GPU span':>10}{'kernels':>9}{'launches':>10}")
    base_ms = base_n = float("nan")
    prompts = [0] + [int(x) for x in args.mixed_prompts.split(",") if int(x) > 0]
    for prompt in prompts:
        rounds(prompt, 2)  # warm-up
        walls = rounds(prompt, 12)
        ms, n = kernels(prompt)
        if prompt == 0:
            base_ms, base_n = ms / 4, n / 4
        for mixed in ((False,) if prompt == 0 else (True, False)):
            sel = [i for i, c in enumerate(calls[:len(walls)]) if (c[1] > 0) == mixed]
            span = med(calls[i][2].elapsed_time(calls[i][3]) for i in sel if cuda and calls[i][3] is not None)
            # The mixed step's kernels: the round's less three decode-only steps'.
            k_ms, k_n = (ms - 3 * base_ms, n - 3 * base_n) if mixed else (base_ms, base_n)
            print(f"{prompt:>5}{'mixed' if mixed else 'decode':>8}{med(walls[i] for i in sel) * 1e3:8.3f}"
                  f"{med(calls[i][0] for i in sel) * 1e3:17.3f}{span:10.3f}{k_ms:9.3f}{k_n:10.0f}")
    if args.mixed_kernels and cuda:
        # What a mixed step adds by kernel name: its round less three decode-only steps
        # (a quarter of the P = 0 round each), against one decode-only step.
        base = by_name.get(0, {})
        for prompt in prompts[1:]:
            rows_ = []
            for name in set(by_name[prompt]) | set(base):
                us, n = by_name[prompt].get(name, [0.0, 0.0])
                b_us, b_n = base.get(name, [0.0, 0.0])
                rows_.append((us - 0.75 * b_us, n - 0.75 * b_n, b_us / 4, b_n / 4, name))
            rows_.sort(key=lambda r: -r[0])
            print(f"\nP = {prompt}: a mixed step's kernels by name against a decode-only step's (us, calls)")
            print(f"{'mixed us':>9}{'calls':>7}{'decode us':>10}{'calls':>7}  kernel")
            for us, n, b_us, b_n, name in rows_[:args.mixed_kernels]:
                # (without the namespaces: the template arguments tell the attention launches apart)
                short = name.replace("void ", "", 1).replace("pagedcore::cuda::(anonymous namespace)::", "")
                print(f"{us:9.1f}{n:7.1f}{b_us:10.1f}{b_n:7.1f}  {short[:150]}")
    if args.host_profile:
        import cProfile
        import io
        import pstats

        host_prof[0] = cProfile.Profile()
        rounds(prompts[-1], 8)
        host_prof[0], prof = None, host_prof[0]
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
        print(f"\nhost time inside execute() of 8 steps with {prompts[-1]} prompt tokens (cProfile, by own time):")
        print("\n".join(line for line in text.getvalue().splitlines() if line.strip())[:6000])
    runner = engine.runner
    print("(wall: the engine.step() call that launched the step; with async scheduling it also waits for the "
          "step before. kernels: a mixed step's = its round's less three decode-only steps')")
    print(f"steps replayed: {runner.mixed_graph_replays} whole mixed graphs, {runner.prefill_graph_replays} "
          f"piecewise, {runner.graph_replays} decode graphs")
    del engine.runner.execute  # (the wrappers' cycle through the engine)
    engine.sampler = sampler
    del llm, engine, runner, calls


def _peak(device: str) -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan")


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--mean-prompt", type=int, default=None)
    parser.add_argument("--output-tokens", type=int, default=None)
    parser.add_argument("--peers", default="generate,generate_batch", help="comma list; empty: none")
    parser.add_argument("--hf-batch", type=int, default=64, help="prompts per padded generate() batch")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--latency", action="store_true", help="the latency cases instead of throughput")
    parser.add_argument("--overhead", action="store_true", help="the GPU idle fraction between decode steps")
    parser.add_argument("--overhead-batches", default="256", help="--overhead: batch sizes, comma list")
    parser.add_argument("--shared-prefix", action="store_true", help="prefix caching on against off")
    parser.add_argument("--kernels", action="store_true", help="CUDA kernels per layer of a decode and a prefill step")
    parser.add_argument("--profile", action="store_true", help="kernel time per decode step by name, batch 1 and 16")
    parser.add_argument("--profile-prefill", type=int, default=0, metavar="TOKENS",
                        help="--profile: kernel time by name of one prompt of TOKENS tokens instead")
    parser.add_argument("--mixed", action="store_true", help="steps with prompt tokens against decode-only steps")
    parser.add_argument("--mixed-rows", type=int, default=40, help="--mixed: the rows decoding meanwhile")
    parser.add_argument("--host-profile", action="store_true",
                        help="--mixed: also cProfile the host work inside execute() of steps with the longest P")
    parser.add_argument("--mixed-graphs", default="0,1024", help="--mixed: PAGEDCORE_MIXED_GRAPHS values to run, comma list")
    parser.add_argument("--mixed-split", type=int, default=1, metavar="K",
                        help="--mixed: the P prompt tokens as K requests of P / K tokens (serving's mixed steps)")
    parser.add_argument("--mixed-kernels", type=int, default=0, metavar="N",
                        help="--mixed: the N largest kernels by name of a mixed step against a decode-only step")
    parser.add_argument("--mixed-prompts", default="16,64,256,512",
                        help="--mixed: the prompt lengths P, comma list (the last one's steps are --host-profile's)")
    args = parser.parse_args()
    if args.mixed_split < 1:
        parser.error(f"--mixed-split must be at least 1, got {args.mixed_split}")
    fields, n, mean_prompt, out = SHAPES[args.shape]
    n = args.requests or n
    mean_prompt = args.mean_prompt or mean_prompt
    out = args.output_tokens or out
    torch.manual_seed(args.seed)
    mode = (latency if args.latency else overhead if args.overhead else shared_prefix if args.shared_prefix
            else kernel_counts if args.kernels else decode_profile if args.profile
            else mixed_steps if args.mixed else None)
    if mode is not None:
        with tempfile.TemporaryDirectory() as tmp:
            mode(checkpoint_dir(fields, Path(tmp)), fields, args)
        return
    prompts = workload(n, mean_prompt, fields["vocab_size"], args.seed)
    bw, flops = measured_rates(args.device)
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = checkpoint_dir(fields, Path(tmp))
        results["pagedcore"] = run_pagedcore(path, prompts, out, args)
        for peer in filter(None, args.peers.split(",")):
            try:
                results[peer] = {"generate": run_generate, "generate_batch": run_generate_batch}[peer](
                    path, prompts, out, args)
            except Exception as exc:  # a peer that cannot run here is reported, not fatal
                results[peer] = {"error": f"{type(exc).__name__}: {exc}"}
    floor = floor_seconds(fields, prompts, out, bw, flops)
    total_prompt = sum(len(p) for p in prompts)
    print(f"\n{args.shape}: {n} requests, mean prompt {total_prompt / n:.0f} tokens, {out} output tokens each, "
          f"EOS ignored, seed {args.seed}; copy {bw / 1e12:.2f} TB/s, bf16 matmul {flops / 1e12:.0f} TFLOP/s")
    print(f"{'engine':<16}{'seconds':>10}{'out tok/s':>12}{'total tok/s':>13}{'peak GiB':>10}")
    for name, r in results.items():
        if "error" in r:
            print(f"{name:<16}  failed: {r['error'][:120]}")
            continue
        r["out_tok_s"] = r["output_tokens"] / r["seconds"]
        r["total_tok_s"] = (r["output_tokens"] + total_prompt) / r["seconds"]
        print(f"{name:<16}{r['seconds']:10.2f}{r['out_tok_s']:12.0f}{r['total_tok_s']:13.0f}{r['peak_gib']:10.1f}")
    ours = results["pagedcore"]
    print(f"pagedcore: {ours['steps']} engine steps, {ours['preemptions']} preemptions, "
          f"{ours['graph_replays']} CUDA-graph decode steps")
    for name, r in results.items():
        if name != "pagedcore" and "out_tok_s" in r:
            print(f"pagedcore / {name}: {ours['out_tok_s'] / r['out_tok_s']:.2f}x output tokens/s")
    print(f"physical floor of the run: {floor:.2f} s; pagedcore at {ours['seconds'] / floor:.2f}x it")
    if args.json:
        Path(args.json).write_text(json.dumps({"shape": args.shape, "floor_s": floor, "results": results}, indent=1))


if __name__ == "__main__":
    main()
