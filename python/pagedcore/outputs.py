"""What ``LLM.generate`` returns, with vLLM's names and meanings."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """The log-probability of one token, its rank (1 = most likely) and text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per generated token: token id -> Logprob (the sampled token and the top-k).
SampleLogprobs = list[dict[int, Logprob]]
# One entry per prompt token: None for the first (nothing comes before it), then a
# dict token id -> Logprob holding that prompt token and the top-k.
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    """One of the ``n`` completions of a request.

    ``finish_reason`` is ``"stop"`` (EOS, a stop token or a stop string),
    ``"length"`` (max_tokens or the context length) or ``"abort"``; ``None``
    while running. ``stop_reason`` is the stop token id or stop string that
    ended it, ``None`` for EOS or when it did not stop.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The result of one prompt: its completions in index order.

    ``prompt_logprobs`` is None unless ``SamplingParams.prompt_logprobs`` was
    set; then it has one entry per prompt token (see :data:`PromptLogprobs`),
    raw log-probabilities (log-softmax of the model's logits) in float32. A
    streamed request gets them once, with its first output after the prompt
    was computed.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: dict[str, float] = field(default_factory=dict)
    prompt_logprobs: PromptLogprobs | None = None
