"""SamplingParams / BeamSearchParams validation and the torch sampler.

Distribution tests draw many rows in one batch from a fixed global seed, so
they are deterministic; their bounds are several times the sampling noise and
each test also checks that a plausible bug (a wrong temperature, a mask that
is one token off) would land outside them.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
import torch
from pagedcore.sampler import (
    Sampler,
    SamplerOutput,
    SamplingMetadata,
    apply_penalties,
    apply_top_k_top_p,
    pack_for_host,
    row_max,
    token_bin_counts,
    unpack_on_host,
)
from pagedcore.sampling_params import MAX_LOGPROBS, BeamSearchParams, SamplingParams

NEG_INF = float("-inf")
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    return request.param


def sample(logits: torch.Tensor, params: list[SamplingParams], **kw):
    md = SamplingMetadata.from_params(params, logits.device, **kw)
    return Sampler()(logits, md)


def kept(logits: torch.Tensor, params: list[SamplingParams], **kw) -> list[list[int]]:
    """Token ids a random row may draw (finite after every mask)."""
    md = SamplingMetadata.from_params(params, logits.device, **kw)
    out = Sampler().process_logits(logits, md)
    return [torch.nonzero(row.isfinite()).flatten().tolist() for row in out]


def histogram(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    return torch.bincount(tokens.cpu(), minlength=vocab_size).double() / tokens.numel()


def total_variation(p: torch.Tensor, q: torch.Tensor) -> float:
    return 0.5 * (p.double().cpu() - q.double().cpu()).abs().sum().item()


def log_probs(probs: list[float], device: str = "cpu") -> torch.Tensor:
    return torch.tensor([probs], device=device).log()


# --------------------------------------------------------------------------
# SamplingParams


def test_defaults_are_vllms() -> None:
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (1, 1.0, 1.0, 0, 0.0, None)
    assert (p.max_tokens, p.min_tokens, p.stop, p.stop_token_ids) == (16, 0, [], [])
    assert (p.ignore_eos, p.logprobs) == (False, None)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.include_stop_str_in_output, p.skip_special_tokens) == (False, True)
    assert not p.is_greedy and not p.uses_penalties


def test_normalization() -> None:
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop_token_ids=(5, 3, 5)).stop_token_ids == [5, 3]
    assert SamplingParams(seed=-1).seed is None
    assert SamplingParams(logprobs=True).logprobs == 1
    assert SamplingParams(logprobs=False).logprobs is None
    assert SamplingParams(temperature=1).temperature == 1.0
    assert isinstance(SamplingParams(temperature=1).temperature, float)
    greedy = SamplingParams(temperature=0.0, top_p=0.5, top_k=3, min_p=0.2)
    assert greedy.is_greedy and (greedy.top_p, greedy.top_k, greedy.min_p) == (1.0, 0, 0.0)
    assert SamplingParams(stop=["abc", "de"]).output_text_buffer_length == 2
    assert SamplingParams(stop=["abc"], include_stop_str_in_output=True
                          ).output_text_buffer_length == 0


def test_tiny_temperature_is_raised_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="pagedcore.sampling_params"):
        p = SamplingParams(temperature=1e-3)
    assert p.temperature == 0.01 and not p.is_greedy
    assert "temperature" in caplog.text


def test_repr_shows_the_fields() -> None:
    text = repr(SamplingParams(temperature=0.5, top_k=7, stop="x", seed=3))
    for piece in ("SamplingParams(", "n=1", "temperature=0.5", "top_k=7", "stop=['x']",
                  "seed=3", "max_tokens=16", "repetition_penalty=1.0"):
        assert piece in text


INVALID_SAMPLING_PARAMS = [
    ({"n": 0}, "n", "0"),
    ({"n": "2"}, "n", "'2'"),
    ({"n": 1.5}, "n", "1.5"),
    ({"n": True}, "n", "True"),
    ({"temperature": -0.1}, "temperature", "-0.1"),
    ({"temperature": float("nan")}, "temperature", "nan"),
    ({"temperature": float("inf")}, "temperature", "inf"),
    ({"temperature": "hot"}, "temperature", "'hot'"),
    ({"top_p": 0.0}, "top_p", "0.0"),
    ({"top_p": 1.01}, "top_p", "1.01"),
    ({"top_p": -0.5}, "top_p", "-0.5"),
    ({"top_k": -2}, "top_k", "-2"),
    ({"top_k": 2.5}, "top_k", "2.5"),
    ({"min_p": -0.01}, "min_p", "-0.01"),
    ({"min_p": 1.5}, "min_p", "1.5"),
    ({"seed": 1.5}, "seed", "1.5"),
    ({"seed": "7"}, "seed", "'7'"),
    ({"seed": 2**63}, "seed", str(2**63)),
    ({"seed": -(2**63) - 1}, "seed", str(-(2**63) - 1)),
    ({"max_tokens": 0}, "max_tokens", "0"),
    ({"max_tokens": -3}, "max_tokens", "-3"),
    ({"max_tokens": 2.0}, "max_tokens", "2.0"),
    ({"min_tokens": -1}, "min_tokens", "-1"),
    ({"min_tokens": 17}, "min_tokens", "17"),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens", "5"),
    ({"stop": ""}, "stop", "''"),
    ({"stop": ["ok", ""]}, "stop", "''"),
    ({"stop": [1]}, "stop", "1"),
    ({"stop": 5}, "stop", "5"),
    ({"stop_token_ids": [-1]}, "stop_token_ids", "-1"),
    ({"stop_token_ids": [1, "2"]}, "stop_token_ids", "'2'"),
    ({"stop_token_ids": 3}, "stop_token_ids", "3"),
    ({"ignore_eos": "yes"}, "ignore_eos", "'yes'"),
    ({"logprobs": -1}, "logprobs", "-1"),
    ({"logprobs": MAX_LOGPROBS + 1}, "logprobs", str(MAX_LOGPROBS + 1)),
    ({"logprobs": 2.0}, "logprobs", "2.0"),
    ({"presence_penalty": 2.5}, "presence_penalty", "2.5"),
    ({"presence_penalty": -2.01}, "presence_penalty", "-2.01"),
    ({"frequency_penalty": -3.0}, "frequency_penalty", "-3.0"),
    ({"frequency_penalty": 2.1}, "frequency_penalty", "2.1"),
    ({"repetition_penalty": 0.0}, "repetition_penalty", "0.0"),
    ({"repetition_penalty": -1.0}, "repetition_penalty", "-1.0"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty", "inf"),
    ({"include_stop_str_in_output": 1}, "include_stop_str_in_output", "1"),
    ({"skip_special_tokens": None}, "skip_special_tokens", "None"),
    ({"n": 2, "temperature": 0.0}, "n", "2"),
]


@pytest.mark.parametrize(("kwargs", "field", "value"), INVALID_SAMPLING_PARAMS,
                         ids=[f"{f}={v}" for _, f, v in INVALID_SAMPLING_PARAMS])
def test_invalid_sampling_params_name_field_and_value(kwargs, field, value) -> None:
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    message = str(info.value)
    assert message.startswith(field + " "), message
    assert value in message, message
    if " of type " in message:  # a wrong type is a TypeError too
        assert isinstance(info.value, TypeError), message


def test_logprobs_limit_is_named() -> None:
    with pytest.raises(ValueError, match=r"at most 20 \(max_logprobs\)"):
        SamplingParams(logprobs=21)


VALID_EDGES = [
    {"n": 1}, {"n": 64}, {"temperature": 0.0}, {"temperature": 0.01}, {"temperature": 100.0},
    {"top_p": 1.0}, {"top_p": 1e-9}, {"top_k": 0}, {"top_k": -1}, {"top_k": 1},
    {"min_p": 0.0}, {"min_p": 1.0}, {"seed": 0}, {"seed": 2**63 - 1}, {"seed": -(2**63)},
    {"max_tokens": None}, {"max_tokens": 1}, {"min_tokens": 16}, {"max_tokens": None,
                                                                  "min_tokens": 10**6},
    {"stop": None}, {"stop": []}, {"stop_token_ids": [0]}, {"logprobs": 0},
    {"logprobs": MAX_LOGPROBS}, {"presence_penalty": -2.0}, {"presence_penalty": 2.0},
    {"frequency_penalty": -2.0}, {"frequency_penalty": 2.0}, {"repetition_penalty": 1e-3},
    {"repetition_penalty": 10.0}, {"ignore_eos": True},
]


@pytest.mark.parametrize("kwargs", VALID_EDGES, ids=[str(k) for k in VALID_EDGES])
def test_valid_edges_are_accepted(kwargs) -> None:
    p = SamplingParams(**kwargs)
    for name, value in kwargs.items():
        if name not in ("top_k", "stop", "seed") or value not in (-1, None):
            assert getattr(p, name) == value or name == "stop"


def test_positional_arguments_are_refused() -> None:
    # vLLM's positional order differs from ours; keyword-only avoids a silent mix-up.
    with pytest.raises(TypeError):
        SamplingParams(2, 0.5)  # type: ignore[misc]


def test_beam_search_params() -> None:
    p = BeamSearchParams(4, 32)
    assert (p.beam_width, p.max_tokens, p.ignore_eos, p.temperature, p.length_penalty,
            p.include_stop_str_in_output) == (4, 32, False, 0.0, 1.0, False)
    assert BeamSearchParams(beam_width=1, max_tokens=1, length_penalty=-0.5).length_penalty == -0.5


INVALID_BEAM = [
    ({"beam_width": 0, "max_tokens": 8}, "beam_width", "0"),
    ({"beam_width": "4", "max_tokens": 8}, "beam_width", "'4'"),
    ({"beam_width": 2, "max_tokens": 0}, "max_tokens", "0"),
    ({"beam_width": 2, "max_tokens": None}, "max_tokens", "None"),
    ({"beam_width": 2, "max_tokens": 8, "temperature": -1.0}, "temperature", "-1.0"),
    ({"beam_width": 2, "max_tokens": 8, "length_penalty": float("nan")}, "length_penalty",
     "nan"),
    ({"beam_width": 2, "max_tokens": 8, "ignore_eos": "no"}, "ignore_eos", "'no'"),
]


@pytest.mark.parametrize(("kwargs", "field", "value"), INVALID_BEAM,
                         ids=[f"{f}={v}" for _, f, v in INVALID_BEAM])
def test_invalid_beam_search_params(kwargs, field, value) -> None:
    with pytest.raises(ValueError) as info:
        BeamSearchParams(**kwargs)
    assert str(info.value).startswith(field + " ") and value in str(info.value)


# --------------------------------------------------------------------------
# Greedy


def test_greedy_is_argmax(device: str) -> None:
    torch.manual_seed(0)
    logits = torch.randn(16, 300, device=device)
    params = [SamplingParams(temperature=0.0)] * 16
    out = sample(logits, params)
    assert out.sampled_token_ids.dtype == torch.int64
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))


def test_greedy_rows_in_a_mixed_batch_are_argmax(device: str) -> None:
    torch.manual_seed(1)
    logits = torch.randn(8, 50, device=device)
    params = [SamplingParams(temperature=0.0) if i % 2 else SamplingParams(temperature=1.5,
                                                                             top_k=10)
              for i in range(8)]
    ids = sample(logits, params).sampled_token_ids
    assert torch.equal(ids[1::2], logits[1::2].argmax(-1))


def test_greedy_tie_takes_the_lowest_id() -> None:
    logits = torch.tensor([[0.0, 5.0, 1.0, 5.0, 5.0]])
    assert sample(logits, [SamplingParams(temperature=0.0)]).sampled_token_ids.tolist() == [1]


# --------------------------------------------------------------------------
# Temperature


def softmax_t(logits: torch.Tensor, t: float) -> torch.Tensor:
    return torch.softmax(logits.double() / t, -1)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_matches_softmax_of_scaled_logits(device: str, temperature: float) -> None:
    base = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.5])
    n = 40_000
    torch.manual_seed(1234)
    out = sample(base.to(device).expand(n, -1).contiguous(),
                 [SamplingParams(temperature=temperature)] * n)
    empirical = histogram(out.sampled_token_ids, 6)
    expected = softmax_t(base, temperature)
    bound = 0.012  # ~3x the expected TV of 40k draws over 6 tokens
    assert total_variation(empirical, expected) < bound
    # The test has teeth: a 20 % wrong temperature, or none, lands outside.
    for wrong in (temperature * 1.2, temperature / 1.2):
        assert total_variation(softmax_t(base, wrong), expected) > 3 * bound
    if temperature != 1.0:
        assert total_variation(softmax_t(base, 1.0), expected) > 3 * bound


def test_seeded_rows_follow_the_distribution() -> None:
    base = torch.tensor([1.0, 0.0, -1.0, 0.5])
    n = 8_000
    params = [SamplingParams(temperature=0.8, seed=s) for s in range(n)]
    out = sample(base.expand(n, -1).contiguous(), params)
    assert total_variation(histogram(out.sampled_token_ids, 4), softmax_t(base, 0.8)) < 0.025


# --------------------------------------------------------------------------
# top-k / top-p / min-p: the kept set exactly, then many draws


def test_top_k_kept_set() -> None:
    logits = torch.tensor([[3.0, 2.0, 2.0, 1.0, 0.0]])
    assert kept(logits, [SamplingParams(top_k=1)]) == [[0]]
    # Ties at the k-th value are all kept.
    assert kept(logits, [SamplingParams(top_k=2)]) == [[0, 1, 2]]
    assert kept(logits, [SamplingParams(top_k=3)]) == [[0, 1, 2]]
    assert kept(logits, [SamplingParams(top_k=4)]) == [[0, 1, 2, 3]]
    # top_k larger than the vocab, and off.
    assert kept(logits, [SamplingParams(top_k=50)]) == [[0, 1, 2, 3, 4]]
    assert kept(logits, [SamplingParams(top_k=0)]) == [[0, 1, 2, 3, 4]]


def test_top_k_per_row_in_one_batch(device: str) -> None:
    torch.manual_seed(3)
    logits = torch.randn(4, 40, device=device)
    ks = [1, 5, 0, 39]
    result = kept(logits, [SamplingParams(top_k=k) for k in ks])
    for row, k in enumerate(ks):
        expected = logits[row].topk(k if k else 40).indices.sort().values.tolist()
        assert result[row] == expected


def test_top_p_kept_set_including_exact_boundary() -> None:
    logits = log_probs([0.125, 0.5, 0.125, 0.25])  # sorted: 1, 3, then a tie 0/2
    assert kept(logits, [SamplingParams(top_p=0.5)]) == [[1]]       # reached exactly
    assert kept(logits, [SamplingParams(top_p=0.4)]) == [[1]]
    assert kept(logits, [SamplingParams(top_p=0.6)]) == [[1, 3]]
    assert kept(logits, [SamplingParams(top_p=0.75)]) == [[1, 3]]   # reached exactly
    # One more token is needed; its tie comes along.
    assert kept(logits, [SamplingParams(top_p=0.76)]) == [[0, 1, 2, 3]]
    assert kept(logits, [SamplingParams(top_p=1e-9)]) == [[1]]      # top token always kept


def test_top_p_reached_exactly_despite_rounding() -> None:
    # float32 softmax gives 0.49999997 for the first token and 0.84999996 for
    # the first two: below top_p by one ulp, which must not pull in another.
    assert kept(log_probs([0.5, 0.4, 0.1]), [SamplingParams(top_p=0.5)]) == [[0]]
    assert kept(log_probs([0.65, 0.2, 0.15]), [SamplingParams(top_p=0.85)]) == [[0, 1]]


def test_top_p_one_keeps_the_far_tail() -> None:
    logits = torch.cat([torch.zeros(1, 1), torch.full((1, 9), -40.0)], dim=1)
    md = SamplingMetadata.from_params([SamplingParams(top_p=1.0)] * 1)
    md.no_top_p = False  # force the top-p pass as if another row used it
    assert Sampler().process_logits(logits, md).isfinite().all()


def test_top_k_then_top_p_on_the_renormalized_distribution() -> None:
    # After top_k=2 the probabilities are 4/7 and 3/7, so top_p=0.5 keeps one
    # token; on the full distribution (0.4, 0.3) it would keep two.
    logits = log_probs([0.4, 0.3, 0.2, 0.1])
    assert kept(logits, [SamplingParams(top_k=2, top_p=0.5)]) == [[0]]
    assert kept(logits, [SamplingParams(top_p=0.5)]) == [[0, 1]]


def test_min_p_kept_set() -> None:
    logits = log_probs([0.5, 0.3, 0.15, 0.05])
    assert kept(logits, [SamplingParams(min_p=0.25)]) == [[0, 1, 2]]   # threshold 0.125
    assert kept(logits, [SamplingParams(min_p=0.35)]) == [[0, 1]]      # threshold 0.175
    assert kept(logits, [SamplingParams(min_p=1.0)]) == [[0]]
    assert kept(logits, [SamplingParams(min_p=0.0)]) == [[0, 1, 2, 3]]
    tie = log_probs([0.4, 0.4, 0.2])
    assert kept(tie, [SamplingParams(min_p=1.0)]) == [[0, 1]]


def test_min_p_applies_after_temperature() -> None:
    # At T=2 the ratio 0.05/0.5 becomes sqrt(0.1) = 0.32 > 0.3: the last token
    # survives min_p=0.3 only if the temperature comes first.
    logits = log_probs([0.5, 0.3, 0.15, 0.05])
    assert kept(logits, [SamplingParams(min_p=0.3, temperature=1.0)]) == [[0, 1, 2]]
    assert kept(logits, [SamplingParams(min_p=0.3, temperature=2.0)]) == [[0, 1, 2, 3]]


@pytest.mark.parametrize(("params", "allowed"), [
    (SamplingParams(top_k=3), {0, 1, 2}),
    (SamplingParams(top_p=0.6), {0, 1}),
    (SamplingParams(min_p=0.3), {0, 1, 2}),
    (SamplingParams(top_k=3, top_p=0.9, min_p=0.01, temperature=1.5), {0, 1, 2}),
], ids=["top_k", "top_p", "min_p", "all"])
def test_masked_tokens_are_never_drawn(device: str, params: SamplingParams,
                                       allowed: set[int]) -> None:
    logits = log_probs([0.4, 0.25, 0.15, 0.1, 0.06, 0.04], device)
    n = 20_000
    torch.manual_seed(7)
    ids = sample(logits.expand(n, -1).contiguous(), [params] * n).sampled_token_ids
    drawn = set(torch.unique(ids).tolist())
    assert drawn == allowed  # nothing outside, and every kept token does occur


def test_sampling_from_the_kept_set_is_renormalized() -> None:
    logits = log_probs([0.4, 0.3, 0.2, 0.1])
    n = 30_000
    torch.manual_seed(11)
    ids = sample(logits.expand(n, -1).contiguous(), [SamplingParams(top_k=2)] * n)
    expected = torch.tensor([4 / 7, 3 / 7, 0.0, 0.0])
    assert total_variation(histogram(ids.sampled_token_ids, 4), expected) < 0.015


def test_apply_top_k_top_p_direct_per_row_mix() -> None:
    logits = log_probs([0.5, 0.25, 0.125, 0.125]).expand(3, -1).clone()
    out = apply_top_k_top_p(logits, torch.tensor([0, 2, 0], dtype=torch.int32),
                            torch.tensor([0.5, 1.0, 1.0]))
    assert out.isfinite().tolist() == [[True, False, False, False],
                                       [True, True, False, False],
                                       [True, True, True, True]]


# --------------------------------------------------------------------------
# The cheaper exact top-k / top-p paths against the full sort they replace


def reference_top_k_top_p(logits: torch.Tensor, top_k, top_p) -> torch.Tensor:
    """apply_top_k_top_p as it was before the topk paths (a full sort of every
    row), kept here as the reference."""
    if top_k is None and top_p is None:
        return logits
    vocab_size = logits.shape[-1]
    sorted_logits = logits.sort(dim=-1, descending=True).values
    threshold = None
    if top_k is not None:
        k = top_k.long()
        k = torch.where((k <= 0) | (k > vocab_size), vocab_size, k)
        threshold = sorted_logits.gather(1, (k - 1).unsqueeze(1))
        sorted_logits.masked_fill_(sorted_logits < threshold, NEG_INF)
    if top_p is not None:
        cumulative = sorted_logits.softmax(dim=-1).cumsum_(dim=-1)
        target = (top_p - 1e-6).to(cumulative.dtype).unsqueeze(1)
        below = torch.searchsorted(cumulative, target)
        num_kept = (below + 1).clamp_(max=vocab_size)
        p_threshold = sorted_logits.gather(1, num_kept - 1)
        p_threshold.masked_fill_((top_p >= 1.0).unsqueeze(1), NEG_INF)
        threshold = p_threshold if threshold is None else torch.maximum(threshold, p_threshold)
    return logits.masked_fill_(logits < threshold, NEG_INF)


def tied_logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """Logits with many exact ties (half-integer steps, as low-precision logits
    have), a few -inf (blocked or min_p-masked tokens), and every third row
    continuous."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-8, 8, (rows, vocab), generator=g).float() / 2
    x[::3] = torch.randn(x[::3].shape, generator=g) * 3
    x.masked_fill_(torch.rand(rows, vocab, generator=g) < 0.05, NEG_INF)
    return x


def mixed_rows(rows: int, vocab: int, seed: int, kind: str) -> tuple[list[int], list[float]]:
    g = torch.Generator().manual_seed(seed)
    ks = [0, 1, 2, 3, 7, 40, vocab // 2, vocab - 1, vocab, vocab + 5]
    ps = [1.0, 1e-9, 0.05, 0.3, 0.5, 0.75, 0.9, 0.97, 0.999]
    pick = lambda options: [options[i] for i in torch.randint(len(options), (rows,), generator=g).tolist()]
    top_k = pick(ks) if kind != "top_p" else [0] * rows
    top_p = pick(ps) if kind != "top_k" else [1.0] * rows
    return top_k, top_p


@pytest.mark.parametrize("vocab", [5, 97, 1000])
@pytest.mark.parametrize("kind", ["top_k", "top_p", "both"])
@pytest.mark.parametrize("seed", range(6))
def test_planned_top_k_top_p_equals_the_full_sort(vocab: int, kind: str, seed: int) -> None:
    rows = 24
    logits = tied_logits(rows, vocab, seed)
    top_k, top_p = mixed_rows(rows, vocab, seed, kind)
    k = torch.tensor(top_k, dtype=torch.int32)
    p = torch.tensor(top_p, dtype=torch.float32)
    k_arg = None if kind == "top_p" else k
    p_arg = None if kind == "top_k" else p
    expected = reference_top_k_top_p(logits.clone(), k_arg, p_arg)
    got = apply_top_k_top_p(logits.clone(), k_arg, p_arg,
                            host_top_k=None if k_arg is None else k.clone(),
                            host_top_p=None if p_arg is None else p.clone())
    assert torch.equal(got, expected)
    # And through the sampler, from SamplingParams (top_k and top_p both passed).
    params = [SamplingParams(top_k=a, top_p=b) for a, b in zip(top_k, top_p)]
    md = SamplingMetadata.from_params(params)
    assert torch.equal(Sampler().process_logits(logits, md),
                       reference_top_k_top_p(logits.clone(), None if md.no_top_k else k,
                                             None if md.no_top_p else p))


def test_top_p_with_top_k_counts_ties_left_out_of_the_candidates() -> None:
    # top_k=2 keeps the 2.0 and all four tokens tied at 1.0 (value threshold): the
    # renormalized mass is e^2 + 4e, so the 2.0 alone has 0.405 and top_p=0.5 needs
    # the ties. Counting only the two topk candidates, the 2.0 alone would have 0.73.
    logits = torch.tensor([[1.0, 2.0, 1.0, 0.0, 1.0, 1.0]])
    assert kept(logits, [SamplingParams(top_k=2, top_p=0.5)]) == [[0, 1, 2, 4, 5]]
    assert kept(logits, [SamplingParams(top_k=2, top_p=0.4)]) == [[1]]


def test_top_p_after_top_k_reached_exactly_despite_rounding() -> None:
    # Renormalized over the top 3, the first two have 0.79999995 in float32, one
    # ulp below top_p: the 1e-6 tolerance holds on the topk path too.
    logits = log_probs([0.45, 0.35, 0.2, 0.001])
    assert kept(logits, [SamplingParams(top_k=3, top_p=0.8)]) == [[0, 1]]


def test_only_rows_with_top_p_and_no_top_k_are_sorted(monkeypatch: pytest.MonkeyPatch) -> None:
    import pagedcore.sampler as sampler_module

    sorted_rows = []
    full_sort = sampler_module._sorted_thresholds

    def spy(logits, top_k, top_p):
        sorted_rows.append(logits.shape[0])
        return full_sort(logits, top_k, top_p)

    monkeypatch.setattr(sampler_module, "_sorted_thresholds", spy)
    logits = tied_logits(6, 50, 3)
    params = [SamplingParams(top_k=5), SamplingParams(top_p=0.5), SamplingParams(temperature=0.0),
              SamplingParams(top_k=3, top_p=0.7), SamplingParams(top_p=0.9), SamplingParams()]
    out = Sampler().process_logits(logits, SamplingMetadata.from_params(params))
    assert sorted_rows == [2]  # rows 1 and 4
    k = torch.tensor([p.top_k for p in params])
    p = torch.tensor([p.top_p for p in params])
    assert torch.equal(out, reference_top_k_top_p(logits.clone(), k, p))
    sorted_rows.clear()
    Sampler().process_logits(logits, SamplingMetadata.from_params(
        [SamplingParams(top_k=5, top_p=0.5), SamplingParams(top_k=9)] * 3))
    assert sorted_rows == []
    # Without the host copies (hand-built metadata) every row is sorted, as before.
    md = SamplingMetadata.from_params(params)
    md.host_top_k = md.host_top_p = None
    assert torch.equal(Sampler().process_logits(logits, md), out) and sorted_rows == [6]


def test_host_copies_of_top_k_top_p_are_checked() -> None:
    md = SamplingMetadata.from_params([SamplingParams(top_k=2)] * 2)
    md.host_top_k = torch.tensor([2, 2, 2])
    with pytest.raises(ValueError, match=r"host_top_k must be a CPU tensor of shape \(2,\)"):
        Sampler()(torch.zeros(2, 5), md)


# --------------------------------------------------------------------------
# What a step computes when nobody asks for logprobs, and the packed copy


@pytest.mark.parametrize("params", [
    [SamplingParams(temperature=0.0)] * 4,
    [SamplingParams(temperature=0.0), SamplingParams(top_k=3, seed=1)] * 2,
], ids=["greedy", "mixed"])
def test_no_sampled_logprobs_when_none_are_needed(device: str, params) -> None:
    logits = torch.tensor([[0.0, 5.0, 1.0, 5.0], [2.0, 1.0, NEG_INF, 0.0],
                           [NEG_INF] * 4, [1.0, float("nan"), 0.0, 3.0]], device=device)
    md = SamplingMetadata.from_params(params, device)
    md.need_sampled_logprobs = False
    out = Sampler()(logits, md)
    assert out.sampled_logprobs is None and out.logprobs is None
    ids = out.sampled_token_ids.tolist()
    assert ids[2:] == [-1, -1]  # nothing to sample / nan
    if params[0].is_greedy:
        assert ids == [1, 0, -1, -1]  # first index of the max
    # Asked for (the default), the same tokens with their raw logprobs.
    md = SamplingMetadata.from_params(params, device)
    full = Sampler()(logits, md)
    if params[0].is_greedy:
        assert full.sampled_token_ids.tolist() == ids
        raw = torch.log_softmax(logits[:2], -1)
        assert full.sampled_logprobs[:2].tolist() == [raw[0, 1].item(), raw[1, 0].item()]
    assert full.sampled_logprobs[2].item() == NEG_INF


@pytest.mark.parametrize("width", [0, 1, 3])
@pytest.mark.parametrize("with_sampled", [False, True])
def test_pack_for_host_round_trip_is_exact(width: int, with_sampled: bool) -> None:
    g = torch.Generator().manual_seed(width)
    rows = 5
    # Ids beyond float32's 2**24 and float32 logprobs with full mantissas: float64
    # carries both exactly.
    ids = torch.tensor([3, -1, 2**24 + 1, 2**31 - 1, 0])  # (the host takes int32)
    sampled_lp = torch.randn(rows, generator=g) * 7
    sampled_lp[1] = NEG_INF
    out = SamplerOutput(ids, sampled_lp if with_sampled else None)
    if width:
        out.logprob_token_ids = torch.randint(0, 2**31, (rows, width), generator=g)
        out.logprob_token_ids[0, 0] = 2**40 + 3
        out.logprobs = -torch.rand(rows, width, generator=g) * 20
        out.sampled_rank = torch.randint(1, 200_000, (rows,), generator=g)
    packed = pack_for_host(out)
    assert packed.dtype == torch.float64 and packed.shape == (rows * (1 + with_sampled + 2 * width)
                                                             + (rows if width else 0),)
    host = unpack_on_host(packed, out)
    assert host.token_ids.dtype == np.int32 and host.token_ids.tolist() == ids.to(torch.int32).tolist()
    assert host.sampled_logprobs == (sampled_lp.tolist() if with_sampled else None)
    if width:
        assert host.top == (out.logprob_token_ids.tolist(), out.logprobs.tolist(),
                            out.sampled_rank.tolist())
    else:
        assert host.top is None


def test_engine_asks_for_sampled_logprobs_only_when_a_request_wants_them() -> None:
    from types import SimpleNamespace

    from pagedcore.llm_engine import LLMEngine, _SlotArrays

    engine = object.__new__(LLMEngine)  # only what _sampling_metadata reads
    engine._slots, engine.device, engine._generators, engine._seq_owner = _SlotArrays(), torch.device("cpu"), {}, {}
    engine._matchers, engine._mask_job = {}, None  # no structured-output rows
    for slot, p in enumerate([SamplingParams(temperature=0.0), SamplingParams(top_k=7, top_p=0.5),
                              SamplingParams(logprobs=0), SamplingParams(logprobs=3, top_p=0.8)]):
        engine._slots.set(slot, p)

    def metadata(slots: list[int]) -> SamplingMetadata:
        batch = SimpleNamespace(sample_slots=np.array(slots, dtype=np.int32),
                                sample_seq_ids=np.array(slots, dtype=np.int64),
                                sample_num_outputs=np.zeros(len(slots), dtype=np.int32))
        return engine._sampling_metadata(batch)

    md = metadata([0, 1, 0])
    assert (md.need_sampled_logprobs, md.num_logprobs) == (False, 0)
    assert md.host_top_k.tolist() == [0, 7, 0] and md.host_top_p.tolist() == [1.0, 0.5, 1.0]
    md = metadata([0, 2])
    assert (md.need_sampled_logprobs, md.num_logprobs) == (True, 1)  # logprobs=0: the rank
    md = metadata([1, 3])
    assert (md.need_sampled_logprobs, md.num_logprobs) == (True, 3)
    assert md.host_top_p.tolist() == [0.5, pytest.approx(0.8)]


# --------------------------------------------------------------------------
# Penalties


def test_penalties_exact_logits() -> None:
    vocab = 6
    logits = torch.tensor([[2.0, -1.0, 3.0, -2.0, 1.0, 0.5]])
    p = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    # prompt: tokens 0, 3; output: 2 twice, 3 once, 1 once.
    md = SamplingMetadata.from_params([p], vocab_size=vocab, prompt_token_ids=[[0, 3, 0]],
                                      output_token_ids=[[2, 3, 2, 1]])
    expected = [[
        2.0 / 2,                          # prompt only: positive -> divided
        -1.0 * 2 - 0.5 * 1 - 0.25,        # output once: negative -> multiplied
        3.0 / 2 - 0.5 * 2 - 0.25,         # output twice
        -2.0 * 2 - 0.5 * 1 - 0.25,        # prompt and output
        1.0,                              # untouched
        0.5,
    ]]
    assert apply_penalties(logits, md).tolist() == expected
    assert logits.tolist() == [[2.0, -1.0, 3.0, -2.0, 1.0, 0.5]]  # input untouched


def test_penalties_apply_only_to_their_rows(device: str) -> None:
    logits = torch.tensor([[1.0, 4.0, 3.0]] * 3, device=device)
    params = [SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.0, repetition_penalty=2.0),
              SamplingParams(temperature=0.0, presence_penalty=2.0)]
    out = sample(logits, params, vocab_size=3, prompt_token_ids=[[1], [1], [1]],
                 output_token_ids=[[1], [1], [1]])
    # Row 0: no penalty. Row 1: 4 -> 2 < 3. Row 2: 4 - 2 = 2 < 3.
    assert out.sampled_token_ids.tolist() == [1, 2, 2]


def test_frequency_penalty_counts_occurrences() -> None:
    logits = torch.tensor([[5.0, 4.0]])
    p = SamplingParams(temperature=0.0, frequency_penalty=0.4)
    # 0.4 * 2 = 0.8 < 1 keeps token 0; 0.4 * 3 = 1.2 > 1 flips it.
    assert sample(logits, [p], vocab_size=2, output_token_ids=[[0, 0]]
                  ).sampled_token_ids.tolist() == [0]
    assert sample(logits, [p], vocab_size=2, output_token_ids=[[0, 0, 0]]
                  ).sampled_token_ids.tolist() == [1]


def test_repetition_penalty_uses_the_prompt_presence_does_not() -> None:
    logits = torch.tensor([[5.0, 4.0]])
    rep = SamplingParams(temperature=0.0, repetition_penalty=1.5)
    pres = SamplingParams(temperature=0.0, presence_penalty=2.0)
    args = {"vocab_size": 2, "prompt_token_ids": [[0]], "output_token_ids": [[]]}
    assert sample(logits, [rep], **args).sampled_token_ids.tolist() == [1]
    assert sample(logits, [pres], **args).sampled_token_ids.tolist() == [0]


def test_negative_penalties_encourage_repetition() -> None:
    logits = torch.tensor([[5.0, 4.0]])
    p = SamplingParams(temperature=0.0, presence_penalty=-2.0)
    assert sample(logits, [p], vocab_size=2, output_token_ids=[[1]]
                  ).sampled_token_ids.tolist() == [1]


def test_token_bin_counts_ignores_padding() -> None:
    ids = torch.tensor([[1, 1, 3, -1, 4], [0, 4, 4, 4, 4]])
    assert token_bin_counts(ids, 4).tolist() == [[0, 2, 0, 1], [1, 0, 0, 0]]


# --------------------------------------------------------------------------
# Blocked tokens (min_tokens)


def test_min_tokens_blocks_eos_and_stop_tokens_even_at_the_top(device: str) -> None:
    eos, stop_id = 0, 3
    logits = torch.tensor([[9.0, 8.5, 1.0, 8.9, 0.5]], device=device)
    n = 5_000
    params = [SamplingParams(min_tokens=2, stop_token_ids=[stop_id], temperature=2.0)] * n
    torch.manual_seed(5)
    ids = sample(logits.expand(n, -1).contiguous(), params, eos_token_id=eos,
                 output_token_ids=[[7]] * n).sampled_token_ids
    assert not torch.isin(ids, torch.tensor([eos, stop_id], device=device)).any()
    assert set(torch.unique(ids).tolist()) == {1, 2, 4}

    greedy = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[stop_id])
    assert sample(logits, [greedy], eos_token_id=eos).sampled_token_ids.tolist() == [1]
    # Once min_tokens outputs exist, EOS is allowed again.
    assert sample(logits, [greedy], eos_token_id=eos, output_token_ids=[[7, 7]]
                  ).sampled_token_ids.tolist() == [0]
    # With ignore_eos, EOS is an ordinary token; only the stop token is blocked.
    ignore = SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True,
                            stop_token_ids=[stop_id])
    assert sample(logits, [ignore], eos_token_id=eos).sampled_token_ids.tolist() == [0]


def test_blocked_tokens_are_per_row() -> None:
    logits = torch.tensor([[3.0, 2.0, 1.0]] * 2)
    params = [SamplingParams(temperature=0.0, min_tokens=1), SamplingParams(temperature=0.0)]
    out = sample(logits, params, eos_token_id=[0, 1])
    assert out.sampled_token_ids.tolist() == [2, 0]


def test_blocked_beats_penalties_and_rows_with_no_token_give_minus_one(device: str) -> None:
    # Everything blocked: nothing sampleable, so -1 (never a blocked token).
    logits = torch.tensor([[1.0, 2.0], [1.0, 2.0]], device=device)
    md = SamplingMetadata.from_params([SamplingParams(), SamplingParams(temperature=0.0)],
                                      device)
    md.blocked_rows = torch.tensor([0, 0, 1, 1], device=device)
    md.blocked_tokens = torch.tensor([0, 1, 0, 1], device=device)
    out = Sampler()(logits, md)
    assert out.sampled_token_ids.tolist() == [-1, -1]
    assert out.sampled_logprobs.tolist() == [NEG_INF, NEG_INF]


# --------------------------------------------------------------------------
# -inf rows and ties


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0), SamplingParams(), SamplingParams(top_k=3),
    SamplingParams(top_p=0.1), SamplingParams(min_p=0.9), SamplingParams(seed=3),
], ids=["greedy", "random", "top_k", "top_p", "min_p", "seeded"])
def test_rows_with_minus_inf(device: str, params: SamplingParams) -> None:
    n = 200
    logits = torch.full((n, 10), NEG_INF, device=device)
    logits[:, 6] = -3.0
    logits[:, 2] = -50.0
    logits[0] = NEG_INF  # one row with nothing at all
    out = sample(logits, [params] * n)
    ids = out.sampled_token_ids
    assert ids[0].item() == -1
    assert set(ids[1:].tolist()) <= {2, 6}
    assert not out.sampled_logprobs[1:].isnan().any()


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0), SamplingParams(top_p=0.5)],
                         ids=["greedy", "random"])
def test_rows_with_nan_give_minus_one(device: str, params: SamplingParams) -> None:
    logits = torch.tensor([[1.0, float("nan"), 0.0], [1.0, 2.0, 0.0]], device=device)
    out = sample(logits, [params] * 2)
    assert out.sampled_token_ids[0].item() == -1
    assert out.sampled_token_ids[1].item() in (0, 1, 2)


def test_random_ties_are_both_drawn() -> None:
    logits = torch.tensor([[2.0, 2.0, -1.0]])
    n = 20_000
    torch.manual_seed(9)
    ids = sample(logits.expand(n, -1).contiguous(), [SamplingParams(top_k=1)] * n)
    freq = histogram(ids.sampled_token_ids, 3)
    assert abs(freq[0].item() - 0.5) < 0.02 and freq[2].item() == 0.0


# --------------------------------------------------------------------------
# Seeds


def run_steps(logits_for_step, make_batch, steps: int = 12) -> list[int]:
    """Samples `steps` steps of a batch that holds the seeded row under test;
    the row's generator persists across steps as the runner keeps it."""
    generator = None
    tokens = []
    for step in range(steps):
        params, row, generators = make_batch()
        if generator is None:
            generator = torch.Generator()
            generator.manual_seed(params[row].seed)
        generators[row] = generator
        logits = logits_for_step(step, len(params), row)
        torch.manual_seed(1000 + step * 7 + len(params))  # perturb the global RNG
        md = SamplingMetadata.from_params(params, generators=generators)
        tokens.append(Sampler()(logits, md).sampled_token_ids[row].item())
    return tokens


def test_seeded_row_is_independent_of_its_batch() -> None:
    vocab = 1000
    mine = torch.Generator().manual_seed(123)
    row_logits = [torch.randn(vocab, generator=mine) for _ in range(12)]

    def logits_for_step(step: int, size: int, row: int) -> torch.Tensor:
        logits = torch.randn(size, vocab) * 3
        logits[row] = row_logits[step]
        return logits

    seeded = SamplingParams(seed=42, temperature=1.0)

    def alone():
        return [seeded], 0, {}

    def with_unseeded_neighbours():
        return [SamplingParams(), SamplingParams(temperature=0.0), seeded], 2, {}

    def with_seeded_neighbours():
        other = torch.Generator().manual_seed(7)
        return ([SamplingParams(seed=7, top_k=5), seeded, SamplingParams(top_p=0.3)], 1,
                {0: other})

    reference = run_steps(logits_for_step, alone)
    assert run_steps(logits_for_step, with_unseeded_neighbours) == reference
    assert run_steps(logits_for_step, with_seeded_neighbours) == reference
    assert len(set(reference)) > 6  # the row really is random

    seeded = SamplingParams(seed=43, temperature=1.0)
    assert run_steps(logits_for_step, alone) != reference


def test_same_seed_in_two_rows_gives_the_same_tokens() -> None:
    logits = torch.randn(1, 500).expand(2, -1).contiguous()
    out = sample(logits, [SamplingParams(seed=5), SamplingParams(seed=5)])
    assert out.sampled_token_ids[0] == out.sampled_token_ids[1]


# --------------------------------------------------------------------------
# Logprobs


def test_logprobs_are_raw_log_softmax(device: str) -> None:
    torch.manual_seed(21)
    logits = torch.randn(5, 64, device=device) * 2
    raw = torch.log_softmax(logits, -1)
    params = [
        SamplingParams(logprobs=3, temperature=0.0, repetition_penalty=1.7),
        SamplingParams(logprobs=5, temperature=0.6, top_k=4),
        SamplingParams(logprobs=0, min_p=0.2, presence_penalty=1.0),
        SamplingParams(temperature=1.3, top_p=0.5, seed=1),
        SamplingParams(logprobs=1, frequency_penalty=-1.0),
    ]
    out = sample(logits, params, vocab_size=64, prompt_token_ids=[[1, 2]] * 5,
                 output_token_ids=[[3, 3, 4]] * 5)
    ids = out.sampled_token_ids
    rows = torch.arange(5, device=device)
    torch.testing.assert_close(out.sampled_logprobs, raw[rows, ids], atol=1e-5, rtol=0)
    top = raw.topk(5, dim=-1)
    assert out.logprob_token_ids.shape == (5, 5) and out.logprobs.shape == (5, 5)
    assert torch.equal(out.logprob_token_ids, top.indices)
    torch.testing.assert_close(out.logprobs, top.values, atol=1e-5, rtol=0)
    assert (out.logprobs[:, :-1] >= out.logprobs[:, 1:]).all()
    expected_rank = (raw >= raw[rows, ids].unsqueeze(1)).sum(-1)
    assert torch.equal(out.sampled_rank, expected_rank)
    assert out.sampled_rank.dtype == torch.int64 and (out.sampled_rank >= 1).all()


def test_logprobs_and_rank_exact_example() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    out = sample(logits, [SamplingParams(temperature=0.0, logprobs=2, min_tokens=1)],
                 eos_token_id=1)
    expected = torch.log_softmax(logits, -1)[0]
    assert out.sampled_token_ids.tolist() == [2]      # EOS (1) blocked, 2 is next
    assert out.sampled_rank.tolist() == [2]           # ranked in the raw distribution
    assert out.logprob_token_ids.tolist() == [[1, 2]]
    torch.testing.assert_close(out.logprobs[0], expected[[1, 2]])
    torch.testing.assert_close(out.sampled_logprobs, expected[[2]])


def test_no_logprobs_means_none() -> None:
    out = sample(torch.randn(2, 10), [SamplingParams(), SamplingParams(logprobs=0)])
    assert out.logprob_token_ids is None and out.logprobs is None and out.sampled_rank is None
    assert out.sampled_logprobs.shape == (2,) and out.sampled_logprobs.dtype == torch.float32


# --------------------------------------------------------------------------
# The metadata as the runner builds it, and misuse


def test_hand_built_metadata_like_the_runner(device: str) -> None:
    logits = torch.tensor([[0.0, 1.0, 5.0, 2.0]] * 3, device=device)
    md = SamplingMetadata(
        temperature=torch.tensor([0.0, 0.7, 0.7], device=device),
        top_k=torch.tensor([0, 1, 0], dtype=torch.int32, device=device),
        top_p=torch.ones(3, device=device),
        min_p=torch.tensor([0.0, 0.0, 0.9], device=device),
        all_greedy=False, all_random=False, no_top_k=False, no_top_p=True, no_min_p=False,
        generators={}, num_logprobs=0,
        blocked_rows=torch.empty(0, dtype=torch.int64, device=device),
        blocked_tokens=torch.empty(0, dtype=torch.int64, device=device),
    )
    logits_before = logits.clone()
    assert Sampler()(logits, md).sampled_token_ids.tolist() == [2, 2, 2]
    assert torch.equal(logits, logits_before)


def test_float64_metadata_does_not_promote_the_logits() -> None:
    md = SamplingMetadata.from_params([SamplingParams(temperature=0.5, min_p=0.1)])
    md.temperature, md.min_p = md.temperature.double(), md.min_p.double()
    out = Sampler().process_logits(torch.tensor([[0.0, 1.0, -9.0]]), md)
    assert out.dtype == torch.float32
    assert out.tolist() == [[0.0, 2.0, NEG_INF]]


def test_shape_mismatch_is_a_clear_error() -> None:
    md = SamplingMetadata.from_params([SamplingParams()] * 2)
    with pytest.raises(ValueError, match=r"temperature must have shape \(3,\)"):
        Sampler()(torch.zeros(3, 5), md)
    with pytest.raises(ValueError, match="vocab_size is required"):
        SamplingMetadata.from_params([SamplingParams(presence_penalty=1.0)])


def test_half_precision_logits_are_accepted(device: str) -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0]], dtype=torch.bfloat16, device=device)
    out = sample(logits, [SamplingParams(temperature=0.0, logprobs=1)])
    assert out.sampled_token_ids.tolist() == [1]
    assert math.isclose(out.sampled_logprobs.item(),
                        torch.log_softmax(logits.float(), -1)[0, 1].item(), abs_tol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("vocab", [49152, 128256, 1000, 96])
def test_row_max_two_passes_match_one(device, vocab) -> None:
    """The two-pass greedy max gives torch's values and first indices: ties within and
    across chunks, a row whose maximum is -inf, a row with a nan, a maximum in the last
    chunk; against a plain numpy argmax as the reference."""
    g = torch.Generator().manual_seed(vocab)
    x = torch.randint(-50, 50, (6, vocab), generator=g).float()
    x[0, [3, vocab // 2, vocab - 1]] = 99.0        # three ties in different chunks: first wins
    x[1, :] = NEG_INF
    x[2, vocab // 3] = float("nan")
    x[2, 0] = 1000.0
    x[3, vocab - 1] = 77.0                         # the maximum in the last chunk
    x[4, [vocab - 2, vocab - 1]] = 88.0           # a tie inside the last chunk
    x = x.to(device)
    top, idx = row_max(x, two_pass=True)
    ref = x.cpu().numpy()
    expected_idx = [int(np.argmax(r)) for r in ref]  # numpy: first max, first nan wins
    assert idx.cpu().tolist() == expected_idx
    assert idx.cpu().tolist()[:5] == [3, 0, vocab // 3, vocab - 1, vocab - 2]
    got = top.cpu().numpy()
    want = np.array([r[i] for r, i in zip(ref, expected_idx)])
    assert np.array_equal(np.isnan(got), np.isnan(want))
    assert np.array_equal(got[~np.isnan(got)], want[~np.isnan(want)])


# --------------------------------------------------------------------------
# Grammar bitmasks (structured outputs): numpy on the CPU, one kernel on CUDA


def bitmask_reference(logits: torch.Tensor, rows: list[int], words: torch.Tensor) -> torch.Tensor:
    """Token t of row rows[i] blocked iff bit t % 32 of words[i, t // 32] is 0 (or the
    word is past the mask): bit by bit over Python ints, on the CPU."""
    out = logits.detach().cpu().clone()
    vocab, width, words = out.shape[1], words.shape[1], words.tolist()
    for i, row in enumerate(rows):
        blocked = [t // 32 >= width or (words[i][t // 32] >> (t % 32)) & 1 == 0 for t in range(vocab)]
        out[row, torch.tensor(blocked)] = NEG_INF
    return out


def random_words(num_masks: int, width: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-2**31, 2**31 - 1, (num_masks, width), generator=gen, dtype=torch.int64).to(torch.int32)


@pytest.mark.parametrize("device", DEVICES)
def test_apply_token_bitmask_matches_bit_arithmetic(device) -> None:
    from pagedcore.sampler import apply_token_bitmask

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    gen = torch.Generator().manual_seed(0)
    vocab = 70  # 3 words: the last one partly past the vocabulary
    logits = torch.randn(4, vocab, generator=gen)
    words = random_words(4, 3, 0)
    index_types = (torch.int64, torch.int32) if device == "cuda" else (torch.int64,)
    for rows in ([3, 1], [0, 1, 2, 3]):  # some rows; every row (no gather and scatter)
        for index_type in index_types:
            got = apply_token_bitmask(logits.clone().to(device), torch.tensor(rows, dtype=index_type, device=device),
                                      words[:len(rows)].to(device))
            assert torch.equal(got.cpu(), bitmask_reference(logits, rows, words[:len(rows)])), (rows, index_type)
    # A bitmask narrower than the logits blocks the columns past it.
    narrow = apply_token_bitmask(logits.clone().to(device), torch.tensor([0], device=device),
                                 torch.full((1, 1), -1, dtype=torch.int32, device=device)).cpu()
    assert torch.equal(narrow[0, :32], logits[0, :32]) and bool((narrow[0, 32:] == NEG_INF).all())
    assert torch.equal(narrow[1:], logits[1:])


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab, width", [(1, 1), (31, 1), (33, 2), (1000, 30), (4099, 129), (49152, 1536)])
@pytest.mark.parametrize("rows", ["all", "int32", "int64"])
def test_bitmask_kernel_over_dtypes_rows_and_vocabularies(dtype, vocab, width, rows) -> None:
    """The kernel against the bit arithmetic: every dtype; vocabularies of one token, of
    less than a word, of a partial last word, of a mask narrower than the logits (1000
    and 4099: the tail past 32 W blocked) and SmolLM2's; all rows in order, or a subset
    in either index type with a row out of range (skipped); logits that are a slice of
    wider rows, whose columns past the vocabulary hold NaN and stay untouched."""
    from pagedcore.ops.bitmask import apply_token_bitmask_

    gen = torch.Generator().manual_seed(vocab + width)
    num_rows = 5
    wide = torch.randn(num_rows, vocab + 3, generator=gen).to(dtype)
    wide[:, vocab:] = float("nan")
    if rows == "all":
        chosen, index = list(range(num_rows)), None
        words = random_words(num_rows, width, vocab)
    else:
        chosen = [4, 0, 2]
        words = random_words(4, width, vocab)
        index = torch.tensor(chosen + [num_rows + 7], dtype=torch.int32 if rows == "int32" else torch.int64)
    logits = wide.cuda()
    out = apply_token_bitmask_(logits[:, :vocab], words.cuda(), None if index is None else index.cuda())
    assert out.data_ptr() == logits.data_ptr()
    got = logits.cpu()
    expected = bitmask_reference(wide[:, :vocab].float(), chosen, words[:len(chosen)]).to(dtype)
    assert torch.equal(got[:, :vocab], expected)
    assert bool(got[:, vocab:].isnan().all())


@pytest.mark.cuda
def test_bitmask_kernel_status_fills_the_rows_with_nan() -> None:
    # status != 0 (the masks never came): the masked rows cannot be sampled; others untouched.
    from pagedcore.ops.bitmask import apply_token_bitmask_

    logits = torch.randn(3, 100).cuda()
    words = torch.full((2, 4), -1, dtype=torch.int32).cuda()  # everything allowed
    rows = torch.tensor([2, 0]).cuda()
    for status, nan_rows in ((0, []), (1, [0, 2])):
        x = logits.clone()
        apply_token_bitmask_(x, words, rows, torch.tensor([status], dtype=torch.int32).cuda())
        x = x.cpu()
        for r in range(3):
            if r in nan_rows:
                assert bool(x[r].isnan().all()), (status, r)
            else:
                assert torch.equal(x[r], logits[r].cpu()), (status, r)
    # Through the sampler: such rows sample nothing (-1), the others as usual.
    md = SamplingMetadata.from_params([SamplingParams(temperature=0.0)] * 3, "cuda")
    md.bitmask_rows, md.token_bitmask = rows, words
    md.bitmask_status = torch.tensor([1], dtype=torch.int32).cuda()
    out = Sampler()(logits, md)
    assert out.sampled_token_ids.tolist() == [-1, int(logits[1].argmax()), -1]


@pytest.mark.cuda
def test_wait_host_flag_holds_the_work_queued_behind_it() -> None:
    """The stream waits for the host's flag: a copy queued behind the wait reads what the
    host wrote after queuing it, once the flag says so; the ticket counts as a 32-bit
    counter (a flag past it, also across the wrap, releases at once); status is 0."""
    import time

    from pagedcore.ops.bitmask import wait_host_flag

    flag = torch.zeros(1, dtype=torch.int32).pin_memory()
    word = flag.numpy().view(np.uint32)
    status = torch.full((1,), 7, dtype=torch.int32).cuda()
    src = torch.zeros(4096, dtype=torch.int32).pin_memory()
    word[0] = 2**32 - 1
    wait_host_flag(flag, 0, status, 10.0)  # 0 comes after 2**32 - 1: held
    dst = src.to("cuda", non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    time.sleep(0.2)
    assert not done.query()  # still held
    src.fill_(5)
    word[0] = 0
    done.synchronize()
    assert bool((dst.cpu() == 5).all()) and status.item() == 0
    word[0] = 9
    status.fill_(7)
    wait_host_flag(flag, 3, status, 10.0)  # an earlier ticket: passes at once
    torch.cuda.synchronize()
    assert status.item() == 0


@pytest.mark.cuda
def test_wait_host_flag_gives_up_after_the_timeout() -> None:
    import time

    from pagedcore.ops.bitmask import wait_host_flag

    flag = torch.zeros(1, dtype=torch.int32).pin_memory()
    status = torch.zeros(1, dtype=torch.int32).cuda()
    t0 = time.perf_counter()
    wait_host_flag(flag, 1, status, 0.05)
    torch.cuda.synchronize()
    assert status.item() == 1 and 0.04 < time.perf_counter() - t0 < 5.0
    with pytest.raises(ValueError, match="flag must be one int32 in pinned host memory"):
        wait_host_flag(torch.zeros(1, dtype=torch.int32), 1, status, 1.0)
    with pytest.raises(ValueError, match="ticket"):
        wait_host_flag(flag, 2**32, status, 1.0)
