"""Beam search over the engine: beams are sequences that fork and share blocks.

The selection follows Hugging Face transformers' beam search (``num_beams``,
``do_sample=False``, ``early_stopping=False``) step for step, so that both give
the same sequences: each step keeps the top ``K = max(2, 1 + #eos) * width``
continuations of all beams by accumulated log-probability; continuations that
end (EOS, or the length limit) and rank among the first ``width`` become
finished hypotheses scored ``sum_logprobs / generated_len ** length_penalty``;
the best ``width`` others run on. The search ends when no running beam can
beat the worst of ``width`` finished hypotheses, or at the length limit.

Engine side: a beam is a sequence; a beam chosen by several continuations is
forked (its blocks shared copy-on-write), one chosen by none is finished.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from . import _C
from .sampling_params import BeamSearchParams

_NEG = -1.0e9


@dataclass
class BeamSearchSequence:
    """One hypothesis: ``tokens`` holds the prompt and the generated tokens."""

    tokens: list[int]
    cum_logprob: float
    score: float
    text: str = ""
    finish_reason: str | None = None


@dataclass
class BeamSearchOutput:
    """The ``beam_width`` best hypotheses of a prompt, best first."""

    sequences: list[BeamSearchSequence]


@dataclass
class _Beam:
    seq_id: int
    tokens: list[int]  # generated so far
    score: float


@dataclass
class _Search:
    request_id: str
    prompt: list[int]
    max_tokens: int
    beams: list[_Beam]
    finished: list[tuple[float, list[int], float, str]] = field(default_factory=list)
    improvable: bool = True
    done: bool = False


def run_beam_search(llm_engine, prompts: list[list[int]], params: BeamSearchParams) -> list[BeamSearchOutput]:
    """Runs beam search for every prompt (one engine request per prompt).

    Prompts run together in waves small enough that every beam of a wave is
    scheduled in every step (seats, token budget and blocks for the worst
    case), since a search can only advance when all its beams have logits.
    The engine must have no other requests in flight.
    """
    engine: _C.Engine = llm_engine.engine
    if llm_engine.has_unfinished_requests() or engine.has_unfinished_requests():
        raise RuntimeError("beam_search needs an idle engine")
    config = engine.config
    width = params.beam_width
    for prompt in prompts:
        if len(prompt) >= llm_engine.max_model_len:
            raise ValueError(
                f"the prompt has {len(prompt)} tokens; max_model_len ({llm_engine.max_model_len}) "
                "leaves no room for a generated token"
            )
    if width > min(config.max_num_seqs, config.max_num_batched_tokens):
        raise ValueError(
            f"beam_width {width} is larger than max_num_seqs ({config.max_num_seqs}) or "
            f"max_num_batched_tokens ({config.max_num_batched_tokens})"
        )

    def blocks(prompt: list[int]) -> int:
        length = min(len(prompt) + params.max_tokens + 1, llm_engine.max_model_len)
        # Every beam may end up with its own copy of every block, plus one in flight.
        return width * (-(-length // config.block_size) + 1)

    outputs: list[BeamSearchOutput] = []
    wave: list[list[int]] = []
    for prompt in prompts:
        if blocks(prompt) > config.num_blocks:
            raise ValueError(
                f"beam_width {width} x max_tokens {params.max_tokens} over a {len(prompt)}-token "
                f"prompt needs up to {blocks(prompt)} KV blocks; the cache has {config.num_blocks}"
            )
        if wave and (
            (len(wave) + 1) * width > min(config.max_num_seqs, config.max_num_batched_tokens)
            or sum(map(blocks, wave)) + blocks(prompt) > config.num_blocks
        ):
            outputs += _run_wave(llm_engine, wave, params)
            wave = []
        wave.append(prompt)
    if wave:
        outputs += _run_wave(llm_engine, wave, params)
    return outputs


def _run_wave(llm_engine, prompts: list[list[int]], params: BeamSearchParams) -> list[BeamSearchOutput]:
    engine: _C.Engine = llm_engine.engine
    width = params.beam_width
    eos = [] if params.ignore_eos else list(llm_engine.eos_token_ids)
    keep = max(2, 1 + len(eos)) * width
    searches = []
    pending = None  # a scheduled step the engine has no tokens for yet
    try:
        for prompt in prompts:
            max_tokens = min(params.max_tokens, llm_engine.max_model_len - len(prompt))
            request_id = f"beam-{llm_engine.new_request_id()}"
            # NOTE: the engine must not end beams on its own: EOS and length are
            # decided here, so it gets ignore_eos and one token of slack.
            first = engine.add_request(
                request_id, prompt, _C.RequestParams(n=1, max_tokens=max_tokens + 1, ignore_eos=True)
            )
            searches.append(_Search(request_id, list(prompt), max_tokens, [_Beam(first, [], 0.0)]))
        while any(not s.done for s in searches):
            batch = pending = engine.schedule()
            logits = llm_engine.runner.execute(batch)
            rows = {int(seq): r for r, seq in enumerate(batch.sample_seq_ids.tolist())}
            log_probs = torch.log_softmax(logits.float(), dim=-1).cpu()
            engine.update(log_probs.argmax(dim=-1).to(torch.int32).numpy())
            pending = None
            for search in searches:
                if search.done:
                    continue
                present = [b.seq_id in rows for b in search.beams]
                if all(present):
                    _advance(engine, search, rows, log_probs, width, keep, eos, params.length_penalty)
                elif any(present):
                    raise RuntimeError("beam search: the beams of a prompt were scheduled apart")
    finally:
        if pending is not None:
            # NOTE: the engine takes no abort while a step awaits its tokens
            # (the forward pass failed): placeholders, then the aborts drop them.
            engine.update(np.zeros(pending.num_samples, dtype=np.int32))
        for search in searches:
            if not search.done:
                engine.abort(search.request_id)
    tokenizer = llm_engine.tokenizer
    outputs = []
    for search in searches:
        sequences = [
            BeamSearchSequence(
                tokens=search.prompt + gen,
                cum_logprob=cum,
                score=score,
                text=tokenizer.decode(gen, skip_special_tokens=True),
                finish_reason=reason,
            )
            for score, gen, cum, reason in search.finished
        ]
        outputs.append(BeamSearchOutput(sequences))
    return outputs


def _advance(engine, search: _Search, rows, log_probs, width, keep, eos, length_penalty) -> None:
    beams = search.beams
    vocab = log_probs.shape[-1]
    acc = torch.stack([log_probs[rows[b.seq_id]] + b.score for b in beams]).reshape(-1)
    top_scores, top_idx = torch.topk(acc, k=min(keep, acc.numel()))
    cur = len(beams[0].tokens)  # tokens generated before this step
    at_limit = cur + 1 >= search.max_tokens
    candidates = []  # (rank, parent beam, token, accumulated log-prob, ends here)
    for rank, (score, idx) in enumerate(zip(top_scores.tolist(), top_idx.tolist())):
        token = idx % vocab
        candidates.append((rank, beams[idx // vocab], token, score, at_limit or token in eos))
    # Continuations that end and rank among the first `width` become
    # hypotheses (while the search can still improve), length-penalized.
    if search.improvable:
        for rank, parent, token, score, ends in candidates:
            if ends and rank < width:
                search.finished.append(
                    (score / (cur + 1) ** length_penalty, parent.tokens + [token], score,
                     "stop" if token in eos else "length")
                )
        search.finished.sort(key=lambda f: -f[0])
        del search.finished[width:]
    running = [c for c in candidates if not c[4]][:width]
    # Engine side: beams nobody continues are finished first (their seats go
    # to forks); a beam continued by several is forked; every beam then gets
    # its chosen token in place of the provisional one.
    chosen = {parent.seq_id for _, parent, _, _, _ in running}
    for beam in beams:
        if beam.seq_id not in chosen:
            engine.finish(beam.seq_id, _C.FinishReason.ABORT)
    next_beams: list[_Beam] = []
    taken: set[int] = set()
    for _, parent, token, score, _ in running:
        seq_id = engine.fork(parent.seq_id) if parent.seq_id in taken else parent.seq_id
        taken.add(parent.seq_id)
        next_beams.append(_Beam(seq_id, parent.tokens + [token], score))
    for beam in next_beams:
        engine.set_last_token(beam.seq_id, beam.tokens[-1])
    search.beams = next_beams
    # Can the best running beam still beat the worst of `width` hypotheses?
    if search.improvable and len(search.finished) == width and next_beams:
        search.improvable = next_beams[0].score / (cur + 1) ** length_penalty > search.finished[-1][0]
    if at_limit or not next_beams or not search.improvable:
        search.done = True
        for beam in next_beams:
            engine.finish(beam.seq_id, _C.FinishReason.ABORT)
