"""Incremental detokenization with stop strings, one instance per output sequence.

The contract
------------
``text`` is what ``tokenizer.decode(output_ids, skip_special_tokens=...,
clean_up_tokenization_spaces=False)`` gives (see :func:`decode_all`), released
piece by piece as tokens arrive, with two kinds of text held back until they are
final:

* an incomplete character at the end: while a multi-byte UTF-8 character is split
  across tokens the tokenizer decodes its first bytes as U+FFFD, and so that no
  delta ever carries a U+FFFD that later turns into a real character, trailing
  U+FFFD are held until a later token shows what they are. For SentencePiece-style
  tokenizers with byte fallback (``<0xE3>`` tokens), the whole trailing run of byte
  tokens is held: their decoder turns a run into real characters only when *every*
  byte of it is valid UTF-8, so one bad byte later would turn characters already
  decoded back into U+FFFD;
* with stop strings (and ``include_stop_str_in_output=False``), the longest end of
  the text that could still become the start of a stop string, so that a match
  never has to take back text already handed out (vLLM holds back ``max stop
  length - 1`` characters for the same reason; holding only a real prefix keeps
  the latency lower).

Call :meth:`IncrementalDetokenizer.flush` when generation ends for another reason
(EOS, max_tokens, abort): it hands out what was held, after which ``text`` equals
``decode_all(tokenizer, token_ids)`` exactly.

Decoding cost
-------------
Each append decodes only a window of the last few output tokens (at most
``_MAX_WINDOW_TOKENS`` unless a character is still incomplete) and takes the text
beyond what the window had already given: O(new tokens) per append, not O(output).
When the window grows past its limit it slides so that it keeps
``_CONTEXT_TOKENS`` tokens of left context; this is vLLM's prefix_offset /
read_offset scheme, except that the prefix text is remembered instead of decoded
again at every step (one decode per step instead of two).

The prompt
----------
``decode(output_ids)`` is defined without the prompt, and some decoders treat the
first token of a decode specially: SentencePiece's "▁" decoders drop the leading
space of the first token (``decode(["▁Paris"]) == "Paris"``), WordPiece keeps the
"##" of a first continuation piece. So, by default, the window of the first output
tokens starts at the first output token, and the prompt is not used. vLLM instead
decodes the output relative to the end of the prompt and gives ``" Paris"``; pass
``prompt_as_context=True`` for that behaviour. Byte-level BPE tokenizers (GPT-2,
Llama 3, Qwen, SmolLM2) give the same text either way.
"""

from __future__ import annotations

import functools
import json
import logging
import operator
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

logger = logging.getLogger(__name__)

_REPLACEMENT_CHAR = "\ufffd"

# NOTE: the window keeps this many tokens of left context after it slides. Left
# context is what makes a token's text right: the first token of a decode loses
# its leading space under SentencePiece decoders, and a window that starts inside
# a multi-byte character decodes its first bytes as U+FFFD. Both only touch the
# first token or character, which is already released, so any context >= 1 is
# correct; 4 matches the longest UTF-8 character split into single-byte tokens.
_CONTEXT_TOKENS = 4
# The window slides once it holds more than this many tokens: about one extra
# small decode every (_MAX_WINDOW_TOKENS - _CONTEXT_TOKENS) steps.
_MAX_WINDOW_TOKENS = 16
# prompt_as_context: the prompt suffix lengths tried, shortest first (vLLM: 4..23).
_PROMPT_CONTEXT_LENGTHS = range(4, 17)


class _TokenizerFacts:
    """What the detokenizer needs to know about a tokenizer, computed once."""

    __slots__ = ("backend", "byte_values", "special_ids", "tokenizer")

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        # A transformers "fast" tokenizer wraps a tokenizers.Tokenizer; decoding with
        # it directly is what tokenizer.decode does (minus clean-up), at a third of
        # the cost. A bare tokenizers.Tokenizer works too.
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None and hasattr(tokenizer, "get_added_tokens_decoder") and hasattr(tokenizer, "token_to_id"):
            backend = tokenizer
        self.backend = backend
        if backend is not None:
            added = backend.get_added_tokens_decoder()
            self.special_ids = frozenset(i for i, tok in added.items() if tok.special)
            self.byte_values = _byte_fallback_values(backend)
        else:
            self.special_ids = frozenset(getattr(tokenizer, "all_special_ids", ()))
            self.byte_values = None

    def decoder(self, skip_special_tokens: bool, spaces_between_special_tokens: bool) -> Callable[[list[int]], str]:
        backend = self.backend
        if backend is not None:
            # spaces_between_special_tokens: transformers ignores it for tokenizers
            # backed by the Rust library too, so decode() stays the reference.
            return functools.partial(backend.decode, skip_special_tokens=skip_special_tokens)
        tokenizer = self.tokenizer
        return lambda ids: tokenizer.decode(
            ids,
            skip_special_tokens=skip_special_tokens,
            spaces_between_special_tokens=spaces_between_special_tokens,
            clean_up_tokenization_spaces=False,
        )


def _byte_fallback_values(backend: Any) -> dict[int, int] | None:
    """``{token id: byte}`` of the ``<0xNN>`` tokens when the decoder has ByteFallback."""
    decoder = backend.decoder
    try:
        state = json.loads(decoder.__getstate__()) if decoder is not None else None
    except Exception:  # noqa: BLE001  (a custom Python decoder raises a bare Exception)
        return None

    def has_byte_fallback(node: Any) -> bool:
        if isinstance(node, dict):
            return node.get("type") == "ByteFallback" or any(map(has_byte_fallback, node.values()))
        if isinstance(node, list):
            return any(map(has_byte_fallback, node))
        return False

    if not has_byte_fallback(state):
        return None
    values = {}
    for byte in range(256):
        token_id = backend.token_to_id(f"<0x{byte:02X}>")
        if token_id is not None:
            values[token_id] = byte
    return values or None


_FACTS_CACHE: weakref.WeakKeyDictionary[Any, _TokenizerFacts] = weakref.WeakKeyDictionary()


def _tokenizer_facts(tokenizer: Any) -> _TokenizerFacts:
    # NOTE: one detokenizer is built per request; the facts (added tokens, byte
    # tokens) cost ~0.1 ms, so they are cached per tokenizer object.
    try:
        facts = _FACTS_CACHE.get(tokenizer)
    except TypeError:  # unhashable tokenizer
        return _TokenizerFacts(tokenizer)
    if facts is None:
        facts = _TokenizerFacts(tokenizer)
        try:
            _FACTS_CACHE[tokenizer] = facts
        except TypeError:  # not weak-referenceable
            pass
    return facts


def _as_token_ids(values: Iterable[int], what: str) -> list[int]:
    try:
        ids = [operator.index(v) for v in values]
    except TypeError:
        raise TypeError(f"{what} must be a sequence of ints, got {values!r}") from None
    if ids and min(ids) < 0:
        raise ValueError(f"{what} must be non-negative token ids, got {min(ids)}")
    return ids


def decode_all(
    tokenizer: Any,
    token_ids: Sequence[int],
    skip_special_tokens: bool = True,
    spaces_between_special_tokens: bool = True,
) -> str:
    """Decode a whole sequence the way :class:`IncrementalDetokenizer` does piece by piece.

    Parameters
    ----------
    tokenizer : transformers tokenizer or tokenizers.Tokenizer
        The model's tokenizer.
    token_ids : sequence of int, shape [num_tokens]
        The ids to decode.
    skip_special_tokens : bool, default True
        Leave out special tokens (vLLM's default).
    spaces_between_special_tokens : bool, default True
        Passed on to slow (pure Python) tokenizers; tokenizers backed by the Rust
        library ignore it, as their ``decode`` does.

    Returns
    -------
    str
        ``tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens,
        clean_up_tokenization_spaces=False)``. Without clean-up because clean-up
        rewrites text across token boundaries (``" ." -> "."``) and so cannot be
        streamed; transformers skips it for BPE tokenizers anyway.

    Examples
    --------
    >>> decode_all(tokenizer, [19556, 905])          # SmolLM2
    'Hello world'
    """
    ids = _as_token_ids(token_ids, "token_ids")
    facts = _tokenizer_facts(tokenizer)
    return facts.decoder(skip_special_tokens, spaces_between_special_tokens)(ids)


class IncrementalDetokenizer:
    """Turns a sequence's output tokens into text deltas and applies stop strings.

    Parameters
    ----------
    tokenizer : transformers tokenizer or tokenizers.Tokenizer
        The model's tokenizer. Only read; may be shared by many detokenizers.
    prompt_token_ids : sequence of int, shape [num_prompt_tokens]
        The prompt. Read only with ``prompt_as_context=True``.
    skip_special_tokens : bool, default True
        Leave special tokens out of the text.
    spaces_between_special_tokens : bool, default True
        As in :func:`decode_all` (only slow tokenizers honour it).
    stop : str or list of str, optional
        Stop strings. Generation stops at the first one to be completed in the
        text (the match that ends earliest; among matches that end at the same
        character, the one that starts earliest), also across token boundaries
        and inside multi-byte characters.
    include_stop_str_in_output : bool, default False
        Keep the matched stop string at the end of ``text`` (else ``text`` ends
        right before it).
    prompt_as_context : bool, default False
        Decode the first output tokens relative to the end of the prompt, as vLLM
        does (SentencePiece: ``" Paris"`` instead of ``decode(output_ids) ==
        "Paris"``). Off by default so that ``text`` equals :func:`decode_all` of the
        output ids. If no suffix of the prompt decodes cleanly (a split character at
        its end), the prompt is not used.

    Raises
    ------
    TypeError
        ``stop`` is not a string or a list of strings, or the prompt is not ints.
    ValueError
        A stop string is empty.

    Notes
    -----
    Held-back text (see the module docstring) is released by a later append or by
    :meth:`flush`. Until then ``text`` is a prefix of ``decode_all(tokenizer,
    token_ids)`` that lacks at most an incomplete character (or run of byte-fallback
    tokens) and, with stop strings, a possible start of a stop string.

    Examples
    --------
    >>> detok = IncrementalDetokenizer(tokenizer, prompt_ids, stop=["\\n\\n"])
    >>> for token_id in sampled:                   # one token per engine step
    ...     delta, stop_str = detok.append([token_id])
    ...     stream(delta)
    ...     if stop_str is not None:               # finish the sequence in the engine
    ...         break
    >>> if not detok.finished:                     # ended by EOS or max_tokens
    ...     stream(detok.flush())
    >>> detok.text, detok.token_ids, detok.stop_reason
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        stop: str | Sequence[str] | None = None,
        include_stop_str_in_output: bool = False,
        prompt_as_context: bool = False,
    ) -> None:
        self._stop = _check_stop(stop)
        facts = _tokenizer_facts(tokenizer)
        self._decode = facts.decoder(skip_special_tokens, spaces_between_special_tokens)
        self._byte_values = facts.byte_values
        # Ids that decode() leaves out: they do not break a run of byte tokens.
        self._skipped_ids = facts.special_ids if skip_special_tokens else frozenset()

        self._token_ids: list[int] = []
        # The decode window: the last few tokens (and, at first, prompt context).
        # NOTE: _window_text is always a prefix of decode(_window) and is exactly the
        # part of it already passed on to the text level; everything decoded beyond
        # it is new or held.
        self._window: list[int] = []
        self._window_text = ""
        if prompt_as_context:
            self._prime_with_prompt(_as_token_ids(prompt_token_ids, "prompt_token_ids"))
        self._warned_unstable = False

        # Text level. _chunks joined is `text`; _pending is text released by the
        # window but held because it could be the start of a stop string.
        self._chunks: list[str] = []
        self._text_cache: str | None = ""
        self._pending = ""
        self._include_stop = include_stop_str_in_output
        # _tail: the last (max stop length - 1) characters of the released text, the
        # only old text a new match can start in.
        self._tail = ""
        self._tail_len = max((len(s) for s in self._stop), default=1) - 1
        # Characters that can end a proper prefix of a stop string: text ending in
        # any other character holds nothing back (the common case, checked in O(1)).
        self._prefix_end_chars = frozenset(s[k] for s in self._stop for k in range(len(s) - 1))
        self._stop_reason: str | None = None
        self._flushed = False

    # ------------------------------------------------------------------ public

    @property
    def text(self) -> str:
        """All output text handed out so far: the concatenation of every delta.

        Truncated at a matched stop string. Otherwise ``decode_all(tokenizer,
        token_ids)`` minus the text still held back (see the module docstring);
        exactly that after :meth:`flush`.
        """
        if self._text_cache is None:
            self._text_cache = "".join(self._chunks)
            self._chunks = [self._text_cache]
        return self._text_cache

    @property
    def token_ids(self) -> list[int]:
        """All output token ids appended so far (a copy, O(num tokens)).

        After a stop string matched, this ends with the token that completed it;
        tokens passed in the same :meth:`append` call after that one are dropped.
        """
        return list(self._token_ids)

    @property
    def finished(self) -> bool:
        """Whether a stop string matched; further appends raise RuntimeError."""
        return self._stop_reason is not None

    @property
    def stop_reason(self) -> str | None:
        """The stop string that matched, or None."""
        return self._stop_reason

    def append(self, new_token_ids: Sequence[int], check_stop: bool = True) -> tuple[str, str | None]:
        """Take the output tokens just generated; return the new text.

        Parameters
        ----------
        new_token_ids : sequence of int, shape [num_new_tokens]
            Usually one token, several with speculative or multi-step decoding.
        check_stop : bool, default True
            False: these tokens' text completes no stop string (vLLM's rule before
            ``min_tokens`` outputs). A possible start of one is still held back, so
            a match completed by later tokens can still cut there.

        Returns
        -------
        delta : str
            Text that became final with these tokens (may be empty). Deltas never
            take anything back: their concatenation is ``text``.
        stop_str : str or None
            The stop string completed by these tokens, else None. When not None the
            sequence is finished: ``text`` is truncated at the match, ``token_ids``
            ends with the token that completed it, and tokens after that one in
            ``new_token_ids`` are ignored.

        Raises
        ------
        RuntimeError
            A stop string already matched, or :meth:`flush` was called.
        TypeError, ValueError
            ``new_token_ids`` is not a sequence of non-negative ints.
        """
        if self._stop_reason is not None:
            raise RuntimeError(f"append() after the stop string {self._stop_reason!r} finished the sequence")
        if self._flushed:
            raise RuntimeError("append() after flush() ended the sequence")
        ids = _as_token_ids(new_token_ids, "new_token_ids")
        if not ids:
            return "", None
        if len(ids) == 1 or not self._stop or not check_stop:
            return self._append(ids, check_stop)
        # NOTE: with stop strings, several tokens go in one at a time, so that the
        # result (which token completed the match, which match ended first) does not
        # depend on how the engine grouped tokens into steps.
        deltas = []
        for token_id in ids:
            delta, stop_str = self._append([token_id])
            deltas.append(delta)
            if stop_str is not None:
                return "".join(deltas), stop_str
        return "".join(deltas), None

    def flush(self) -> str:
        """End the sequence and hand out the text held back.

        Call it when generation ends other than by a stop string (EOS, stop token,
        max_tokens, abort). Afterwards ``text == decode_all(tokenizer, token_ids)``
        (an incomplete character at the end stays U+FFFD, as decode gives it) and
        :meth:`append` raises RuntimeError. Calling it again, or after a stop string
        matched, returns "".

        Returns
        -------
        str
            The last delta. Stop strings are checked on it too (they could match
            only if they contain U+FFFD); ``finished`` tells.
        """
        if self._flushed or self._stop_reason is not None:
            self._flushed = True
            return ""
        self._flushed = True
        new, _ = self._decode_new([], final=True)
        delta, _ = self._release(new, "", final=True)
        return delta

    # ------------------------------------------------------------ window level

    def _append(self, ids: list[int], check_stop: bool = True) -> tuple[str, str | None]:
        self._token_ids.extend(ids)
        new, provisional = self._decode_new(ids, final=False)
        delta, stop_str = self._release(new, provisional, final=False, check_stop=check_stop)
        if stop_str is not None:
            self._stop_reason = stop_str
        return delta, stop_str

    def _decode_new(self, ids: list[int], final: bool) -> tuple[str, str]:
        """Decode the window with `ids` appended.

        Returns (new, provisional): `new` is text that is final; `provisional` the
        decoded text of a trailing run of byte-fallback tokens that is valid UTF-8
        now but could still be invalidated by a later byte (stop strings are
        matched on it, nothing else). Incomplete characters are in neither.
        """
        window = self._window
        window.extend(ids)
        full = self._decode(window)
        done = len(self._window_text)
        if not self._warned_unstable and not full.startswith(self._window_text):
            self._warned_unstable = True
            logger.warning(
                "the tokenizer's decode is not prefix-stable (%r then %r); the streamed "
                "text may differ from tokenizer.decode(output_ids)",
                self._window_text,
                full,
            )
        if final:
            self._window_text = full
            return full[done:], ""
        held_from = provisional_to = len(full)
        run = self._trailing_byte_run(window) if self._byte_values is not None else b""
        if run:
            try:
                num_chars, valid = len(run.decode("utf-8")), True
            except UnicodeDecodeError:
                num_chars, valid = len(run), False  # one U+FFFD per byte
            # max(): a Strip decoder may have eaten a leading space of the run.
            held_from = max(done, len(full) - num_chars)
            provisional_to = len(full) if valid else held_from
        elif full.endswith(_REPLACEMENT_CHAR):
            held_from = provisional_to = max(done, len(full.rstrip(_REPLACEMENT_CHAR)))
        self._window_text = full[:held_from]
        if held_from == len(full) and len(window) > _MAX_WINDOW_TOKENS:
            self._slide()
        return full[done:held_from], full[held_from:provisional_to]

    def _trailing_byte_run(self, ids: list[int]) -> bytes:
        """Bytes of the ``<0xNN>`` tokens at the end of `ids` (skipped ids ignored)."""
        values, skipped = self._byte_values, self._skipped_ids
        run = []
        for token_id in reversed(ids):
            value = values.get(token_id)
            if value is None:
                if token_id in skipped:  # decode() drops it: the run goes on
                    continue
                break
            run.append(value)
        return bytes(reversed(run))

    def _slide(self) -> None:
        """Drop the window's oldest tokens, keeping _CONTEXT_TOKENS of context.

        Call only when nothing of the window is held (its last character is final).
        """
        window = self._window
        start = len(window) - _CONTEXT_TOKENS
        text = self._decode(window[start:])
        # NOTE: the new window must decode to some text. SentencePiece decoders strip
        # the leading space of the first token that decode() keeps; in a window of
        # skipped special tokens only, that would be the next output token, whose
        # space is real. Text in the window means the first kept token is in it.
        if not text or text.endswith(_REPLACEMENT_CHAR):
            return  # try again at the next step
        del window[:start]
        self._window_text = text

    def _prime_with_prompt(self, prompt: list[int]) -> None:
        """Start the window with a suffix of the prompt that decodes cleanly."""
        # NOTE: the suffix must decode to final text (no U+FFFD, no open run of byte
        # tokens), else the first output tokens could change text of the prompt, and
        # to some text at all (see _slide).
        lengths = sorted({min(length, len(prompt)) for length in _PROMPT_CONTEXT_LENGTHS} - {0})
        for length in lengths:
            suffix = prompt[-length:]
            if self._byte_values is not None and self._trailing_byte_run(suffix):
                continue
            text = self._decode(suffix)
            if text and _REPLACEMENT_CHAR not in text:
                self._window = suffix
                self._window_text = text
                return

    # -------------------------------------------------------------- text level

    def _release(self, new: str, provisional: str, final: bool, check_stop: bool = True) -> tuple[str, str | None]:
        """Apply stop strings to text the window released; return (delta, stop)."""
        if not self._stop or not (new or provisional or final):
            self._emit(new)
            return new, None
        tail = self._tail
        buf = tail + new + provisional
        match = self._find_stop(buf, len(tail)) if check_stop else None
        if match is not None:
            stop_str, start = match
            cut = start + len(stop_str) if self._include_stop else start
            # NOTE: _pending is a suffix of _tail, so `visible` is a suffix of buf. The
            # hold-back guarantees that the cut falls inside `visible`: a match starts
            # at most len(_pending) characters back in the old text.
            visible = self._pending + new + provisional
            keep = len(visible) - (len(buf) - cut)
            if keep < 0:
                raise RuntimeError(
                    f"internal error: stop string {stop_str!r} matched inside text already "
                    f"handed out (buffer {buf!r}, pending {self._pending!r})"
                )
            self._pending = ""
            self._emit(visible[:keep])
            return visible[:keep], stop_str
        if new and self._tail_len:
            self._tail = (tail + new)[-self._tail_len :]
        visible = self._pending + new
        hold = 0 if final or self._include_stop else self._stop_prefix_len(visible)
        # With include_stop_str_in_output the text ends after the match, which ends
        # in new text: nothing handed out can be cut, so nothing is held.
        delta = visible[: len(visible) - hold]
        self._pending = visible[len(visible) - hold :]
        self._emit(delta)
        return delta, None

    def _emit(self, delta: str) -> None:
        if delta:
            self._chunks.append(delta)
            self._text_cache = None

    def _find_stop(self, buf: str, tail_len: int) -> tuple[str, int] | None:
        """The stop string that ends earliest in `buf` after position `tail_len`.

        Matches that end inside the old tail were searched before. Ties on the end
        go to the earlier start (the longer string).
        """
        best: tuple[str, int] | None = None
        best_end = best_start = 0
        for stop_str in self._stop:
            start = buf.find(stop_str, max(0, tail_len - len(stop_str) + 1))
            if start < 0:
                continue
            end = start + len(stop_str)
            if best is None or end < best_end or (end == best_end and start < best_start):
                best, best_end, best_start = (stop_str, start), end, start
        return best

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest end of `text` that is a proper prefix of a stop string."""
        if not text or text[-1] not in self._prefix_end_chars:
            return 0
        longest = 0
        for stop_str in self._stop:
            for length in range(min(len(stop_str) - 1, len(text)), longest, -1):
                if text.endswith(stop_str[:length]):
                    longest = length
                    break
        return longest


def _check_stop(stop: str | Sequence[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    try:
        stop = tuple(stop)
    except TypeError:
        raise TypeError(f"stop must be a string or a list of strings, got {stop!r}") from None
    for stop_str in stop:
        if not isinstance(stop_str, str):
            raise TypeError(f"stop strings must be str, got {stop_str!r}")
        if not stop_str:
            raise ValueError(f"stop strings must not be empty, got {list(stop)!r}")
    return stop
