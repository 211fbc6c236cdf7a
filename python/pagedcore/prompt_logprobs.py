"""Log-probabilities of prompt tokens (``SamplingParams.prompt_logprobs``).

The engine lists, in each step, the token rows whose logits score a prompt
token (``StepBatch.prompt_logprob_*``: every prompt position but the last, once
over a request's life, whatever the chunking or preemptions); the runner keeps
those rows' hidden states (``ModelRunner.prompt_hidden``). Here they become
logits a slice at a time (a ``[rows, vocab]`` float32 block per slice, never
one for a whole long prompt), then raw log-probabilities, the scored token's
rank and the top-k, and finally vLLM's per-token dicts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from .outputs import Logprob

# Rows turned into logits at once: 256 x a 50k vocabulary is 50 MB of float32.
SLICE_ROWS = 256


@dataclass
class PromptScores:
    """One step's prompt-token scores, on the host.

    Attributes
    ----------
    logprobs : numpy.ndarray
        ``[P]`` float32: raw log-probability (``log_softmax`` of the logits, no
        temperature or penalty) of each scored prompt token.
    ranks : numpy.ndarray
        ``[P]`` int64: its rank, counted as vLLM (and the sampler) do: how many
        tokens have a log-probability >= its own (1 = strictly most likely).
    top_ids, top_logprobs : numpy.ndarray
        ``[P, K]`` int64 / float32: the K most likely tokens, most likely first.
    """

    logprobs: np.ndarray
    ranks: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray


@torch.inference_mode()
def score_prompt_tokens(hidden: torch.Tensor, compute_logits: Callable[[torch.Tensor], torch.Tensor],
                        token_ids: torch.Tensor, num_top: int, slice_rows: int | None = None) -> PromptScores:
    """Scores prompt tokens from the hidden states of the positions before them.

    Parameters
    ----------
    hidden : Tensor
        ``[P, hidden_size]``: row i is the final hidden state of the position
        just before scored token i.
    compute_logits : callable
        ``[rows, hidden_size] -> [rows, vocab]`` (the model's LM head).
    token_ids : Tensor
        ``[P]`` int64 on ``hidden``'s device: the scored tokens.
    num_top : int
        K, the top-k kept per row (0: none).
    slice_rows : int, optional
        Rows turned into logits at once (default :data:`SLICE_ROWS`).

    Examples
    --------
    >>> head = torch.nn.Linear(2, 3, bias=False)
    >>> s = score_prompt_tokens(torch.randn(4, 2), head, torch.tensor([0, 1, 2, 0]), 2)
    >>> s.logprobs.shape, s.top_ids.shape
    ((4,), (4, 2))
    """
    rows = hidden.shape[0]
    slice_rows = slice_rows or SLICE_ROWS
    own, ranks, top_ids, top_values = [], [], [], []
    for start in range(0, rows, slice_rows):
        logprobs = torch.log_softmax(compute_logits(hidden[start:start + slice_rows]).float(), dim=-1)
        scored = logprobs.gather(1, token_ids[start:start + slice_rows].unsqueeze(1))
        own.append(scored.squeeze(1))
        ranks.append((logprobs >= scored).sum(dim=-1))
        if num_top > 0:
            top = logprobs.topk(min(num_top, logprobs.shape[-1]), dim=-1)
            top_ids.append(top.indices)
            top_values.append(top.values)
    empty_top = torch.empty((rows, 0), device=hidden.device)
    return PromptScores(
        logprobs=torch.cat(own).cpu().numpy(),
        ranks=torch.cat(ranks).cpu().numpy(),
        top_ids=(torch.cat(top_ids) if top_ids else empty_top.long()).cpu().numpy(),
        top_logprobs=(torch.cat(top_values) if top_values else empty_top).cpu().numpy(),
    )


def logprob_dicts(scores: PromptScores, start: int, end: int, token_ids: np.ndarray, num_top: int,
                  texts: dict[int, str]) -> list[dict[int, Logprob]]:
    """vLLM's dicts for scored rows ``start..end-1``: the scored token first
    (with its rank), then the ``num_top`` most likely tokens (ranks 1..k); a
    scored token among them keeps its place and takes the top-k entry.
    ``texts`` maps every token id involved to its decoded text."""
    out = []
    for i in range(start, end):
        token = int(token_ids[i])
        entry = {token: Logprob(float(scores.logprobs[i]), int(scores.ranks[i]), texts[token])}
        for rank in range(num_top):
            tid = int(scores.top_ids[i, rank])
            entry[tid] = Logprob(float(scores.top_logprobs[i, rank]), rank + 1, texts[tid])
        out.append(entry)
    return out
