"""LLM on the GPU against Hugging Face transformers on the GPU, same weights:
greedy tokens in float32 for a tiny Llama and for the SmolLM2 shape (random
weights), bfloat16 close to float32, and paging (copy-on-write, preemption in
both modes, prefix caching) that never changes greedy outputs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.cuda

transformers = pytest.importorskip("transformers")

from pagedcore import LLM, SamplingParams  # noqa: E402
from test_models_hf import make_checkpoint, prompts  # noqa: E402
from test_half_precision import assert_tracks_float32  # noqa: E402


def add_toy_tokenizer(path: Path, vocab_size: int) -> None:
    """A word-level tokenizer over ids 0..vocab_size-1 (outputs only need decoding)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t2", bos_token="t1", pad_token="t0")
    fast.save_pretrained(path)


def smollm2_shape_checkpoint(root: Path) -> Path:
    config = transformers.LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=2048,
        rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True, initializer_range=0.1,
        bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )
    torch.manual_seed(99)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    path = root / "smollm2-shape"
    model.save_pretrained(path)
    return path


def hf_greedy_gpu(path: Path, ps: list[list[int]], n: int) -> list[list[int]]:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda()
    model.generation_config.eos_token_id = None
    outs = []
    for p in ps:
        x = torch.tensor([p], device="cuda")
        y = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n, pad_token_id=0)
        outs.append(y[0, len(p):].tolist())
    del model
    torch.cuda.empty_cache()
    return outs


def generate(llm: LLM, ps, n: int, **kw) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    path = make_checkpoint("llama", tmp_path_factory.mktemp("gpu"))
    add_toy_tokenizer(path, 384)
    return path


def test_tiny_llama_greedy_equals_transformers_on_gpu(tiny) -> None:
    ps = prompts()
    llm = LLM(model=str(tiny), device="cuda", dtype="float32", num_kv_blocks=256, max_model_len=256)
    assert llm.llm_engine.device.type == "cuda"
    assert generate(llm, ps, 32) == hf_greedy_gpu(tiny, ps, 32)


@pytest.fixture(scope="module")
def smollm2_shape(tmp_path_factory) -> Path:
    path = smollm2_shape_checkpoint(tmp_path_factory.mktemp("smollm2"))
    add_toy_tokenizer(path, 49152)
    return path


def test_smollm2_shape_greedy_equals_transformers_on_gpu(smollm2_shape) -> None:
    path = smollm2_shape
    g = torch.Generator().manual_seed(11)
    ps = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (7, 64, 200, 333)]
    llm = LLM(model=str(path), device="cuda", dtype="float32", num_kv_blocks=512, max_model_len=1024)
    assert generate(llm, ps, 32) == hf_greedy_gpu(path, ps, 32)


def test_bfloat16_decode_tracks_float32_over_many_steps(tiny) -> None:
    half = LLM(model=str(tiny), device="cuda", dtype="bfloat16", num_kv_blocks=64, max_model_len=256)
    assert_tracks_float32(half, tiny, prompts(), steps=40, device="cuda")


@pytest.mark.parametrize("variant", ["no-prefix-cache", "preempt-recompute", "preempt-swap"])
def test_paging_never_changes_greedy_outputs_on_gpu(variant, tmp_path) -> None:
    path = make_checkpoint("mistral", tmp_path)
    add_toy_tokenizer(path, 384)
    ps = prompts() + prompts()[:2]
    base = dict(model=str(path), device="cuda", dtype="float32", max_model_len=256, num_kv_blocks=256)
    expected = generate(LLM(**base), ps, 32)
    kwargs = dict(base)
    if variant == "no-prefix-cache":
        kwargs["enable_prefix_caching"] = False
    else:
        kwargs.update(num_kv_blocks=14, max_model_len=128, preemption_mode=variant.split("-")[1], swap_space=0.01)
    llm = LLM(**kwargs)
    assert generate(llm, ps, 32) == expected
    stats = llm.stats()
    if variant != "no-prefix-cache":
        assert stats["num_preemptions"] > 0
    if variant == "preempt-swap":
        assert stats["num_swap_preemptions"] > 0
    assert stats["num_free_blocks"] == stats["num_blocks"]


def test_beam_search_copy_on_write_equals_transformers_on_gpu(tiny) -> None:
    from pagedcore import BeamSearchParams

    llm = LLM(model=str(tiny), device="cuda", dtype="float32", num_kv_blocks=256, max_model_len=256)
    ps = prompts()[:2]
    outs = llm.beam_search([{"prompt_token_ids": p} for p in ps], BeamSearchParams(beam_width=3, max_tokens=10, ignore_eos=True))
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).cuda()
    model.generation_config.eos_token_id = None
    for p, out in zip(ps, outs):
        x = torch.tensor([p], device="cuda")
        ref = model.generate(x, attention_mask=torch.ones_like(x), num_beams=3, num_return_sequences=3,
                             do_sample=False, max_new_tokens=10, early_stopping=False, pad_token_id=0)
        assert [s.tokens for s in out.sequences] == ref.tolist()
    assert llm.stats()["num_free_blocks"] == llm.stats()["num_blocks"]


def test_default_sizing_uses_gpu_memory_utilization(tiny) -> None:
    llm = LLM(model=str(tiny), device="cuda", dtype="bfloat16", gpu_memory_utilization=0.3, max_model_len=256)
    free, total = torch.cuda.mem_get_info()
    used_by_cache = sum(k.numel() * k.element_size() * 2 for k, _ in llm.llm_engine.runner.kv_caches)
    assert 0.15 * total < used_by_cache < 0.3 * total


def test_cuda_graphs_replay_decode_steps_with_eager_outputs(tiny) -> None:
    # Decode steps replay captured graphs. At a ladder size (8 rows: the same matrix
    # shapes as eager) the tokens equal the eager run's exactly, in float32 and
    # bfloat16; padded up to the ladder (5 rows -> 8) they equal transformers'.
    eight = (prompts() * 2)[:8]
    for dtype in ("float32", "bfloat16"):
        kw = dict(model=str(tiny), device="cuda", dtype=dtype, num_kv_blocks=256, max_model_len=256)
        graphed = LLM(**kw)
        runner = graphed.llm_engine.runner
        assert 1 in runner.graphs and 8 in runner.graphs
        out = generate(graphed, eight, 24)
        assert runner.graph_replays >= 20
        eager = LLM(**kw, enforce_eager=True)
        assert not eager.llm_engine.runner.graphs
        assert generate(eager, eight, 24) == out
        assert eager.llm_engine.runner.graph_replays == 0
        assert graphed.stats()["num_free_blocks"] == graphed.stats()["num_blocks"]
    five = (prompts() * 2)[:5]
    graphed = LLM(model=str(tiny), device="cuda", dtype="float32", num_kv_blocks=256, max_model_len=256)
    assert generate(graphed, five, 24) == hf_greedy_gpu(tiny, five, 24)
    assert graphed.llm_engine.runner.graph_replays >= 20


def test_the_start_up_replays_of_the_graphs_write_no_cache_slot(tiny, monkeypatch) -> None:
    # Every decode and mixed graph is replayed once right after its capture (its upload
    # falls on the start-up), over the padding inputs: no cache slot may change. The
    # caches start as zeros here (pagedcore's own start as torch.empty but the null block).
    import pagedcore.model_runner as model_runner

    monkeypatch.setattr(model_runner, "_empty_cache", lambda shape, dtype, device: torch.zeros(
        shape, dtype=dtype, device=device))
    monkeypatch.setenv("PAGEDCORE_MIXED_GRAPHS", "48")
    llm = LLM(model=str(tiny), device="cuda", dtype="float32", num_kv_blocks=128, max_model_len=256,
              max_num_batched_tokens=48)
    runner = llm.llm_engine.runner
    assert 1 in runner.graphs and 8 in runner.graphs and sorted(runner.mixed_graphs) == [16, 32, 48]
    torch.cuda.synchronize()
    assert all(int(torch.count_nonzero(c)) == 0 for pair in runner.kv_caches for c in pair)
    assert runner.graph_replays == 0 and runner.mixed_graph_replays == 0  # (start-up replays are not steps)
    ps = prompts()[:3]
    assert generate(llm, ps, 8) == hf_greedy_gpu(tiny, ps, 8)


def test_the_sampling_warm_up_changes_no_token_and_no_random_draw(tiny, monkeypatch) -> None:
    # At start-up a CUDA engine runs a greedy step's logits, sampler and host copy for
    # every row count up to max_num_seqs (PAGEDCORE_WARM_SAMPLING, on by default): greedy
    # draws nothing from the RNG, so unseeded random sampling after it (the global RNG,
    # seeded by the engine's seed) gives the same tokens as an engine without it.
    ps = prompts()[:4]
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, ignore_eos=True)
    outs = {}
    for value in ("0", "1"):
        monkeypatch.setenv("PAGEDCORE_WARM_SAMPLING", value)
        llm = LLM(model=str(tiny), device="cuda", dtype="float32", num_kv_blocks=128, max_model_len=256,
                  max_num_seqs=40, seed=3)
        outs[value] = [o.outputs[0].token_ids
                       for o in llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)]
        assert llm.stats()["num_free_blocks"] == llm.stats()["num_blocks"]
    assert outs["1"] == outs["0"]
    assert outs["1"] != generate(llm, ps, 12)  # (random draws: not the greedy tokens)


def test_fp8_kv_cache_tracks_an_e4m3_reference_over_many_steps(tiny) -> None:
    # An e4m3 cache (half the bytes, scales of 1) against transformers whose
    # attention reads K and V rounded to e4m3 the same way: every one of 40 decode
    # steps (not only the first token) as close to float32 as transformers in bfloat16.
    fp8 = LLM(model=str(tiny), device="cuda", dtype="bfloat16", kv_cache_dtype="fp8", num_kv_blocks=64,
              max_model_len=256)
    k_cache, _ = fp8.llm_engine.runner.kv_caches[0]
    assert k_cache.dtype == torch.float8_e4m3fn
    assert_tracks_float32(fp8, tiny, prompts(), steps=40, device="cuda", fp8_kv=True)
    assert fp8.stats()["num_free_blocks"] == fp8.stats()["num_blocks"]


def test_fp8_kv_cache_at_head_dim_128_tracks_an_e4m3_reference(tmp_path) -> None:
    # Head dim 128 with an fp8 cache: prompt tiles go to the Hopper prefill kernel over
    # fp8 (wgmma-tma-fp8, the default there on sm_90; mma.sync elsewhere), inside the
    # whole graph of a mixed step by default; decode rows to the decode kernel. The
    # reference: transformers reading K and V rounded to e4m3, as above.
    config = transformers.LlamaConfig(
        vocab_size=384, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=128, max_position_embeddings=1024, rms_norm_eps=1e-5,
        rope_theta=10000.0, initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    torch.manual_seed(128)
    path = tmp_path / "head-dim-128"
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    add_toy_tokenizer(path, 384)
    gen = torch.Generator().manual_seed(128)
    ps = [torch.randint(3, 384, (n,), generator=gen).tolist() for n in (40, 130, 257)]
    fp8 = LLM(model=str(path), device="cuda", dtype="bfloat16", kv_cache_dtype="fp8", num_kv_blocks=128,
              max_model_len=512)
    assert fp8.llm_engine.runner.kv_caches[0][0].dtype == torch.float8_e4m3fn
    assert_tracks_float32(fp8, path, ps, steps=40, device="cuda", fp8_kv=True)
    assert fp8.stats()["num_free_blocks"] == fp8.stats()["num_blocks"]


def test_async_output_processing_changes_no_output_on_gpu(tiny) -> None:
    # On by default on CUDA: the same greedy, seeded (with penalties) and
    # stop-string outputs as processing each step before the next, no block leaked.
    ps = [{"prompt_token_ids": p} for p in prompts()]
    kw = dict(model=str(tiny), device="cuda", dtype="float32", num_kv_blocks=256, max_model_len=256)
    sync = LLM(**kw, async_output_proc=False)
    overlapped = LLM(**kw)
    assert overlapped.llm_engine._async_output and not sync.llm_engine._async_output
    greedy = sync.generate(ps, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    stops = [o.outputs[0].text[4:8] for o in greedy]
    params = [SamplingParams(temperature=0.0, max_tokens=24, stop=[s]) for s in stops]
    params += [SamplingParams(temperature=1.0, seed=5, n=2, max_tokens=24, presence_penalty=0.5,
                              repetition_penalty=1.2, stop=[stops[0]])] * len(ps)

    def run(llm: LLM) -> list:
        outs = llm.generate(ps + ps, params, use_tqdm=False)
        assert llm.stats()["num_free_blocks"] == llm.stats()["num_blocks"]
        return [[(c.text, c.token_ids, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outs]

    expected = run(sync)
    assert sum(c[3] == s for out, s in zip(expected, stops) for c in out) == len(stops)
    assert run(overlapped) == expected


def test_chunked_prefill_of_long_prompts_equals_transformers_on_gpu(tiny) -> None:
    # 200-token prompts in 32-token chunks: six steps in a row with no sample (no
    # synchronisation) reuse the runner's pinned staging buffers.
    gen = torch.Generator().manual_seed(3)
    ps = [torch.randint(3, 384, (200,), generator=gen).tolist() for _ in range(2)]
    llm = LLM(model=str(tiny), device="cuda", dtype="float32", num_kv_blocks=256, max_model_len=256,
              max_num_seqs=4, max_num_batched_tokens=32)
    assert generate(llm, ps, 8) == hf_greedy_gpu(tiny, ps, 8)
    assert llm.stats()["num_free_blocks"] == llm.stats()["num_blocks"]


@pytest.mark.parametrize("whole", [False, True], ids=["pieces", "whole"])
def test_prefill_graphs_replay_prefill_and_mixed_steps(tiny, monkeypatch, whole) -> None:
    # Steps that are not pure decode replay the layer pieces captured for their padded
    # token count (attention eagerly between them): 48-token chunks, mixed steps and
    # steps above the decode graphs' sizes. With PAGEDCORE_MIXED_GRAPHS=48 the same
    # steps (all of up to 48 tokens) replay one whole graph each instead, attention
    # inside over a padded plan. float32 tokens equal transformers'.
    monkeypatch.setenv("PAGEDCORE_MIXED_GRAPHS", "48" if whole else "0")
    gen = torch.Generator().manual_seed(5)
    ps = prompts() + [torch.randint(3, 384, (150,), generator=gen).tolist()]
    llm = LLM(model=str(tiny), device="cuda", dtype="float32", num_kv_blocks=256, max_model_len=256,
              max_num_batched_tokens=48)
    runner = llm.llm_engine.runner
    assert sorted(runner.prefill_graphs) == [16, 32, 48]
    assert sorted(runner.mixed_graphs) == ([16, 32, 48] if whole else [])
    assert generate(llm, ps, 24) == hf_greedy_gpu(tiny, ps, 24)
    assert (runner.mixed_graph_replays if whole else runner.prefill_graph_replays) >= 4
    assert llm.stats()["num_free_blocks"] == llm.stats()["num_blocks"]
    if whole:
        return
    eager = LLM(model=str(tiny), device="cuda", dtype="float32", num_kv_blocks=256, max_model_len=256,
                max_num_batched_tokens=48, enforce_eager=True)
    assert not eager.llm_engine.runner.prefill_graphs


@pytest.mark.parametrize("tile_spare", ["0", "1"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_chunks_over_long_contexts_replay_whole_graphs_with_split_tiles(smollm2_shape, monkeypatch, dtype,
                                                                        tile_spare) -> None:
    # A 40-token prompt decodes while a 1,100-token one is chunked beside it (64
    # tokens a step: the short one's prefill and 24 of the long one, then one decode
    # row and 63 prompt tokens a step). The chunks of rows over 1,024 keys (ending at
    # 1,032, 1,095 and 1,100) are split 4 ways by plan_attention, so the unsplit whole
    # graphs refuse them and the graphs whose tiles split (padded_tile_splits) take
    # them: 3 in float32; 2 in bfloat16, whose last 5-token chunk is a decode row of
    # 5 queries. float32 tokens equal transformers'; bfloat16 (the tensor-core kernels
    # with their in-kernel merge of the splits, decode rows beside split tiles) stays
    # as close to float32 as transformers in bfloat16 does. PAGEDCORE_MIXED_TILE_SPARE=1:
    # the graphs' tile items past the step's are spare (no CTA computes them).
    from pagedcore.ops import planning

    monkeypatch.setenv("PAGEDCORE_MIXED_TILE_SPARE", tile_spare)
    g = torch.Generator().manual_seed(12)
    ps = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (40, 1100)]
    llm = LLM(model=str(smollm2_shape), device="cuda", dtype=dtype, num_kv_blocks=256, max_model_len=2048,
              max_num_batched_tokens=64, max_num_seqs=4)
    runner = llm.llm_engine.runner
    assert sorted(runner.split_mixed_graphs) == [16, 32, 64]
    assert runner.split_mixed_graphs[64].plan.plan.num_splits == planning.padded_tile_splits(
        64, 9, 3, runner.model.dtype, torch.device("cuda"), 2048) > 1
    if dtype == "float32":
        assert generate(llm, ps, 24) == hf_greedy_gpu(smollm2_shape, ps, 24)
    else:
        assert_tracks_float32(llm, smollm2_shape, ps, steps=24, device="cuda")
    assert runner.split_mixed_graph_replays == (3 if dtype == "float32" else 2)
    assert llm.stats()["num_free_blocks"] == llm.stats()["num_blocks"]


def test_mixed_graphs_equal_the_pieces_in_bfloat16(tiny, monkeypatch) -> None:
    # bfloat16: rows of a few queries go to the decode kernel inside the graph too.
    # Contexts stay short (no key splits either way), so the graph computes what the
    # pieces with eager attention compute, with or without spare tile items
    # (PAGEDCORE_MIXED_TILE_SPARE=1).
    gen = torch.Generator().manual_seed(6)
    ps = [torch.randint(3, 384, (int(n),), generator=gen).tolist() for n in (5, 40, 90, 3, 61, 17)]
    runs, replays = {}, {}
    for tokens, tile_spare in (("0", "0"), ("64", "0"), ("64 spare", "1")):
        monkeypatch.setenv("PAGEDCORE_MIXED_GRAPHS", tokens.split()[0])
        monkeypatch.setenv("PAGEDCORE_MIXED_TILE_SPARE", tile_spare)
        llm = LLM(model=str(tiny), device="cuda", dtype="bfloat16", num_kv_blocks=256, max_model_len=256,
                  max_num_batched_tokens=64, max_num_seqs=4)
        runs[tokens] = generate(llm, ps, 16)
        replays[tokens] = llm.llm_engine.runner.mixed_graph_replays
        assert llm.stats()["num_free_blocks"] == llm.stats()["num_blocks"]
        del llm
    assert replays["0"] == 0 and replays["64"] >= 4 and replays["64 spare"] >= 4
    assert runs["64"] == runs["0"] and runs["64 spare"] == runs["0"]


def test_a_whole_graph_over_1024_tokens_takes_more_than_eight_prompts(tiny, monkeypatch) -> None:
    # The whole graphs above 1024 tokens hold a tiled row every 128 tokens
    # (model_runner.mixed_graph_tile_rows): 14 prompts of 100 tokens, all admitted
    # in the first step (1,400 tokens, 14 rows cut into tiles), replay the graph of
    # 2048 tokens, and the pieces never run. float32 tokens equal transformers'.
    from pagedcore.model_runner import mixed_graph_tile_rows

    monkeypatch.setenv("PAGEDCORE_MIXED_GRAPHS", "2048")
    gen = torch.Generator().manual_seed(8)
    ps = [torch.randint(3, 384, (100,), generator=gen).tolist() for _ in range(14)]
    llm = LLM(model=str(tiny), device="cuda", dtype="float32", num_kv_blocks=256, max_model_len=256,
              max_num_batched_tokens=2048)
    runner = llm.llm_engine.runner
    assert mixed_graph_tile_rows(1024) == 8 and mixed_graph_tile_rows(2048) == 16
    assert max(runner.mixed_graphs) == 2048
    assert generate(llm, ps, 8) == hf_greedy_gpu(tiny, ps, 8)
    assert runner.mixed_graph_replays >= 1 and runner.prefill_graph_replays == 0
    assert llm.stats()["num_free_blocks"] == llm.stats()["num_blocks"]
