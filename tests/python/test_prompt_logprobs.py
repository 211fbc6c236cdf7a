"""SamplingParams.prompt_logprobs on the real default model (float32) against
transformers' log-softmax over the same text and weights: values within 2e-4,
top-k sets, ranks and decoded tokens exact; with a prefix cached by an earlier
request, with chunked prefill (and async output processing), with n > 1 and across
recompute preemptions."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import pagedcore  # noqa: E402
import pagedcore.prompt_logprobs  # noqa: E402
from pagedcore import LLM, SamplingParams  # noqa: E402

# 2+ blocks of 16 tokens shared by the prompts below, then different endings.
PREFIX = ("The quick brown fox jumps over the lazy dog. Paging splits the key-value cache of every "
          "sequence into fixed-size blocks that a block table maps, so that memory is")
ENDINGS = [" allocated on demand and shared between requests.", " never wasted on padding, they say.",
           " a pool of pages, like an operating system's."]
TOL = 2e-4


@pytest.fixture(scope="module")
def model_dir() -> str:
    return pagedcore.default_model_path()


@pytest.fixture(scope="module")
def llm(model_dir) -> LLM:
    return LLM(model=model_dir, dtype="float32", num_kv_blocks=128, max_model_len=512, max_num_seqs=8)


@pytest.fixture(scope="module")
def tokenizer(llm):
    return llm.get_tokenizer()


@pytest.fixture(scope="module")
def hf_model(model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    ids = [tokenizer.encode(PREFIX + e) for e in ENDINGS]
    shared = min(next(i for i, (a, b) in enumerate(zip(ids[0], p)) if a != b) for p in ids[1:])
    assert shared >= 32  # two whole blocks of 16 can come from the prefix cache
    return ids


def reference(hf_model, ids: list[int], k: int) -> list[tuple[float, int, list[int]]]:
    """(logprob, rank, top-k ids) of prompt tokens 1.. from transformers' logits."""
    with torch.no_grad():
        logprobs = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)
    out = []
    for p in range(1, len(ids)):
        row = logprobs[p - 1]
        own = row[ids[p]]
        out.append((own.item(), int((row >= own).sum()), row.topk(k).indices.tolist()))
    return out


def check(prompt_logprobs, ids: list[int], ref, k: int, tokenizer) -> None:
    assert prompt_logprobs is not None and len(prompt_logprobs) == len(ids)
    assert prompt_logprobs[0] is None
    worst = 0.0
    for p, (entry, (value, rank, top)) in enumerate(zip(prompt_logprobs[1:], ref), start=1):
        token = ids[p]
        assert next(iter(entry)) == token  # the prompt token comes first, as in vLLM
        got = entry[token]
        worst = max(worst, abs(got.logprob - value))
        assert got.rank == rank, (p, got, rank)
        expected = {token: rank} | {tid: r for r, tid in enumerate(top, start=1)}
        assert {tid: lp.rank for tid, lp in entry.items()} == expected, p
        for tid, lp in entry.items():
            assert lp.decoded_token == tokenizer.decode([tid])
    assert worst <= TOL, worst


def test_prompt_logprobs_equal_transformers(llm, hf_model, tokenizer, prompts) -> None:
    ids = prompts[0]
    [out] = llm.generate([{"prompt_token_ids": ids}],
                         SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=5), use_tqdm=False)
    check(out.prompt_logprobs, ids, reference(hf_model, ids, 5), 5, tokenizer)
    # Asked for nothing, nothing comes; k = 0 gives the prompt token alone, with its rank.
    [plain] = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=1),
                           use_tqdm=False)
    assert plain.prompt_logprobs is None
    assert plain.outputs[0].token_ids == out.outputs[0].token_ids
    [zero] = llm.generate([{"prompt_token_ids": ids}],
                          SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    assert [list(e) for e in zero.prompt_logprobs[1:]] == [[t] for t in ids[1:]]
    check(zero.prompt_logprobs, ids, reference(hf_model, ids, 0), 0, tokenizer)


def test_a_cached_prefix_still_gets_its_logprobs(llm, hf_model, tokenizer, prompts) -> None:
    first, second, third = prompts
    llm.generate([{"prompt_token_ids": first}], SamplingParams(max_tokens=1), use_tqdm=False)
    before = llm.stats()
    [out] = llm.generate([{"prompt_token_ids": second}], SamplingParams(max_tokens=1, prompt_logprobs=3),
                         use_tqdm=False)
    check(out.prompt_logprobs, second, reference(hf_model, second, 3), 3, tokenizer)
    # It read nothing from the cache, but filled it: the next request hits its blocks.
    after = llm.stats()
    assert after["prefix_cache_hits"] == before["prefix_cache_hits"]
    llm.generate([{"prompt_token_ids": second}], SamplingParams(max_tokens=1), use_tqdm=False)
    blocks = (len(second) - 1) // 16
    assert llm.stats()["prefix_cache_hits"] - after["prefix_cache_hits"] == 16 * blocks
    del third


def test_n_samples_get_the_prompt_logprobs_once(llm, hf_model, tokenizer, prompts) -> None:
    ids = prompts[2]
    [out] = llm.generate([{"prompt_token_ids": ids}],
                         SamplingParams(n=3, seed=1, max_tokens=2, prompt_logprobs=2), use_tqdm=False)
    assert len(out.outputs) == 3
    check(out.prompt_logprobs, ids, reference(hf_model, ids, 2), 2, tokenizer)


def test_chunked_prefill_and_preemption(model_dir, hf_model, tokenizer, prompts, monkeypatch) -> None:
    # 16 tokens a step: every prompt in 3+ chunks. 10 blocks of 16 for three
    # requests growing to ~60 tokens each: sequences are preempted and recomputed.
    # Logits in slices of 5 rows: a chunk's rows span several slices. Async output
    # processing (the CUDA default): a step's outputs are made during the next step.
    monkeypatch.setattr(pagedcore.prompt_logprobs, "SLICE_ROWS", 5)
    small = LLM(model=model_dir, dtype="float32", num_kv_blocks=10, max_model_len=160, max_num_seqs=3,
                max_num_batched_tokens=16, async_output_proc=True)
    outs = small.generate([{"prompt_token_ids": p} for p in prompts],
                          SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, prompt_logprobs=4),
                          use_tqdm=False)
    assert small.stats()["num_recompute_preemptions"] > 0
    for ids, out in zip(prompts, outs):
        check(out.prompt_logprobs, ids, reference(hf_model, ids, 4), 4, tokenizer)
        assert len(out.outputs[0].token_ids) == 16


def test_streamed_request_gets_them_once(llm, hf_model, tokenizer, prompts) -> None:
    engine = llm.llm_engine
    ids = prompts[1]
    engine.add_request("stream-pl", None, ids, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1),
                       stream=True)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    carrying = [o for o in outs if o.prompt_logprobs is not None]
    assert len(carrying) == 1 and carrying[0] is outs[0]
    check(carrying[0].prompt_logprobs, ids, reference(hf_model, ids, 1), 1, tokenizer)


@pytest.mark.parametrize("value, words", [(-1, "whole vocabulary"), (21, "at most 20"), (-2, "non-negative"),
                                          (1.5, "must be an int")])
def test_bad_prompt_logprobs_are_refused(value, words) -> None:
    with pytest.raises(ValueError, match="prompt_logprobs") as e:
        SamplingParams(prompt_logprobs=value)
    assert words in str(e.value)
