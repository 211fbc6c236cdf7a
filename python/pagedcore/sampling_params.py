"""Sampling parameters with vLLM's names, defaults and meanings.

:class:`SamplingParams` is what a user passes to ``LLM.generate`` (and what the
server builds from an OpenAI request); :class:`BeamSearchParams` is its beam
search counterpart. Both validate every field when constructed and raise a
``ValueError`` that names the field and the offending value, so a request is
rejected before anything is admitted. The sampler itself never sees these
objects on the hot path: the model runner turns the per-request values into
tensors (see :class:`pagedcore.sampler.SamplingMetadata`).
"""

from __future__ import annotations

import logging
import math
import numbers
from dataclasses import dataclass
from typing import Any

from .structured_outputs import StructuredOutputsParams

logger = logging.getLogger(__name__)

#: Largest ``logprobs`` a request may ask for (vLLM's default ``max_logprobs``).
MAX_LOGPROBS = 20

# NOTE: vLLM's constants. A temperature below _SAMPLING_EPS is greedy; one in
# (0, _MIN_TEMPERATURE) is raised to _MIN_TEMPERATURE, because logits / T then
# overflows float32 (inf - inf = nan in the softmax).
_SAMPLING_EPS = 1e-5
_MIN_TEMPERATURE = 1e-2

# int64, as vLLM's OpenAI server allows: the runner keeps seeds in int64
# arrays, and torch.Generator.manual_seed accepts them all.
_SEED_MIN = -(2**63)
_SEED_MAX = 2**63 - 1


class ParamTypeError(TypeError, ValueError):
    """A field of the wrong type. A ``TypeError`` by nature, and a
    ``ValueError`` too, so that callers (the server, ``LLM.generate``) catch
    every invalid request with ``except ValueError``."""


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _int(name: str, value: Any) -> int:
    if not _is_int(value):
        raise ParamTypeError(
            f"{name} must be an int, got {value!r} of type {type(value).__name__}")
    return int(value)


def _float(name: str, value: Any) -> float:
    if not _is_real(value):
        raise ParamTypeError(
            f"{name} must be a number, got {value!r} of type {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}")
    return value


def _bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ParamTypeError(
            f"{name} must be a bool, got {value!r} of type {type(value).__name__}")
    return value


@dataclass(kw_only=True, slots=True)
class SamplingParams:
    """Sampling parameters for one request, as in vLLM.

    Parameters
    ----------
    n : int
        Number of output sequences for the prompt (>= 1). Greedy sampling
        (``temperature == 0``) needs ``n == 1``, as in vLLM.
    temperature : float
        Softmax temperature (>= 0). 0 means greedy (argmax). A value in
        (0, 0.01) is raised to 0.01 with a warning, as in vLLM.
    top_p : float
        Nucleus sampling: keep the smallest set of most likely tokens whose
        probability reaches ``top_p``; in (0, 1], 1 = off.
    top_k : int
        Keep the ``top_k`` most likely tokens; 0 (or vLLM's -1) = off. Stored
        as 0 when off.
    min_p : float
        Drop tokens whose probability is below ``min_p`` times the most likely
        token's; in [0, 1], 0 = off.
    seed : int or None
        Per-request seed: the request's samples then depend only on its own
        logits and this seed, whatever else is in the batch. An int64;
        -1 means None (as in vLLM).
    max_tokens : int or None
        Most output tokens per sequence (>= 1); None = up to the model's
        context (the engine layer resolves it).
    min_tokens : int
        Fewest output tokens before EOS or ``stop_token_ids`` may be sampled
        (0 <= min_tokens <= max_tokens).
    stop : str or list of str or None
        Stop strings (non-empty); normalized to a list.
    stop_token_ids : list of int or None
        Token ids that finish the sequence (>= 0); normalized to a list
        without duplicates.
    ignore_eos : bool
        Keep generating after EOS.
    logprobs : int or None
        Number of most likely tokens whose log-probabilities are returned per
        output token, in [0, 20]; the sampled token's is always returned too.
        None = no logprobs. ``True`` means 1, ``False`` None (as in vLLM).
    prompt_logprobs : int or None
        Number of most likely tokens whose log-probabilities are returned per
        prompt token (``RequestOutput.prompt_logprobs``), in [0, 20]; the
        prompt token's own is always returned too. None = none. vLLM's -1
        (the whole vocabulary) is refused. Such a request computes its whole
        prompt even when a prefix is cached (it still fills the cache).
    presence_penalty, frequency_penalty : float
        OpenAI penalties in [-2, 2] on tokens already in the output.
    repetition_penalty : float
        Multiplicative penalty (> 0) on tokens in the prompt or the output;
        1 = off.
    include_stop_str_in_output : bool
        Keep the matched stop string in the output text.
    skip_special_tokens : bool
        Drop special tokens when detokenizing.
    structured_outputs : StructuredOutputsParams or None
        Constrain the output to a JSON schema, regex, choice or grammar (see
        :mod:`pagedcore.structured_outputs`).

    Raises
    ------
    ValueError
        On any invalid field; the message names the field and the value. A
        value of the wrong type raises :class:`ParamTypeError`, which is
        both a ``ValueError`` and a ``TypeError``.

    Examples
    --------
    >>> SamplingParams(temperature=0.0, max_tokens=8).top_k
    0
    >>> SamplingParams(stop="\\n").stop
    ['\\n']
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if self.structured_outputs is not None and not isinstance(self.structured_outputs,
                                                                  StructuredOutputsParams):
            raise ParamTypeError(f"structured_outputs must be a StructuredOutputsParams, got "
                                 f"{type(self.structured_outputs).__name__}")
        self.n = _int("n", self.n)
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")

        self.temperature = _float("temperature", self.temperature)
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if 0.0 < self.temperature < _MIN_TEMPERATURE:
            logger.warning(
                "temperature %s is less than %s, which may cause numerical errors (nan or "
                "inf in tensors); raised to %s", self.temperature, _MIN_TEMPERATURE,
                _MIN_TEMPERATURE)
            self.temperature = _MIN_TEMPERATURE

        self.top_p = _float("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

        self.top_k = _int("top_k", self.top_k)
        if self.top_k < -1:
            raise ValueError(f"top_k must be 0 or -1 (off), or at least 1, got {self.top_k}")
        if self.top_k == -1:
            self.top_k = 0

        self.min_p = _float("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")

        if self.seed is not None:
            self.seed = _int("seed", self.seed)
            if not _SEED_MIN <= self.seed <= _SEED_MAX:
                raise ValueError(f"seed must be in [-2**63, 2**63 - 1], got {self.seed}")
            if self.seed == -1:
                self.seed = None

        if self.max_tokens is not None:
            self.max_tokens = _int("max_tokens", self.max_tokens)
            if self.max_tokens < 1:
                raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        self.min_tokens = _int("min_tokens", self.min_tokens)
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be at least 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be at most max_tokens={self.max_tokens}, "
                             f"got {self.min_tokens}")

        self.stop = _stop_list(self.stop)
        self.stop_token_ids = _stop_token_id_list(self.stop_token_ids)
        self.ignore_eos = _bool("ignore_eos", self.ignore_eos)

        if isinstance(self.logprobs, bool):
            self.logprobs = 1 if self.logprobs else None
        if self.logprobs is not None:
            self.logprobs = _int("logprobs", self.logprobs)
            if self.logprobs < 0:
                raise ValueError(f"logprobs must be non-negative, got {self.logprobs}")
            if self.logprobs > MAX_LOGPROBS:
                raise ValueError(f"logprobs must be at most {MAX_LOGPROBS} (max_logprobs), "
                                 f"got {self.logprobs}")

        if self.prompt_logprobs is not None:
            self.prompt_logprobs = _int("prompt_logprobs", self.prompt_logprobs)
            if self.prompt_logprobs == -1:
                raise ValueError(f"prompt_logprobs=-1 (the whole vocabulary) is not supported: "
                                 f"ask for at most {MAX_LOGPROBS} (max_logprobs)")
            if self.prompt_logprobs < 0:
                raise ValueError(f"prompt_logprobs must be non-negative, got {self.prompt_logprobs}")
            if self.prompt_logprobs > MAX_LOGPROBS:
                raise ValueError(f"prompt_logprobs must be at most {MAX_LOGPROBS} (max_logprobs), "
                                 f"got {self.prompt_logprobs}")

        self.presence_penalty = _float("presence_penalty", self.presence_penalty)
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        self.frequency_penalty = _float("frequency_penalty", self.frequency_penalty)
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(
                f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        self.repetition_penalty = _float("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0.0:
            raise ValueError(
                f"repetition_penalty must be greater than 0, got {self.repetition_penalty}")

        self.include_stop_str_in_output = _bool("include_stop_str_in_output",
                                                self.include_stop_str_in_output)
        self.skip_special_tokens = _bool("skip_special_tokens", self.skip_special_tokens)

        if self.temperature < _SAMPLING_EPS:
            # NOTE: as in vLLM, greedy ignores the truncation knobs; resetting
            # them keeps the tensors the runner builds uniform for greedy rows.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0
            if self.n > 1:
                raise ValueError(f"n must be 1 when using greedy sampling (temperature=0), "
                                 f"got {self.n}")

    @property
    def is_greedy(self) -> bool:
        """Whether the request samples by argmax (``temperature == 0``)."""
        return self.temperature < _SAMPLING_EPS

    @property
    def uses_penalties(self) -> bool:
        """Whether any of the presence/frequency/repetition penalties is on."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def output_text_buffer_length(self) -> int:
        """Characters the detokenizer holds back so that a stop string split
        across tokens is never streamed out (vLLM's name and meaning)."""
        if self.stop and not self.include_stop_str_in_output:
            return max(len(s) for s in self.stop) - 1
        return 0


def _stop_list(stop: Any) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    elif isinstance(stop, (list, tuple)):
        stop = list(stop)
    else:
        raise ParamTypeError(f"stop must be a str or a list of str, got {stop!r}")
    for s in stop:
        if not isinstance(s, str):
            raise ParamTypeError(f"stop must contain only str, got {s!r} in {stop!r}")
        if not s:
            raise ValueError(f"stop cannot contain an empty string, got {stop!r}")
    return stop


def _stop_token_id_list(ids: Any) -> list[int]:
    if ids is None:
        return []
    if not isinstance(ids, (list, tuple)):
        raise ParamTypeError(f"stop_token_ids must be a list of int, got {ids!r}")
    for t in ids:
        if not _is_int(t) or t < 0:
            raise ValueError(
                f"stop_token_ids must contain only non-negative ints, got {t!r} in {list(ids)!r}")
    return list(dict.fromkeys(int(t) for t in ids))


@dataclass(slots=True)
class BeamSearchParams:
    """Beam search parameters, as in vLLM.

    Parameters
    ----------
    beam_width : int
        Beams kept per step (>= 1).
    max_tokens : int
        Most output tokens per beam (>= 1).
    ignore_eos : bool
        Keep extending beams after EOS.
    length_penalty : float
        Exponent of the length normalization of a finished beam's score
        (``cum_logprob / generated_len ** length_penalty``, EOS counted), as in
        Hugging Face's ``num_beams`` search with ``early_stopping=False``.

    ``temperature`` and ``include_stop_str_in_output`` exist only so that
    vLLM's signature is accepted: beams are always ranked by the model's raw
    log-probabilities and a finished beam's ``tokens`` always end with its EOS,
    so only the defaults (0.0 and False) are taken; any other value raises.

    Raises
    ------
    ValueError
        On any invalid field; the message names the field and the value.

    Examples
    --------
    >>> BeamSearchParams(beam_width=4, max_tokens=32).length_penalty
    1.0
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        self.beam_width = _int("beam_width", self.beam_width)
        if self.beam_width < 1:
            raise ValueError(f"beam_width must be at least 1, got {self.beam_width}")
        self.max_tokens = _int("max_tokens", self.max_tokens)
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        self.ignore_eos = _bool("ignore_eos", self.ignore_eos)
        self.temperature = _float("temperature", self.temperature)
        if self.temperature != 0.0:
            # NOTE: vLLM hands it to the sampler of each step's candidates; here
            # beams are ranked by the model's raw log-probabilities, as in
            # transformers' beam search, so a value that would change nothing
            # is refused rather than silently ignored.
            raise ValueError(f"temperature must be 0.0 for beam search (beams are ranked by "
                             f"the raw log-probabilities), got {self.temperature}")
        self.length_penalty = _float("length_penalty", self.length_penalty)
        self.include_stop_str_in_output = _bool("include_stop_str_in_output",
                                                self.include_stop_str_in_output)
        if self.include_stop_str_in_output:
            raise ValueError("include_stop_str_in_output must be False for beam search (a "
                             "finished beam's tokens always end with its EOS), got True")
