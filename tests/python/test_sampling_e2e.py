"""Sampling parameters end to end, through ``LLM.generate``, against references
computed from Hugging Face transformers' logits on the same (tiny, random,
float32) Llama weights:

- top_k, top_p and min_p (alone and together): every token a seeded, hot
  (high-temperature) generation samples lies inside the support that vLLM's
  definition gives at that step; the same seed without the parameter samples
  outside it, so the check is not vacuous;
- temperature: seeded samples of one step follow softmax(logits / T);
- repetition_penalty: greedy tokens equal transformers' ``generate``;
- frequency_penalty and presence_penalty (vLLM's meaning: over the output
  tokens only): greedy tokens equal a reference loop over transformers'
  logits;
- min_tokens: EOS and stop_token_ids are masked until min_tokens outputs (a
  greedy reference loop with the same mask);
- logprobs of sampled tokens and of n > 1: raw log-probabilities (before
  temperature, penalties and truncation, vLLM's default), the top-k plus the
  sampled token, and a sampled token outside the top-k with its vLLM rank;
- ``max_tokens=None``: generation runs to EOS or to ``max_model_len``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from pagedcore import LLM, SamplingParams, default_model_path  # noqa: E402

VOCAB = 384
MAX_MODEL_LEN = 64
NEW_TOKENS = 24
PROMPT_LENS = (5, 11, 17)
SEED = 1234
# The prompt whose greedy continuation reaches EOS (see ``checkpoint``), and
# the output position at which it does.
EOS_PROMPT_LEN = 9
EOS_POSITION = 7
# Tolerance on logits and probabilities between pagedcore and transformers
# (float32, different kernels): a token this close to the edge of a support
# counts as inside it.
TOL = 1e-4


def make_prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENS]


def eos_prompt() -> list[int]:
    g = torch.Generator().manual_seed(8)
    return torch.randint(3, VOCAB, (EOS_PROMPT_LEN,), generator=g).tolist()


@torch.no_grad()
def hf_greedy_loop(model, prompt: list[int], steps: int) -> list[int]:
    ids = list(prompt)
    for _ in range(steps):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[Path, object]:
    """A tiny random Llama saved to disk, and the same model in memory (the
    reference). Its EOS is the token the greedy continuation of
    ``eos_prompt()`` reaches first at output position ``EOS_POSITION``, so
    that greedy decoding without ``ignore_eos`` stops there."""
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
        rms_norm_eps=1e-6, initializer_range=0.2, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    torch.manual_seed(SEED)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    greedy = hf_greedy_loop(model, eos_prompt(), EOS_POSITION + 1)
    eos = greedy[EOS_POSITION]
    # The tokenizer's EOS (2) is an EOS too: neither may come earlier.
    assert eos not in greedy[:EOS_POSITION] and 2 not in greedy[:EOS_POSITION] and eos != 2
    model.config.eos_token_id = eos
    model.generation_config.eos_token_id = eos
    path = tmp_path_factory.mktemp("sampling_e2e") / "llama"
    model.save_pretrained(path)
    # The reference runs on past EOS (like ignore_eos) unless told otherwise.
    model.generation_config.eos_token_id = None
    return path, model


@pytest.fixture(scope="module")
def hf_model(checkpoint):
    return checkpoint[1]


@pytest.fixture(scope="module")
def llm(checkpoint) -> LLM:
    return LLM(model=str(checkpoint[0]), tokenizer=default_model_path(), num_kv_blocks=256,
               max_model_len=MAX_MODEL_LEN)


def generate(llm: LLM, requests: list[tuple[list[int], SamplingParams]]):
    return llm.generate([{"prompt_token_ids": p} for p, _ in requests], [sp for _, sp in requests],
                        use_tqdm=False)


@torch.no_grad()
def step_logits(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """``[len(output), V]`` float64: transformers' logits before each output
    token, from one forward pass over prompt + output."""
    logits = model(torch.tensor([prompt + output[:-1]])).logits[0]
    return logits[len(prompt) - 1:].double()


# ---- top_k, top_p, min_p ------------------------------------------------------------


def support(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0,
            min_p: float = 0.0) -> torch.Tensor:
    """The tokens vLLM may sample from ``logits`` ``[V]``: bool ``[V]``.

    vLLM's order: divide by the temperature; min_p (probability >= min_p
    times the largest); top_k (the k largest left); top_p on the
    distribution renormalized over what is left (the smallest set of most
    likely tokens whose mass reaches top_p: a token is kept when the mass of
    the tokens more likely than it is below top_p). Each cut is widened by
    ``TOL``, so a token on the edge counts as inside.
    """
    x = logits / temperature
    keep = torch.ones_like(x, dtype=torch.bool)
    if min_p > 0:
        keep &= x - x.max() >= torch.log(torch.tensor(min_p, dtype=x.dtype)) - TOL
    if top_k > 0:
        kth = x.masked_fill(~keep, float("-inf")).topk(top_k).values[-1]
        keep &= x >= kth - TOL
    if top_p < 1:
        probs = x.masked_fill(~keep, float("-inf")).softmax(-1)
        sorted_probs = probs.sort(descending=True).values
        mass_before = sorted_probs.cumsum(0) - sorted_probs
        smallest_kept = sorted_probs[mass_before < top_p + TOL].min()
        keep &= probs >= smallest_kept * (1 - TOL)
    return keep


FILTERS = {
    "top_k": (3.0, dict(top_k=5)),
    "top_p": (2.0, dict(top_p=0.5)),
    "min_p": (2.0, dict(min_p=0.1)),
    # All three at once: only vLLM's order gives this support (top_p applies
    # to what min_p and top_k leave; min_p last, or top_k last, would each
    # admit about 6 more tokens per step here).
    "top_k+top_p+min_p": (4.0, dict(top_k=120, top_p=0.5, min_p=0.25)),
}


@pytest.fixture(scope="module")
def filtered_runs(llm):
    """For each filter and prompt: (prompt, tokens with the filter, tokens with
    the same seed and temperature and no filter). One batch for all."""
    prompts = make_prompts()
    requests = []
    for temperature, kwargs in FILTERS.values():
        for i, prompt in enumerate(prompts):
            common = dict(temperature=temperature, seed=SEED + i, max_tokens=NEW_TOKENS, ignore_eos=True)
            requests.append((prompt, SamplingParams(**common, **kwargs)))
            requests.append((prompt, SamplingParams(**common)))
    outs = iter(o.outputs[0].token_ids for o in generate(llm, requests))
    return {name: [(prompt, next(outs), next(outs)) for prompt in prompts] for name in FILTERS}


@pytest.mark.parametrize("name", list(FILTERS))
def test_sampled_tokens_lie_in_the_filters_support(name, filtered_runs, hf_model) -> None:
    temperature, kwargs = FILTERS[name]
    outside_without_filter = 0
    for prompt, filtered, unfiltered in filtered_runs[name]:
        assert len(filtered) == NEW_TOKENS
        for step, logits in enumerate(step_logits(hf_model, prompt, filtered)):
            keep = support(logits, temperature, **kwargs)
            # Not vacuous: the filter leaves out part of the vocabulary.
            assert keep.sum() < VOCAB // 2, f"{name}: step {step} keeps {int(keep.sum())} tokens"
            assert keep[filtered[step]], (
                f"{name}: prompt of {len(prompt)}, step {step}: token {filtered[step]} is outside "
                f"the {int(keep.sum())}-token support")
        for step, logits in enumerate(step_logits(hf_model, prompt, unfiltered)):
            outside_without_filter += not support(logits, temperature, **kwargs)[unfiltered[step]]
    # Without the filter the same seed does sample outside the support.
    assert outside_without_filter >= 3, name


def test_temperature_gives_the_sampled_distribution(llm, hf_model) -> None:
    # n seeded samples of the first token per prompt: each of the most likely
    # tokens comes up as often as softmax(logits / T) says, within 5 standard
    # deviations. (Temperature ignored, or doubled, moves some count further.)
    n = 200
    prompts = make_prompts()
    requests = [(p, SamplingParams(n=n, temperature=t, seed=21, max_tokens=1, ignore_eos=True))
                for t in (0.5, 2.0) for p in prompts]
    for (prompt, params), out in zip(requests, generate(llm, requests)):
        counts = torch.bincount(torch.tensor([c.token_ids[0] for c in out.outputs]), minlength=VOCAB)
        probs = (step_logits(hf_model, prompt, [0])[0] / params.temperature).softmax(-1)
        for token in probs.topk(8).indices.tolist():
            p = probs[token].item()
            assert abs(counts[token].item() - n * p) <= 5 * (n * p * (1 - p)) ** 0.5, (
                f"T={params.temperature}, prompt of {len(prompt)}: token {token} sampled "
                f"{int(counts[token])} times, expected {n * p:.1f}")


# ---- penalties ---------------------------------------------------------------------------

REPETITION = (1.5, 0.6)
# (frequency_penalty, presence_penalty)
FREQ_PRES = ((1.5, 0.0), (0.0, 1.5), (-0.6, 0.4))


@pytest.fixture(scope="module")
def penalized_runs(llm):
    """Greedy tokens per prompt: plain, with each repetition penalty, with each
    (frequency, presence) pair. One batch for all."""
    prompts = make_prompts()
    variants = ([dict()] + [dict(repetition_penalty=r) for r in REPETITION]
                + [dict(frequency_penalty=f, presence_penalty=p) for f, p in FREQ_PRES])
    requests = [(prompt, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, **v))
                for v in variants for prompt in prompts]
    outs = [o.outputs[0].token_ids for o in generate(llm, requests)]
    runs = {}
    for k, v in enumerate(variants):
        runs[tuple(sorted(v.items()))] = outs[k * len(prompts):(k + 1) * len(prompts)]
    return prompts, runs


@pytest.mark.parametrize("penalty", REPETITION)
def test_repetition_penalty_equals_transformers_generate(penalty, penalized_runs, hf_model) -> None:
    prompts, runs = penalized_runs
    got = runs[(("repetition_penalty", penalty),)]
    changed = 0
    for prompt, tokens, plain in zip(prompts, got, runs[()]):
        x = torch.tensor([prompt])
        ref = hf_model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                repetition_penalty=penalty, max_new_tokens=NEW_TOKENS, pad_token_id=0)
        assert tokens == ref[0, len(prompt):].tolist(), f"prompt of {len(prompt)} tokens"
        changed += tokens != plain
    assert changed >= 2  # the penalty does change greedy outputs


@torch.no_grad()
def reference_frequency_presence(model, prompt: list[int], steps: int, frequency: float,
                                 presence: float) -> list[int]:
    output: list[int] = []
    for _ in range(steps):
        logits = model(torch.tensor([prompt + output])).logits[0, -1].double()
        counts = torch.zeros(VOCAB, dtype=torch.float64)
        for t in output:  # the output only, not the prompt (vLLM)
            counts[t] += 1
        logits = logits - frequency * counts - presence * (counts > 0).double()
        output.append(int(logits.argmax()))
    return output


@pytest.mark.parametrize("frequency,presence", FREQ_PRES)
def test_frequency_and_presence_penalties_equal_reference(frequency, presence, penalized_runs,
                                                          hf_model) -> None:
    prompts, runs = penalized_runs
    got = runs[(("frequency_penalty", frequency), ("presence_penalty", presence))]
    changed = 0
    for prompt, tokens, plain in zip(prompts, got, runs[()]):
        ref = reference_frequency_presence(hf_model, prompt, NEW_TOKENS, frequency, presence)
        assert tokens == ref, f"prompt of {len(prompt)} tokens"
        changed += tokens != plain
    assert changed >= 2  # the penalties do change greedy outputs


# ---- min_tokens ------------------------------------------------------------------------


@torch.no_grad()
def reference_min_tokens(model, prompt: list[int], max_tokens: int, min_tokens: int,
                         stops: list[int]) -> list[int]:
    """Greedy tokens with ``stops`` (EOS and stop tokens) masked while fewer than
    ``min_tokens`` were produced, ending at the first stop token after that."""
    output: list[int] = []
    while len(output) < max_tokens:
        logits = model(torch.tensor([prompt + output])).logits[0, -1].clone()
        if len(output) < min_tokens:
            logits[stops] = float("-inf")
        output.append(int(logits.argmax()))
        if output[-1] in stops:
            break
    return output


def test_min_tokens_blocks_eos_and_stop_token_ids(llm, hf_model) -> None:
    eos_ids = llm.llm_engine.eos_token_ids
    stop_prompt, prompt = eos_prompt(), make_prompts()[0]
    plain = hf_greedy_loop(hf_model, prompt, NEW_TOKENS)
    # A stop token greedy decoding reaches at output position `j` < min_tokens.
    j = next(j for j in range(2, NEW_TOKENS) if plain[j] not in plain[:j] + eos_ids)
    stop = plain[j]
    min_tokens = j + 5
    requests = [
        # EOS comes at EOS_POSITION without min_tokens.
        (stop_prompt, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=EOS_POSITION + 3)),
        (prompt, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=min_tokens,
                                stop_token_ids=[stop], ignore_eos=True)),
    ]
    eos_out, stop_out = (o.outputs[0] for o in generate(llm, requests))
    ref = reference_min_tokens(hf_model, stop_prompt, NEW_TOKENS, EOS_POSITION + 3, eos_ids)
    assert eos_out.token_ids == ref
    assert len(ref) > EOS_POSITION + 1  # EOS was held back
    ref = reference_min_tokens(hf_model, prompt, NEW_TOKENS, min_tokens, [stop])
    assert stop_out.token_ids == ref
    assert stop not in ref[:min_tokens] and ref[:j] == plain[:j]  # the stop token was held back
    for out, stops in ((eos_out, eos_ids), (stop_out, [stop])):
        stopped = out.token_ids[-1] in stops
        assert out.finish_reason == ("stop" if stopped else "length")


# ---- logprobs ----------------------------------------------------------------------------


def test_logprobs_of_sampled_tokens_and_n_samples(llm, hf_model) -> None:
    prompts = make_prompts()
    # Hot sampling with few logprobs: sampled tokens often fall outside the top-k.
    # Penalties and top_k change what is sampled, not the logprobs (vLLM
    # returns the raw model distribution's).
    cases = [
        (prompts[0], SamplingParams(n=3, temperature=3.0, seed=5, logprobs=1, max_tokens=16, ignore_eos=True)),
        (prompts[2], SamplingParams(n=2, temperature=2.0, seed=6, logprobs=4, max_tokens=16, ignore_eos=True,
                                    top_k=30, presence_penalty=1.0, repetition_penalty=1.3)),
    ]
    outside_top_k = 0
    for (prompt, params), out in zip(cases, generate(llm, cases)):
        k = params.logprobs
        assert len(out.outputs) == params.n
        assert len({tuple(c.token_ids) for c in out.outputs}) == params.n  # the samples differ
        for c in out.outputs:
            ref = torch.log_softmax(step_logits(hf_model, prompt, c.token_ids), dim=-1)
            assert len(c.logprobs) == len(c.token_ids) == params.max_tokens
            total = 0.0
            for step, (token, entry) in enumerate(zip(c.token_ids, c.logprobs)):
                where = f"n={params.n} sample {c.index} step {step}"
                top = sorted((lp.rank, t, lp.logprob) for t, lp in entry.items() if lp.rank <= k)
                assert [r for r, _, _ in top][:k] == list(range(1, k + 1)), where
                ref_top = ref[step].topk(k).values
                for (rank, t, value), ref_value in zip(top[:k], ref_top):
                    assert abs(value - ref_value) < 2e-4, where  # the rank-th largest
                    assert abs(value - ref[step, t]) < 2e-4, where  # and it is token t's
                assert token in entry, where
                lp = entry[token].logprob
                assert abs(lp - ref[step, token]) < 2e-4, where
                in_top = token in {t for _, t, _ in top[:k]}
                assert len(entry) == k + (not in_top), where
                # vLLM's rank: the number of tokens at least as likely (1 = most likely).
                lo = int((ref[step] > ref[step, token] + TOL).sum()) + 1
                hi = int((ref[step] >= ref[step, token] - TOL).sum())
                assert lo <= entry[token].rank <= hi, f"{where}: rank {entry[token].rank} not in [{lo}, {hi}]"
                outside_top_k += not in_top
                total += float(ref[step, token])
            assert abs(c.cumulative_logprob - total) < 2e-3
    assert outside_top_k >= 5  # sampled tokens outside the top-k did occur


def test_logprobs_zero_gives_the_sampled_token_with_its_rank(llm, hf_model) -> None:
    # logprobs=0 (vLLM): the sampled token alone, with its logprob and rank, also
    # when no request of the batch asks for a top-k.
    prompt = make_prompts()[1]
    params = SamplingParams(n=2, temperature=2.0, seed=9, logprobs=0, max_tokens=8, ignore_eos=True)
    for c in generate(llm, [(prompt, params)])[0].outputs:
        ref = torch.log_softmax(step_logits(hf_model, prompt, c.token_ids), dim=-1)
        for step, (token, entry) in enumerate(zip(c.token_ids, c.logprobs)):
            assert list(entry) == [token]
            assert abs(entry[token].logprob - ref[step, token]) < 2e-4
            lo = int((ref[step] > ref[step, token] + TOL).sum()) + 1
            hi = int((ref[step] >= ref[step, token] - TOL).sum())
            assert entry[token].rank is not None and lo <= entry[token].rank <= hi, f"step {step}"


# ---- max_tokens=None ---------------------------------------------------------------------


def test_max_tokens_none_runs_to_eos_or_the_context_length(llm, checkpoint, hf_model) -> None:
    prompt = make_prompts()[1]
    stop_prompt = eos_prompt()
    full_prompt = (make_prompts()[2] * 4)[:MAX_MODEL_LEN]
    requests = [
        (prompt, SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)),
        (prompt, SamplingParams(temperature=1.0, seed=3, max_tokens=None, ignore_eos=True)),
        (stop_prompt, SamplingParams(temperature=0.0, max_tokens=None)),
        # A prompt that fills the context still gets the token its prefill samples
        # (vLLM: one token, then the length cap).
        (full_prompt, SamplingParams(temperature=0.0, max_tokens=None)),
    ]
    greedy, sampled, stopped, full = (o.outputs[0] for o in generate(llm, requests))
    room = MAX_MODEL_LEN - len(prompt)
    assert len(greedy.token_ids) == len(sampled.token_ids) == room
    assert greedy.finish_reason == sampled.finish_reason == "length"
    assert greedy.token_ids == hf_greedy_loop(hf_model, prompt, room)
    # Greedy decoding reaches the checkpoint's EOS at EOS_POSITION: it stops there.
    eos = checkpoint[1].config.eos_token_id
    assert stopped.token_ids == hf_greedy_loop(hf_model, stop_prompt, EOS_POSITION + 1)
    assert stopped.token_ids[-1] == eos
    assert (stopped.finish_reason, stopped.stop_reason) == ("stop", None)
    assert full.token_ids == hf_greedy_loop(hf_model, full_prompt, 1) and full.finish_reason == "length"
