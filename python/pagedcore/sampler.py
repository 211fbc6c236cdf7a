"""Sampling: logits -> token ids (+ logprobs), in pure torch, on any device.

One call turns a step's logits ``[S, V]`` (one row per sample) into one token
per row. The order of operations is vLLM v1's:

1. raw logprobs: ``log_softmax`` of the logits as the model produced them;
2. blocked (row, token) pairs -> -inf (min_tokens: EOS and stop tokens);
3. penalties: repetition (prompt and output tokens), frequency and presence
   (output tokens);
4. greedy rows: argmax of the penalized logits;
5. random rows: / temperature, min_p, top_k, top_p, then the exponential race
   ``argmax(probs / q)`` with ``q ~ Exp(1)``, drawn from the row's own
   ``torch.Generator`` when the request is seeded.

Everything is batched over rows; the only Python loop is over the seeded rows
(one ``exponential_`` per seeded row), and nothing reads a device value back to
the host. See :class:`Sampler` for the guarantees on ties and -inf rows.

What a step costs follows what its rows ask for: a batch of greedy rows takes
one max over the vocabulary (plus the raw ``log_softmax`` only when a row
wants logprobs); top-k is a ``torch.topk`` of the batch's largest k, and
top-p a search over those candidates when the row also has a top-k; only
rows with top-p and no top-k sort their whole vocabulary. The host-side
copies of top_k/top_p in :class:`SamplingMetadata` let the sampler choose
without reading the device. :func:`pack_for_host` and :func:`unpack_on_host`
put a step's results into one float64 buffer, so that the host needs one
copy per step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from .sampling_params import _SAMPLING_EPS, SamplingParams

__all__ = [
    "HostSamplerOutput",
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "apply_blocked_tokens",
    "apply_min_p",
    "apply_penalties",
    "apply_top_k_top_p",
    "pack_for_host",
    "row_max",
    "token_bin_counts",
    "unpack_on_host",
]

# NOTE: top_p is compared with float32 cumulative sums of float32 softmax
# outputs, which carry a few ulps of error; without a tolerance a set that
# reaches top_p exactly (0.5 + 0.25 for top_p = 0.75) would keep one more token
# or not depending on rounding, and differently on CPU and GPU.
_TOP_P_TOLERANCE = 1e-6

# NOTE: exponential_ may return exactly 0 (it does on some CUDA versions);
# probs / 0 would be inf for a kept token, or nan (0 / 0) for a masked one,
# and argmax would then pick a masked token. Clamping q away from 0 keeps
# masked tokens at exactly 0 and changes the distribution by nothing
# measurable.
_MIN_EXPONENTIAL = 1e-30


@dataclass
class SamplingMetadata:
    """Per-row sampling parameters of one step, as tensors on the logits' device.

    Rows are samples (a request with n > 1 has n rows). Only tensors, host
    flags and the generators dict: the model runner fills it from its
    per-request arrays without a Python loop over rows;
    :meth:`from_params` is the convenient (looping) constructor for tests
    and simple callers.

    Attributes
    ----------
    temperature : Tensor
        ``[S]`` float32; a value below 1e-5 (0) makes the row greedy.
    top_k : Tensor
        ``[S]`` int32 or int64; 0 = off; larger than V = off.
    top_p : Tensor
        ``[S]`` float32 in (0, 1]; 1 = off.
    min_p : Tensor
        ``[S]`` float32 in [0, 1]; 0 = off.
    all_greedy, all_random : bool
        Host-side: every row greedy / no row greedy. Lets the sampler skip
        the random path / the argmax. Must agree with ``temperature``.
    no_top_k, no_top_p, no_min_p : bool
        Host-side: no row uses top_k / top_p / min_p. Lets the sampler skip
        the sort / the min_p pass. Must agree with the tensors.
    generators : dict of int to torch.Generator
        Row -> generator (on the logits' device) for seeded rows; the other
        rows use the global RNG. The caller owns the generators and keeps
        them across steps (one per seeded sequence).
    host_top_k, host_top_p : Tensor or None
        ``[S]`` on the host (CPU tensors): the same values as ``top_k`` and
        ``top_p``. Optional; with them the sampler picks the cheapest exact
        method per row without reading the device (``torch.topk`` of the
        largest k; a full sort only for rows with top-p and no top-k). None:
        every row that uses top-k or top-p sorts its vocabulary.
    num_logprobs : int
        Top-K log-probabilities to return, the max over rows; 0 = none.
    need_sampled_logprobs : bool
        Host-side: whether ``sampled_logprobs`` is wanted when
        ``num_logprobs`` is 0. False saves the raw ``log_softmax`` pass over
        ``[S, V]`` (the engine asks for it only when a request wants
        logprobs: ``cumulative_logprob`` is reported only then, as in vLLM);
        the output's ``sampled_logprobs`` is then None.
    penalty_rows : Tensor or None
        ``[P]`` int64: the rows (indices into S) that use penalties; None when
        no row does (then the four tensors below are None too).
    presence_penalty, frequency_penalty, repetition_penalty : Tensor or None
        ``[P]`` float32 each.
    output_token_counts : Tensor or None
        ``[P, V]`` float32: occurrences of each token in the row's output
        tokens so far (see :func:`token_bin_counts`).
    prompt_token_mask : Tensor or None
        ``[P, V]`` bool: tokens present in the row's prompt.
    blocked_rows, blocked_tokens : Tensor or None
        ``[M]`` int64 each: (row, token) pairs whose logits are set to -inf
        before anything else (min_tokens). None or empty = none.
    bitmask_rows, token_bitmask : Tensor or None
        ``[B]`` int64 rows (distinct; all S in order when B == S) and their
        ``[B, ceil(V / 32)]`` int32 bitmasks (structured outputs): a token whose
        bit is 0 is blocked (-inf) before anything else. None = no row is constrained.
    bitmask_status : Tensor or None
        CUDA: ``[1]`` int32 on the device, set by the device-side wait for the
        masks (:func:`pagedcore.ops.bitmask.wait_host_flag`); nonzero when they
        never came, and the constrained rows then sample nothing (-1). None: the
        masks were in place before the sampler was queued.
    """

    temperature: Tensor
    top_k: Tensor
    top_p: Tensor
    min_p: Tensor
    all_greedy: bool
    all_random: bool
    no_top_k: bool
    no_top_p: bool
    no_min_p: bool
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    host_top_k: Tensor | None = None
    host_top_p: Tensor | None = None
    num_logprobs: int = 0
    need_sampled_logprobs: bool = True
    penalty_rows: Tensor | None = None
    presence_penalty: Tensor | None = None
    frequency_penalty: Tensor | None = None
    repetition_penalty: Tensor | None = None
    output_token_counts: Tensor | None = None
    prompt_token_mask: Tensor | None = None
    blocked_rows: Tensor | None = None
    blocked_tokens: Tensor | None = None
    bitmask_rows: Tensor | None = None
    token_bitmask: Tensor | None = None
    bitmask_status: Tensor | None = None

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        device: torch.device | str = "cpu",
        *,
        vocab_size: int | None = None,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        output_token_ids: Sequence[Sequence[int]] | None = None,
        eos_token_id: int | Sequence[int] | None = None,
        generators: dict[int, torch.Generator] | None = None,
    ) -> SamplingMetadata:
        """Builds the metadata for one step from one SamplingParams per row.

        Parameters
        ----------
        params : sequence of SamplingParams
            ``S`` entries, one per row.
        device : torch.device or str
            Device of the logits.
        vocab_size : int, optional
            ``V``; required when a row uses penalties.
        prompt_token_ids, output_token_ids : sequence of sequence of int, optional
            Per row, the prompt and the output tokens so far (``S`` entries
            each); used by the penalties and by min_tokens (a row with fewer
            than ``min_tokens`` outputs has EOS and its stop_token_ids
            blocked). None = empty for every row.
        eos_token_id : int or sequence of int, optional
            EOS id(s), blocked during min_tokens unless the row ignores EOS.
        generators : dict of int to torch.Generator, optional
            Row -> generator for the seeded rows. When None, a fresh
            generator seeded with ``params[row].seed`` is made for every
            seeded random row (right for one step; across steps the caller
            must keep and pass the same generators).

        Returns
        -------
        SamplingMetadata

        Examples
        --------
        >>> md = SamplingMetadata.from_params([SamplingParams(temperature=0.0)])
        >>> md.all_greedy, md.temperature.shape
        (True, torch.Size([1]))
        """
        device = torch.device(device)
        num_rows = len(params)
        for name, rows in (("prompt_token_ids", prompt_token_ids),
                           ("output_token_ids", output_token_ids)):
            if rows is not None and len(rows) != num_rows:
                raise ValueError(f"{name} has {len(rows)} rows, expected {num_rows}")
        if eos_token_id is None:
            eos_ids: list[int] = []
        elif isinstance(eos_token_id, int):
            eos_ids = [eos_token_id]
        else:
            eos_ids = [int(t) for t in eos_token_id]

        greedy = [p.is_greedy for p in params]
        if generators is None:
            generators = {}
            for row, p in enumerate(params):
                if p.seed is not None and not greedy[row]:
                    g = torch.Generator(device=device)
                    g.manual_seed(p.seed)
                    generators[row] = g

        def floats(values: list[float]) -> Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device)

        host_top_k = torch.tensor([p.top_k for p in params], dtype=torch.int64)
        host_top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32)
        md = cls(
            temperature=floats([0.0 if g else p.temperature for p, g in zip(params, greedy)]),
            top_k=host_top_k.to(device),
            top_p=host_top_p.to(device),
            min_p=floats([p.min_p for p in params]),
            all_greedy=all(greedy),
            all_random=not any(greedy),
            no_top_k=all(p.top_k == 0 for p in params),
            no_top_p=all(p.top_p >= 1.0 for p in params),
            no_min_p=all(p.min_p == 0.0 for p in params),
            generators=generators,
            host_top_k=host_top_k,
            host_top_p=host_top_p,
            num_logprobs=max((p.logprobs or 0 for p in params), default=0),
        )

        def outputs(row: int) -> Sequence[int]:
            return output_token_ids[row] if output_token_ids is not None else ()

        def prompt(row: int) -> Sequence[int]:
            return prompt_token_ids[row] if prompt_token_ids is not None else ()

        penalty_rows = [row for row, p in enumerate(params) if p.uses_penalties]
        if penalty_rows:
            if vocab_size is None:
                raise ValueError("vocab_size is required when a row uses penalties")
            md.penalty_rows = torch.tensor(penalty_rows, dtype=torch.int64, device=device)
            md.presence_penalty = floats([params[r].presence_penalty for r in penalty_rows])
            md.frequency_penalty = floats([params[r].frequency_penalty for r in penalty_rows])
            md.repetition_penalty = floats([params[r].repetition_penalty for r in penalty_rows])
            md.output_token_counts = token_bin_counts(
                _pad([outputs(r) for r in penalty_rows], device), vocab_size)
            md.prompt_token_mask = token_bin_counts(
                _pad([prompt(r) for r in penalty_rows], device), vocab_size) > 0

        blocked_rows: list[int] = []
        blocked_tokens: list[int] = []
        for row, p in enumerate(params):
            if len(outputs(row)) < p.min_tokens:
                stops = list(p.stop_token_ids) + ([] if p.ignore_eos else eos_ids)
                for t in dict.fromkeys(stops):
                    blocked_rows.append(row)
                    blocked_tokens.append(t)
        if blocked_rows:
            md.blocked_rows = torch.tensor(blocked_rows, dtype=torch.int64, device=device)
            md.blocked_tokens = torch.tensor(blocked_tokens, dtype=torch.int64, device=device)
        return md


def _pad(rows: list[Sequence[int]], device: torch.device) -> Tensor:
    width = max((len(r) for r in rows), default=0)
    out = torch.full((len(rows), max(width, 1)), -1, dtype=torch.int64)
    for i, r in enumerate(rows):
        if len(r):
            out[i, :len(r)] = torch.as_tensor(r, dtype=torch.int64)
    return out.to(device)


def token_bin_counts(token_ids: Tensor, vocab_size: int) -> Tensor:
    """Counts each token id per row (for ``output_token_counts``).

    Parameters
    ----------
    token_ids : Tensor
        ``[P, L]`` integer, padded with any id outside ``[0, vocab_size)``
        (e.g. -1 or ``vocab_size``); padding is not counted.
    vocab_size : int
        ``V``.

    Returns
    -------
    Tensor
        ``[P, V]`` float32 on ``token_ids``' device; ``> 0`` of it is the
        ``prompt_token_mask`` when ``token_ids`` are prompt tokens.

    Examples
    --------
    >>> token_bin_counts(torch.tensor([[2, 2, 0, -1]]), 4).tolist()
    [[1.0, 0.0, 2.0, 0.0]]
    """
    ids = token_ids.long()
    # Padding goes to an extra dump column that is cut off afterwards.
    ids = torch.where((ids >= 0) & (ids < vocab_size), ids, vocab_size)
    counts = torch.zeros(ids.shape[0], vocab_size + 1, dtype=torch.float32, device=ids.device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    return counts[:, :vocab_size]


@dataclass
class SamplerOutput:
    """What :class:`Sampler` returns for one step (all on the logits' device).

    Attributes
    ----------
    sampled_token_ids : Tensor
        ``[S]`` int64. -1 for a row that has no sampleable token (every logit
        -inf after blocking and penalties) or a nan logit; the caller must
        finish such a request rather than pass -1 to the engine.
    sampled_logprobs : Tensor or None
        ``[S]`` float32: log-prob of the sampled token under
        ``log_softmax`` of the raw logits (before blocking, penalties,
        temperature and truncation; vLLM v1's "raw_logprobs"). -inf for a
        -1 row. None when the metadata asked for none
        (``need_sampled_logprobs`` False and ``num_logprobs`` 0).
    logprob_token_ids : Tensor or None
        ``[S, K]`` int64, ``K = num_logprobs``: the K most likely tokens of
        the raw distribution, most likely first. None when K == 0.
    logprobs : Tensor or None
        ``[S, K]`` float32: their raw log-probs, descending. None when K == 0.
    sampled_rank : Tensor or None
        ``[S]`` int64: rank of the sampled token in the raw distribution,
        counted as vLLM does (the number of tokens whose raw log-prob is >=
        the sampled token's, so 1 = strictly most likely; a tie shares the
        worse rank). None when K == 0.
    """

    sampled_token_ids: Tensor
    sampled_logprobs: Tensor | None
    logprob_token_ids: Tensor | None = None
    logprobs: Tensor | None = None
    sampled_rank: Tensor | None = None


def apply_blocked_tokens(logits: Tensor, rows: Tensor | None, tokens: Tensor | None) -> Tensor:
    """Sets ``logits[rows[i], tokens[i]] = -inf`` in place.

    Parameters
    ----------
    logits : Tensor
        ``[S, V]`` float32, modified in place.
    rows, tokens : Tensor or None
        ``[M]`` int64 each; None or empty = nothing to do.

    Returns
    -------
    Tensor
        ``logits``.
    """
    if rows is not None and rows.numel() > 0:
        # NOTE: a device-side scalar: `logits[rows, tokens] = -inf` copies a
        # host scalar to the device, which synchronizes.
        logits.index_put_((rows, tokens), logits.new_full((), float("-inf")))
    return logits


def apply_token_bitmask(logits: Tensor, rows: Tensor, bitmask: Tensor, status: Tensor | None = None) -> Tensor:
    """Sets ``logits[rows[i], t] = -inf`` in place for every token ``t`` whose bit
    (bit ``t % 32`` of word ``t // 32`` of ``bitmask[i]``) is 0; columns beyond
    the bitmask's ``32 * W`` are blocked too.

    Parameters
    ----------
    logits : Tensor
        ``[S, V]`` float32, modified in place.
    rows : Tensor
        ``[B]`` int64 (int32 too on CUDA), distinct; when ``B == S``, ``0 .. S - 1``
        in order (every row).
    bitmask : Tensor
        ``[B, W]`` int32 on the logits' device.
    status : Tensor, optional
        CUDA only: see ``SamplingMetadata.bitmask_status`` (nonzero: the rows are set
        to NaN instead).

    Returns
    -------
    Tensor
        ``logits``.

    >>> logits = torch.zeros(2, 3)
    >>> apply_token_bitmask(logits, torch.tensor([1]), torch.tensor([[0b101]], dtype=torch.int32))[1].tolist()
    [0.0, -inf, 0.0]
    """
    if bitmask.device.type != "cpu":
        # One kernel over the rows' logits (the unpacking in torch took five passes over
        # [B, 32 W] int32 and bool intermediates, and as many launches).
        from .ops.bitmask import apply_token_bitmask_

        return apply_token_bitmask_(logits, bitmask, None if rows.shape[0] == logits.shape[0] else rows, status)
    vocab = logits.shape[1]
    # NOTE: numpy unpacks the bits in one single-threaded pass (~0.2 ms for 64 rows of
    # a 49k vocabulary); torch's shift-and-mask over [B, W, 32] took ~100 ms on two
    # loaded cores. Bit t of a row is bit t % 8 of its byte t // 8 on a little-endian
    # host; count pads with 0 (blocked) past 32 W, or cuts at the vocabulary.
    bits = np.unpackbits(bitmask.contiguous().numpy().view(np.uint8), axis=1, count=vocab, bitorder="little")
    blocked = torch.from_numpy(np.logical_not(bits.view(np.bool_)))
    if rows.shape[0] == logits.shape[0]:  # every row, in order: no gather and scatter
        return logits.masked_fill_(blocked, float("-inf"))
    sub = logits.index_select(0, rows).masked_fill_(blocked, float("-inf"))
    return logits.index_copy_(0, rows, sub)


def apply_penalties(logits: Tensor, md: SamplingMetadata) -> Tensor:
    """Applies the repetition, frequency and presence penalties (vLLM v1).

    For each penalized row: a token present in the prompt or the output has
    its logit divided by ``repetition_penalty`` when positive, multiplied by
    it otherwise; then ``logit -= frequency_penalty * output_count`` and
    ``logit -= presence_penalty * (output_count > 0)``.

    Parameters
    ----------
    logits : Tensor
        ``[S, V]`` float32; not modified.
    md : SamplingMetadata
        Penalty tensors; when ``md.penalty_rows`` is None nothing is applied.

    Returns
    -------
    Tensor
        ``[S, V]`` float32, a new tensor (or ``logits`` itself when no row
        uses penalties).

    Examples
    --------
    >>> p = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5)
    >>> md = SamplingMetadata.from_params([p], vocab_size=3, prompt_token_ids=[[0]],
    ...                                   output_token_ids=[[1, 1]])
    >>> apply_penalties(torch.tensor([[2.0, -1.0, 1.0]]), md).tolist()
    [[1.0, -3.0, 1.0]]
    """
    if md.penalty_rows is None:
        return logits
    return _apply_penalties_(logits.clone(), md)


def _apply_penalties_(logits: Tensor, md: SamplingMetadata) -> Tensor:
    rows = md.penalty_rows
    x = logits.index_select(0, rows)
    counts = md.output_token_counts
    in_output = counts > 0
    rep = md.repetition_penalty.unsqueeze(1)
    penalized = torch.where(x > 0, x / rep, x * rep)
    x = torch.where(in_output | md.prompt_token_mask, penalized, x)
    x = x - md.frequency_penalty.unsqueeze(1) * counts
    x = x - md.presence_penalty.unsqueeze(1) * in_output
    return logits.index_copy_(0, rows, x)


def apply_min_p(logits: Tensor, min_p: Tensor) -> Tensor:
    """Masks tokens whose probability is below ``min_p`` times the row's top
    probability, in place.

    Computed in logit space (``logit - max < log(min_p)``), which needs no
    softmax; the most likely token and its ties always survive.

    Parameters
    ----------
    logits : Tensor
        ``[S, V]`` float32 (already divided by the temperature), modified in
        place.
    min_p : Tensor
        ``[S]`` float32; 0 = off for that row.

    Returns
    -------
    Tensor
        ``logits``.
    """
    # p_i < min_p * p_max  <=>  logit_i < logit_max + log(min_p); log(0) = -inf
    # masks nothing.
    cutoff = logits.amax(dim=-1, keepdim=True) + torch.log(min_p.to(logits.dtype)).unsqueeze(1)
    return logits.masked_fill_(logits < cutoff, float("-inf"))


#: Fewest rows for which CUDA takes the planned (topk-based) thresholds instead of a sort.
_PLANNED_MIN_CUDA_ROWS = 128


def apply_top_k_top_p(logits: Tensor, top_k: Tensor | None, top_p: Tensor | None, *,
                      host_top_k: Tensor | None = None,
                      host_top_p: Tensor | None = None) -> Tensor:
    """Keeps the ``top_k`` most likely tokens, then the smallest set of those
    whose probability reaches ``top_p``; masks the rest to -inf, in place.

    Both cuts are value thresholds, so tokens tied with the last kept token
    are kept too (the kept set may exceed ``top_k``) and the result does not
    depend on the sort's order among ties. The most likely token is always
    kept. ``top_p`` is applied to the renormalized distribution left by
    ``top_k``, as in vLLM; a set reaching ``top_p`` within 1e-6 counts as
    reaching it.

    Parameters
    ----------
    logits : Tensor
        ``[S, V]`` float32, modified in place.
    top_k : Tensor or None
        ``[S]`` integer; 0 (or >= V) = off for that row; None = off for all.
    top_p : Tensor or None
        ``[S]`` float32; 1 = off for that row; None = off for all.
    host_top_k, host_top_p : Tensor or None
        The same values on the host (CPU tensors; a None argument above
        needs none here). With them the cuts come from ``torch.topk`` of the
        batch's largest k, and only rows with top_p and no top_k sort their
        whole row (on CUDA from 128 rows on: fewer rows sort); without them
        every row is sorted. The kept sets are the
        same either way (up to float rounding of the cumulative sums, which
        the 1e-6 tolerance absorbs).

    Returns
    -------
    Tensor
        ``logits``.

    Examples
    --------
    >>> x = torch.tensor([[3.0, 1.0, 2.0, 2.0]])
    >>> apply_top_k_top_p(x, torch.tensor([2]), None).isfinite().tolist()
    [[True, False, True, True]]
    """
    if top_k is None and top_p is None:
        return logits
    hints = (host_top_k is not None or top_k is None) and (host_top_p is not None or top_p is None)
    # NOTE: on CUDA a few rows are bound by launch latency, and the plan's extra launches
    # cost more than the sort they avoid (H200, vocab 49k-128k: slower at 1 and 16 rows,
    # faster at 256; bench/RESULTS.md). Both give the same thresholds.
    if hints and not (logits.is_cuda and logits.shape[0] < _PLANNED_MIN_CUDA_ROWS):
        threshold = _planned_thresholds(logits, top_k, top_p, host_top_k, host_top_p)
    else:
        threshold = _sorted_thresholds(logits, top_k, top_p)
    return logits.masked_fill_(logits < threshold, float("-inf"))


def _sorted_thresholds(logits: Tensor, top_k: Tensor | None, top_p: Tensor | None) -> Tensor:
    """``[S, 1]``: the smallest kept value per row, from a full sort of each row."""
    vocab_size = logits.shape[-1]
    sorted_logits = logits.sort(dim=-1, descending=True).values
    threshold = None
    if top_k is not None:
        k = top_k.long()
        k = torch.where((k <= 0) | (k > vocab_size), vocab_size, k)
        threshold = sorted_logits.gather(1, (k - 1).unsqueeze(1))
        sorted_logits.masked_fill_(sorted_logits < threshold, float("-inf"))
    if top_p is not None:
        cumulative = sorted_logits.softmax(dim=-1).cumsum_(dim=-1)
        # Token i is needed while the mass before it, cumulative[i - 1], is
        # below top_p: 1 + #{j : cumulative[j] < top_p} tokens, the first one
        # always. NOTE: cumulative never decreases (a float sum of
        # non-negative terms), which searchsorted relies on; it replaces an
        # [S, V] compare-and-count with a binary search per row.
        target = (top_p - _TOP_P_TOLERANCE).to(cumulative.dtype).unsqueeze(1)
        below = torch.searchsorted(cumulative, target)
        num_kept = (below + 1).clamp_(max=vocab_size)
        p_threshold = sorted_logits.gather(1, num_kept - 1)
        # top_p == 1 must keep everything, even tail tokens whose cumulative
        # sum rounds to 1 before the end.
        p_threshold.masked_fill_((top_p >= 1.0).unsqueeze(1), float("-inf"))
        threshold = p_threshold if threshold is None else torch.maximum(threshold, p_threshold)
    return threshold


def _planned_thresholds(logits: Tensor, top_k: Tensor | None, top_p: Tensor | None,
                        host_top_k: Tensor | None, host_top_p: Tensor | None) -> Tensor:
    """``[S, 1]``: the same thresholds as :func:`_sorted_thresholds`, sorting
    only the rows with top_p and no top_k.

    Rows with a top_k take ``torch.topk`` of the batch's largest k: the
    k-th value is the k-th of a full sort. Their top_p (if any) needs only
    those candidates: the renormalized distribution after top_k holds the
    candidates down to the k-th value plus the tokens tied with it that
    topk left out (counted over the row), which all have the k-th value; so
    if the candidates' cumulative mass does not reach top_p, the cut falls
    among those ties and the top_k threshold stands.
    """
    num_rows, vocab_size = logits.shape
    neg_inf = float("-inf")
    # The plan, from host values only (no device read).
    if top_k is not None:
        hk = host_top_k.long()
        host_k_on = (hk > 0) & (hk < vocab_size)
    else:
        host_k_on = torch.zeros(num_rows, dtype=torch.bool)
    host_p_on = host_top_p < 1.0 if top_p is not None else torch.zeros(num_rows, dtype=torch.bool)
    max_k = int(host_top_k.long()[host_k_on].max()) if bool(host_k_on.any()) else 0
    num_sorted = int((host_p_on & ~host_k_on).sum())
    p_with_k = bool((host_p_on & host_k_on).any())

    threshold = logits.new_full((num_rows, 1), neg_inf)
    if max_k > 0:
        k = top_k.long()
        k_on = ((k > 0) & (k < vocab_size)).unsqueeze(1)
        candidates = logits.topk(max_k, dim=-1).values  # [S, max_k], descending
        k_threshold = candidates.gather(1, (k.clamp(1, max_k) - 1).unsqueeze(1))
        threshold = k_threshold.masked_fill_(~k_on, neg_inf)
        if p_with_k:
            p_threshold = _top_p_over_candidates(logits, candidates, threshold, top_p)
            p_threshold.masked_fill_(~k_on, neg_inf)  # rows without top_k: sorted below
            threshold = torch.maximum(threshold, p_threshold)
    if num_sorted > 0:
        sort_rows = (top_p < 1.0).unsqueeze(1)
        if top_k is not None:
            k = top_k.long()
            sort_rows &= ((k <= 0) | (k >= vocab_size)).unsqueeze(1)
        if num_sorted == num_rows:
            threshold = _sorted_thresholds(logits, None, top_p)
        else:
            # The rows to sort, in order, found on the device: a stable sort of
            # the [S] mask puts them first (their number is known on the host).
            rows = torch.sort(sort_rows.squeeze(1).to(torch.int8), descending=True,
                              stable=True).indices[:num_sorted]
            sorted_part = _sorted_thresholds(logits.index_select(0, rows), None,
                                             top_p.index_select(0, rows))
            threshold = threshold.index_copy_(0, rows, sorted_part)
    return threshold


def _top_p_over_candidates(logits: Tensor, candidates: Tensor, k_threshold: Tensor,
                           top_p: Tensor) -> Tensor:
    """``[S, 1]`` top_p threshold of rows with a top_k, from the top-k
    candidates (see :func:`_planned_thresholds`); at most the top_k threshold
    where the candidates' mass does not reach top_p, -inf for top_p == 1."""
    neg_inf = float("-inf")
    num_candidates = candidates.shape[1]
    top = candidates[:, :1]
    kept = candidates >= k_threshold
    weights = torch.exp(candidates - top).masked_fill_(~kept, 0.0)
    # Tokens tied with the k-th value beyond the candidates are kept by top_k
    # too and belong to the renormalized mass.
    num_kept = (logits >= k_threshold).sum(dim=-1, keepdim=True, dtype=torch.int32)
    num_left_out = num_kept - kept.sum(dim=-1, keepdim=True, dtype=torch.int32)
    tail = torch.where(num_left_out > 0, num_left_out * torch.exp(k_threshold - top), 0.0)
    total = weights.sum(dim=-1, keepdim=True).add_(tail)
    cumulative = weights.div_(total).cumsum_(dim=-1)
    target = (top_p - _TOP_P_TOLERANCE).to(cumulative.dtype).unsqueeze(1)
    below = torch.searchsorted(cumulative, target)
    # Not reached (below == max_k): the last candidate, which is at most the top_k
    # threshold, so that one decides.
    p_threshold = candidates.gather(1, below.clamp_(max=num_candidates - 1))
    return p_threshold.masked_fill_((top_p >= 1.0).unsqueeze(1), neg_inf)


class Sampler:
    """Turns a step's logits into one token per row (vLLM v1 semantics).

    Notes
    -----
    Guarantees:

    - A token whose logit is -inf after blocking and penalties, or that
      temperature/min_p/top_k/top_p masked, is never returned.
    - Greedy rows return the first index of the maximum (ties -> lowest id).
    - A seeded row's token depends only on its logits, its parameters and its
      generator's state, not on the other rows or its position.
    - A row with no sampleable token (all -inf after blocking and
      penalties), or with a nan logit, returns -1.
    - The input logits are not modified; nothing is read back to the host.

    Examples
    --------
    >>> md = SamplingMetadata.from_params([SamplingParams(temperature=0.0)])
    >>> Sampler()(torch.tensor([[0.0, 2.0, 1.0]]), md).sampled_token_ids.tolist()
    [1]
    """

    def __call__(self, logits: Tensor, md: SamplingMetadata) -> SamplerOutput:
        """Samples one token per row.

        Parameters
        ----------
        logits : Tensor
            ``[S, V]``, float32 (other float dtypes are converted); not
            modified.
        md : SamplingMetadata
            Per-row parameters on the same device.

        Returns
        -------
        SamplerOutput
        """
        _check_inputs(logits, md)
        logits = logits.float()
        processed = self.process_logits(logits, md, for_random=False)
        # One pass gives the greedy tokens (first index of the max) and the
        # rows that have a sampleable token: truncation always keeps a row's
        # top token, so a row has one iff its max is finite (max propagates
        # nan, so a row with a nan logit has none either).
        top_logits, greedy_ids = row_max(processed)
        valid = top_logits > float("-inf")
        if md.all_greedy:  # nothing else over [S, V] unless logprobs are wanted
            sampled = greedy_ids
        else:
            random_logits = self._truncate(processed, md)
            random_ids = _exponential_race(random_logits.softmax(dim=-1), md.generators)
            if md.all_random:
                sampled = random_ids
            else:
                sampled = torch.where(md.temperature < _SAMPLING_EPS, greedy_ids, random_ids)
        sampled = torch.where(valid, sampled, -1)
        if md.num_logprobs == 0 and not md.need_sampled_logprobs:
            return SamplerOutput(sampled_token_ids=sampled, sampled_logprobs=None)
        return _gather_logprobs(logits, sampled, valid, md.num_logprobs)

    def process_logits(self, logits: Tensor, md: SamplingMetadata,
                       for_random: bool = True) -> Tensor:
        """The logits the tokens are drawn from (a test and debugging hook).

        Parameters
        ----------
        logits : Tensor
            ``[S, V]`` float32; not modified.
        md : SamplingMetadata
        for_random : bool
            False: after blocking and penalties (what greedy rows take the
            argmax of). True: additionally divided by the temperature (1 for
            greedy rows) and masked by min_p, top_k and top_p (what random
            rows sample from, with probabilities ``softmax`` of it).

        Returns
        -------
        Tensor
            ``[S, V]`` float32; masked tokens are -inf. May be ``logits``
            itself when nothing applies.
        """
        has_blocked = md.blocked_rows is not None and md.blocked_rows.numel() > 0
        has_bitmask = md.bitmask_rows is not None and md.bitmask_rows.numel() > 0
        if has_blocked or has_bitmask or md.penalty_rows is not None:
            # One private copy for the in-place passes; the caller's logits
            # stay untouched (they feed the raw logprobs).
            logits = logits.clone()
            apply_blocked_tokens(logits, md.blocked_rows, md.blocked_tokens)
            if has_bitmask:
                apply_token_bitmask(logits, md.bitmask_rows, md.token_bitmask, md.bitmask_status)
            if md.penalty_rows is not None:
                _apply_penalties_(logits, md)
        return self._truncate(logits, md) if for_random else logits

    @staticmethod
    def _truncate(logits: Tensor, md: SamplingMetadata) -> Tensor:
        # Division makes a new tensor, so the masks below may work in place.
        # NOTE: the casts are no-ops for float32 metadata; a float64 tensor
        # would otherwise promote every [S, V] pass below to float64.
        temperature = md.temperature.to(logits.dtype)
        temperature = torch.where(temperature < _SAMPLING_EPS, 1.0, temperature)
        logits = logits / temperature.unsqueeze(1)
        if not md.no_min_p:
            apply_min_p(logits, md.min_p)
        if not (md.no_top_k and md.no_top_p):
            apply_top_k_top_p(logits, None if md.no_top_k else md.top_k,
                              None if md.no_top_p else md.top_p,
                              host_top_k=md.host_top_k, host_top_p=md.host_top_p)
        return logits


def row_max(x: Tensor, two_pass: bool | None = None) -> tuple[Tensor, Tensor]:
    """``x.max(dim=-1)`` of a ``[S, V]`` tensor: the values and the first index of each
    row's maximum (nan, when a row has one, with the first nan's index).

    On CUDA, in two passes when a row is long and the rows are few: the maximum of
    each chunk of ``C`` columns (``C`` the largest power of two <= 1024 dividing ``V``),
    then of the chunks. A single reduction over a few long rows runs on a few CTAs:
    27 us for one row of 128k logits on the H200, against a few us for the two passes.
    The first chunk holding the row's maximum holds its first index, so the result
    is the same. ``two_pass`` None: on CUDA for up to 64 rows; True/False forces it
    (where the shape allows: ``C >= 8`` and at least two chunks).

    >>> [t.tolist() for t in row_max(torch.tensor([[1.0, 3.0, 3.0, 2.0] * 4]), two_pass=True)]
    [[3.0], [1]]
    """
    rows, vocab = x.shape
    chunk = min(vocab & -vocab, 1024)  # the largest power of two dividing the vocabulary
    if two_pass is None:
        two_pass = x.device.type == "cuda" and rows <= 64 and chunk >= 64 and vocab // chunk >= 8
    if not two_pass or chunk < 8 or vocab // chunk < 2 or not x.is_contiguous():
        return x.max(dim=-1)
    part_max, part_idx = x.view(rows, vocab // chunk, chunk).max(dim=-1)
    top, which = part_max.max(dim=-1)
    return top, which * chunk + part_idx.gather(1, which[:, None])[:, 0]


def _exponential_race(probs: Tensor, generators: dict[int, torch.Generator]) -> Tensor:
    """``argmax(probs / q)``, ``q ~ Exp(1)``: a categorical draw per row.

    ``probs`` [S, V] -> [S] int64. Seeded rows draw their q from their own
    generator, so their result does not depend on the batch.
    """
    q = torch.empty_like(probs)
    if len(generators) < probs.shape[0]:
        q.exponential_()
    if generators:
        # NOTE: one unbind for every row's view, not one q[row] each: on CUDA a step's
        # host time is launches, and the seeded rows' loop is most of them (64 seeded
        # rows: 128 of the sampler's 142 torch calls, 64 with this).
        rows = q.unbind(0)
        for row, generator in generators.items():
            rows[row].exponential_(generator=generator)
    q.clamp_min_(_MIN_EXPONENTIAL)
    return probs.div_(q).argmax(dim=-1)


def _gather_logprobs(raw_logits: Tensor, sampled: Tensor, valid: Tensor,
                     num_logprobs: int) -> SamplerOutput:
    # One fused kernel; torch.logsumexp alone takes longer (several passes).
    raw_logprobs = torch.log_softmax(raw_logits, dim=-1)
    sampled_raw = raw_logprobs.gather(1, sampled.clamp_min(0).unsqueeze(1))
    out = SamplerOutput(
        sampled_token_ids=sampled,
        sampled_logprobs=torch.where(valid, sampled_raw.squeeze(1), float("-inf")))
    if num_logprobs > 0:
        top = raw_logprobs.topk(min(num_logprobs, raw_logits.shape[-1]), dim=-1)
        out.logprob_token_ids = top.indices
        out.logprobs = top.values
        out.sampled_rank = (raw_logprobs >= sampled_raw).sum(dim=-1)
    return out


@dataclass
class HostSamplerOutput:
    """A step's :class:`SamplerOutput` on the host, as the engine consumes it.

    Attributes
    ----------
    token_ids : numpy.ndarray
        ``[S]`` int32 (-1 marks a row with nothing to sample).
    sampled_logprobs : list of float or None
        ``S`` entries; None when the output had none.
    top : tuple of (list, list, list) or None
        ``(logprob_token_ids [S][K], logprobs [S][K], sampled_rank [S])`` as
        nested lists; None when ``num_logprobs`` was 0.
    """

    token_ids: np.ndarray
    sampled_logprobs: list[float] | None
    top: tuple[list[list[int]], list[list[float]], list[int]] | None


def pack_for_host(out: SamplerOutput) -> Tensor:
    """Everything the host reads of a step, in one float64 tensor.

    Layout: ``[sampled_token_ids (S) | sampled_logprobs (S) |
    logprob_token_ids (S*K) | logprobs (S*K) | sampled_rank (S)]``, the
    logprob parts only when present. float64 holds every float32 and every
    integer below 2**53 exactly, so the round trip through
    :func:`unpack_on_host` loses nothing. One buffer means one device-to-host
    copy per step.

    Parameters
    ----------
    out : SamplerOutput

    Returns
    -------
    Tensor
        ``[N]`` float64 on ``out``'s device, a new tensor.

    Examples
    --------
    >>> out = SamplerOutput(torch.tensor([3, -1]), torch.tensor([-0.5, float("-inf")]))
    >>> unpack_on_host(pack_for_host(out), out).sampled_logprobs
    [-0.5, -inf]
    """
    parts = [out.sampled_token_ids]
    if out.sampled_logprobs is not None:
        parts.append(out.sampled_logprobs)
    if out.logprobs is not None:
        parts += [out.logprob_token_ids.flatten(), out.logprobs.flatten(), out.sampled_rank]
    return torch.cat([p.to(torch.float64) for p in parts])


def unpack_on_host(packed: Tensor, like: SamplerOutput) -> HostSamplerOutput:
    """Reads a :func:`pack_for_host` buffer that is on the host.

    Parameters
    ----------
    packed : Tensor
        ``[N]`` float64 on the CPU (pinned or not), fully written: the caller
        waits for the copy that fills it. Not kept: everything returned is a
        copy, so the buffer may be reused at once.
    like : SamplerOutput
        The output that was packed; only its shapes are read (no device
        access).

    Returns
    -------
    HostSamplerOutput
    """
    num_rows = like.sampled_token_ids.shape[0]
    token_ids = packed[:num_rows].to(torch.int32).numpy()
    offset = num_rows
    sampled_logprobs = None
    if like.sampled_logprobs is not None:
        sampled_logprobs = packed[offset:offset + num_rows].tolist()
        offset += num_rows
    top = None
    if like.logprobs is not None:
        width = like.logprobs.shape[1]
        size = num_rows * width
        ids = packed[offset:offset + size].view(num_rows, width).to(torch.int64).tolist()
        values = packed[offset + size:offset + 2 * size].view(num_rows, width).tolist()
        offset += 2 * size
        ranks = packed[offset:offset + num_rows].to(torch.int64).tolist()
        top = (ids, values, ranks)
    return HostSamplerOutput(token_ids=token_ids, sampled_logprobs=sampled_logprobs, top=top)


def _check_inputs(logits: Tensor, md: SamplingMetadata) -> None:
    """Shape/device checks only (no device reads): misuse fails here with a
    clear message instead of deep inside an indexing kernel."""
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"logits must be a 2-D float tensor [S, V], got "
                         f"{tuple(logits.shape)} {logits.dtype}")
    num_rows = logits.shape[0]
    for name in ("temperature", "top_k", "top_p", "min_p"):
        t = getattr(md, name)
        if t.shape != (num_rows,):
            raise ValueError(f"SamplingMetadata.{name} must have shape ({num_rows},), "
                             f"got {tuple(t.shape)}")
        if t.device != logits.device:
            raise ValueError(f"SamplingMetadata.{name} is on {t.device}, logits on "
                             f"{logits.device}")
    if md.penalty_rows is not None:
        num_pen = md.penalty_rows.shape[0]
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
            t = getattr(md, name)
            if t is None or t.shape != (num_pen,):
                raise ValueError(f"SamplingMetadata.{name} must have shape ({num_pen},)")
        for name in ("output_token_counts", "prompt_token_mask"):
            t = getattr(md, name)
            if t is None or t.shape != (num_pen, logits.shape[1]):
                raise ValueError(f"SamplingMetadata.{name} must have shape "
                                 f"({num_pen}, {logits.shape[1]})")
    if (md.blocked_rows is None) != (md.blocked_tokens is None) or (
            md.blocked_rows is not None and md.blocked_rows.shape != md.blocked_tokens.shape):
        raise ValueError("SamplingMetadata.blocked_rows and blocked_tokens must be both None "
                         "or of one shape [M]")
    for row in md.generators:
        if not 0 <= row < num_rows:
            raise ValueError(f"SamplingMetadata.generators has row {row}, outside [0, {num_rows})")
    for name in ("host_top_k", "host_top_p"):
        t = getattr(md, name)
        if t is not None and (t.shape != (num_rows,) or t.device.type != "cpu"):
            raise ValueError(f"SamplingMetadata.{name} must be a CPU tensor of shape ({num_rows},), "
                             f"got {tuple(t.shape)} on {t.device}")
