"""Structured outputs (``SamplingParams(structured_outputs=StructuredOutputsParams(...))``)
with async output processing on, and with async scheduling both off and on (on is the
GPU's default: step n+1's forward pass is launched before step n's tokens advance the
matchers, and only its sampling waits for them); every output is checked by an
independent validator (pydantic for JSON schemas, Python's ``re`` for regexes,
membership for choices), and async scheduling gives the same outputs as without.

The real default model shows a JSON schema holding on SmolLM2 (its own whitespace).
Everything else runs on a tiny random Llama with SmolLM2's tokenizer (loads in a
fraction of a second): its near-uniform next-token distribution writes garbage unless
the mask holds, so every valid output is the constraint's doing. Its JSON schema
bounds every field (name <= 8 characters, age 0..120) and its JSON turns off free
whitespace, so a constrained output ends well within max_tokens.

The masks' machinery (the pool's lanes, the computation in the background, the
device's wait for it) runs on an even smaller model with a byte-level tokenizer of
its own (no default model, no pydantic: the GPU machine has neither), checked
against the regex module's partial matches.

The tiny model's tests run twice: with llguidance's PyO3 matchers
(``PAGEDCORE_GRAMMAR_WORKER=pyo3``, which the other tests here ask for) and with the C++
grammar worker (``=cpp``, the default where llguidance has its shared library), which must
also free every matcher it made once its sequence is done (generate checks none is left)."""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("llguidance")

try:
    import pydantic
except ImportError:  # (the GPU machine has none unless .gpuwheels is carried)
    pydantic = None
import numpy as np  # noqa: E402
import torch  # noqa: E402

import pagedcore  # noqa: E402
from pagedcore import LLM, SamplingParams  # noqa: E402
from pagedcore.structured_outputs import (  # noqa: E402
    GRAMMAR_WORKER_ENV, StructuredOutputManager, StructuredOutputsParams)

needs_pydantic = pytest.mark.skipif(pydantic is None, reason="needs pydantic")

if pydantic is not None:
    class Person(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="forbid")
        name: str = pydantic.Field(max_length=8)
        age: int

    class BoundedPerson(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="forbid")
        name: str = pydantic.Field(max_length=8)
        age: int = pydantic.Field(ge=0, le=120)

    SCHEMA = Person.model_json_schema()
    BOUNDED = BoundedPerson.model_json_schema()
REGEX = r"[0-9]{3}-[a-z]{2,4}"
CHOICES = ["red", "green", "blue"]


def bounded_json(**kw) -> StructuredOutputsParams:
    return StructuredOutputsParams(json=BOUNDED, disable_any_whitespace=True, **kw)


@pytest.fixture(scope="module")
def smollm2() -> LLM:
    # (async scheduling: the GPU's default; the tiny model's tests run both modes)
    return LLM(model=pagedcore.default_model_path(), num_kv_blocks=64, max_model_len=256, max_num_seqs=4,
               async_output_proc=True, async_scheduling=True)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    """SmolLM2's config shrunk to 2 layers of hidden size 64 (its 49152-token vocabulary
    kept), random weights written directly: no transformers model or tokenizer to build."""
    from safetensors.torch import save_file

    tokenizer_dir = pagedcore.default_model_path()
    config = json.loads((Path(tokenizer_dir) / "config.json").read_text())
    config.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=32, max_position_embeddings=512)
    hidden, inter, vocab = 64, 128, config["vocab_size"]
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": None}
    for i in range(2):
        for name, shape in (("self_attn.q_proj", (64, hidden)), ("self_attn.k_proj", (32, hidden)),
                            ("self_attn.v_proj", (32, hidden)), ("self_attn.o_proj", (hidden, 64)),
                            ("mlp.gate_proj", (inter, hidden)), ("mlp.up_proj", (inter, hidden)),
                            ("mlp.down_proj", (hidden, inter)), ("input_layernorm", None),
                            ("post_attention_layernorm", None)):
            shapes[f"model.layers.{i}.{name}.weight"] = shape
    gen = torch.Generator().manual_seed(0)
    weights = {name: torch.ones(hidden) if shape is None else torch.randn(shape, generator=gen) * 0.02
               for name, shape in shapes.items()}
    path = Path(tmp_path_factory.mktemp("tiny"))
    (path / "config.json").write_text(json.dumps(config))
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return str(path)


def tiny_pair(path: str, **kw) -> dict[bool, LLM]:
    """The tiny model, one engine per async-scheduling mode (off, on)."""
    return {mode: LLM(model=path, tokenizer=pagedcore.default_model_path(), async_output_proc=True,
                      async_scheduling=mode, **kw) for mode in (False, True)}


@pytest.fixture(scope="module", params=["pyo3", "cpp"])
def grammar_way(request):
    """The grammar worker's way ($PAGEDCORE_GRAMMAR_WORKER) while the module's tests of
    that way run (engines read it when their first constrained request comes)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(GRAMMAR_WORKER_ENV, request.param)
        yield request.param


@pytest.fixture(scope="module")
def tiny_llms(tiny_dir, grammar_way) -> dict[bool, LLM]:
    return tiny_pair(tiny_dir, num_kv_blocks=128, max_model_len=256, max_num_seqs=16)


@pytest.fixture(autouse=True)
def _default_grammar_way(request, monkeypatch):
    """Tests outside the two ways' runs use the PyO3 way, whichever run is live: they
    test its own machinery (the mask pool's lanes, the mask ways' trials, the device's
    wait written from Python), which the C++ worker, the default where llguidance's
    shared library is there, does not use."""
    if "grammar_way" not in request.fixturenames:
        monkeypatch.setenv(GRAMMAR_WORKER_ENV, "pyo3")


def live_worker_matchers(llm: LLM) -> int | None:
    """The C++ worker's matchers not yet freed (templates aside); None without it."""
    manager = llm.llm_engine._structured
    return None if manager is None or manager.worker is None else manager.live_matchers()


def summary(outs) -> list:
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outs]


def generate(tiny_llms: dict[bool, LLM], prompts, params) -> list:
    """Runs on both engines: the same outputs, every block free after; returns them."""
    runs = {}
    for mode, llm in tiny_llms.items():
        runs[mode] = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.stats()
        assert not llm.llm_engine.has_unfinished_requests()
        assert stats["num_requests"] == 0 and stats["num_free_blocks"] == stats["num_blocks"], stats
        assert live_worker_matchers(llm) in (None, 0)
    assert summary(runs[True]) == summary(runs[False])
    return runs[True]


@needs_pydantic
def test_json_schema_holds_on_smollm2(smollm2: LLM) -> None:
    # Two samples, the model's own whitespace (the string form of a schema: tiny below).
    params = SamplingParams(temperature=0.9, n=2, seed=7, max_tokens=40,
                            structured_outputs=StructuredOutputsParams(json=SCHEMA))
    [out] = smollm2.generate(["Describe a person as JSON."], params, use_tqdm=False)
    for c in out.outputs:
        assert c.finish_reason == "stop", c
        Person.model_validate_json(c.text)  # raises if invalid
        assert list(json.loads(c.text)) == ["name", "age"]  # the schema's order


@needs_pydantic
def test_json_regex_choice_grammar_in_one_batch(tiny_llms) -> None:
    specs = [
        bounded_json(),
        StructuredOutputsParams(json=json.dumps(BOUNDED), disable_any_whitespace=True),
        StructuredOutputsParams(regex=REGEX),
        StructuredOutputsParams(choice=CHOICES),
        StructuredOutputsParams(grammar='start: "yes" | "no" | "maybe"'),
        StructuredOutputsParams(json_object=True, disable_any_whitespace=True),
        None,  # an unconstrained request in the same batch
    ]
    prompts = ["Describe a person as JSON.", "Write a JSON object about a person.",
               "An order code:", "Your favourite colour?", "Answer:", '{"a": 1, "b": 2} is JSON. Another:',
               "The sky is"]
    # Enough tokens for the bounded JSON (at most ~12 here); json_object is cut at 12.
    params = [SamplingParams(temperature=0.9, n=3 if s is not None and s.regex else 2, seed=7 + i,
                             max_tokens=(12 if s.json_object else 24) if s else 4, structured_outputs=s)
              for i, s in enumerate(specs)]
    outs = generate(tiny_llms, prompts, params)
    for out in outs[:2]:
        for c in out.outputs:
            assert c.finish_reason == "stop", c
            BoundedPerson.model_validate_json(c.text)  # raises if invalid
            assert list(json.loads(c.text)) == ["name", "age"]  # the schema's order
            assert " " not in c.text.replace(json.loads(c.text)["name"], "")  # no free whitespace
    for c in outs[2].outputs:
        assert c.finish_reason == "stop" and re.fullmatch(REGEX, c.text), c
    # n = 3 samples draw independently (their own matchers): not all alike.
    assert len({c.text for c in outs[2].outputs}) > 1
    for c in outs[3].outputs:
        assert c.finish_reason == "stop" and c.text in CHOICES, c
    for c in outs[4].outputs:
        assert c.finish_reason == "stop" and c.text in ("yes", "no", "maybe"), c
    for c in outs[5].outputs:  # any JSON object, or cut by max_tokens
        assert c.finish_reason == "length" or isinstance(json.loads(c.text), dict), c
    # Unconstrained, the same model writes no such thing.
    assert all(c.finish_reason == "length" for c in outs[6].outputs)


def test_a_completed_grammar_ends_on_its_own_last_token(tiny_llms) -> None:
    """A grammar that admits nothing more after a token (a choice, a fixed-length regex)
    finishes its sequence with "stop" on that token: no EOS sampled after it, the token
    ids are exactly the text's (the tokenizer decodes them to it), and the engine frees
    the sequence (generate checks every block free)."""
    tokenizer = tiny_llms[True].llm_engine.tokenizer
    eos = set(tiny_llms[True].llm_engine.eos_token_ids)
    specs = [StructuredOutputsParams(regex="[0-9]{3}"), StructuredOutputsParams(choice=CHOICES)]
    params = [SamplingParams(temperature=0.9, n=2, seed=3 + i, max_tokens=24, structured_outputs=s)
              for i, s in enumerate(specs)]
    outs = generate(tiny_llms, ["A number:", "A colour:"], params)
    for out, ok in zip(outs, (lambda t: re.fullmatch("[0-9]{3}", t), lambda t: t in CHOICES)):
        for c in out.outputs:
            assert c.finish_reason == "stop" and c.stop_reason is None and ok(c.text), c
            assert not eos & set(c.token_ids), c
            assert tokenizer.decode(c.token_ids) == c.text, c


def test_a_finished_sample_leaves_no_live_matcher(tiny_llms) -> None:
    """After every step, a matcher the engine still feeds (``_matchers``) belongs to an
    unfinished sample: one that a stop string, max_tokens or its grammar ended gives its
    matcher up at once, while its siblings (n = 4) go on (the engine feeds a live
    matcher every token of its sequence without looking at the sample again)."""
    params = SamplingParams(temperature=1.0, n=4, seed=21, max_tokens=7, stop=["1"],
                            structured_outputs=StructuredOutputsParams(regex="[0-9]{3}-[a-z]{2,9}"))
    for llm in tiny_llms.values():
        engine = llm.llm_engine
        engine.add_request("mixed", "An order code:", None, params)
        mixed = False
        while engine.has_unfinished_requests():
            engine.step()
            live = [engine._seq_owner[seq_id] for seq_id in engine._matchers]
            assert all(request.completions[i].finish_reason is None for request, i in live), live
            assert live_worker_matchers(llm) in (None, len(engine._matchers))  # (the worker's freed)
            request = engine._requests.get("mixed")
            if request is not None:
                reasons = [c.finish_reason for c in request.completions]
                mixed |= None in reasons and any(r is not None for r in reasons)
        assert mixed  # (some sample ended while others went on)
        assert not engine._matchers


class _RefusingEngine:
    """The C++ engine, except that it refuses every request (admission failing after
    the matchers were made)."""

    def __init__(self, engine) -> None:
        self._engine = engine

    def add_request(self, *args):
        raise RuntimeError("refused")

    def __getattr__(self, name):
        return getattr(self._engine, name)


def test_a_request_refused_by_the_engine_leaves_no_matcher(tiny_llms, monkeypatch) -> None:
    llm = tiny_llms[True]
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.9, seed=2, n=3, max_tokens=4,
                            structured_outputs=StructuredOutputsParams(choice=CHOICES))
    with monkeypatch.context() as mp:
        mp.setattr(engine, "engine", _RefusingEngine(engine.engine))
        with pytest.raises(RuntimeError, match="refused"):
            engine.add_request("refused", "A colour:", None, params)
    assert not engine.has_request("refused") and not engine._matchers
    assert live_worker_matchers(llm) in (None, 0)
    [out] = llm.generate(["A colour:"], params, use_tqdm=False)  # (the engine goes on)
    assert all(c.text in CHOICES for c in out.outputs)


@needs_pydantic
def test_stop_strings_end_constrained_outputs(tiny_llms) -> None:
    # A stop string still ends a constrained output (where the user asked).
    cut = generate(tiny_llms, ["Describe a person as JSON."], SamplingParams(
        temperature=0, max_tokens=24, stop=['"age"'], structured_outputs=bounded_json()))[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == '"age"' and '"age"' not in cut.text
    assert cut.text.startswith('{"name":"')


@needs_pydantic
def test_schema_cut_by_max_tokens_finishes_with_length(tiny_llms) -> None:
    out = generate(tiny_llms, ["Describe a person as JSON."], SamplingParams(
        temperature=0.8, seed=1, n=2, max_tokens=4, structured_outputs=bounded_json()))[0]
    for c in out.outputs:
        assert c.finish_reason == "length" and len(c.token_ids) == 4
        with pytest.raises(pydantic.ValidationError):
            BoundedPerson.model_validate_json(c.text)


@needs_pydantic
def test_streaming_deltas_concatenate_to_valid_json(tiny_llms) -> None:
    # Beside it, a constrained request aborted mid-run (with async scheduling, while the
    # next step's forward pass is launched and holds its row).
    texts = {}
    for mode, llm in tiny_llms.items():
        engine = llm.llm_engine
        engine.add_request("so-stream", "Describe a person as JSON.", None, SamplingParams(
            temperature=0.7, seed=3, max_tokens=24, structured_outputs=bounded_json()), stream=True)
        engine.add_request("so-aborted", "Another person as JSON.", None, SamplingParams(
            temperature=0.7, seed=4, max_tokens=24, structured_outputs=bounded_json()))
        text, reasons, deltas, steps, aborted = "", [], 0, 0, None
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id == "so-stream":
                    text += out.outputs[0].text if out.outputs else ""
                    deltas += 1
                    reasons += [c.finish_reason for c in out.outputs if c.finish_reason]
            steps += 1
            if steps == 4:
                aborted = engine.abort("so-aborted")
                assert llm.stats()["num_requests"] == 1  # the engine dropped it at once
        assert reasons == ["stop"] and deltas > 3
        assert aborted is not None and aborted.outputs[0].finish_reason == "abort"
        BoundedPerson.model_validate_json(text)
        stats = llm.stats()
        assert stats["num_requests"] == 0 and stats["num_free_blocks"] == stats["num_blocks"], stats
        assert live_worker_matchers(llm) in (None, 0)  # (the aborted request's matcher too)
        texts[mode] = text
    assert texts[True] == texts[False]


@needs_pydantic
def test_constrained_sequences_waiting_and_preempted(tiny_dir, grammar_way) -> None:
    # Two running at a time: two unconstrained requests first, while the constrained
    # ones wait (their matchers live, outside the batch: those steps do not wait for
    # the previous step's tokens before sampling), then a constrained one beside the
    # longer unconstrained one (a mixed batch), then the other constrained one. 5 blocks
    # of 16 for two sequences of 27-token prompts growing past 32 tokens: a preemption.
    llms = tiny_pair(tiny_dir, num_kv_blocks=5, max_model_len=80, max_num_seqs=2)
    prompts = [f"Person {i}: a long preamble comes first, so that the prompt fills most of two blocks of "
               "sixteen tokens, then JSON:" for i in range(4)]
    params = [SamplingParams(temperature=0.9, seed=30 + i, max_tokens=n, ignore_eos=True) for i, n in enumerate((4, 10))]
    params += [SamplingParams(temperature=0.9, seed=20 + i, max_tokens=24, structured_outputs=bounded_json())
               for i in range(2)]
    outs = generate(llms, prompts, params)
    assert all(llm.stats()["num_recompute_preemptions"] > 0 for llm in llms.values())
    for out in outs[2:]:
        c = out.outputs[0]
        assert c.finish_reason == "stop", c
        BoundedPerson.model_validate_json(c.text)


@needs_pydantic
def test_the_cpp_worker_gives_the_pyo3_ways_outputs(tiny_dir, monkeypatch) -> None:
    """Greedy (and seeded) constrained requests of every kind, n > 1, on an engine with
    the C++ grammar worker and on one with the PyO3 matchers: the same tokens, texts and
    finish reasons (the masks are llguidance's either way), each output valid."""
    specs = [bounded_json(), StructuredOutputsParams(regex=REGEX), StructuredOutputsParams(choice=CHOICES),
             StructuredOutputsParams(grammar='start: "yes" | "no" | "maybe"'),
             StructuredOutputsParams(regex="[a-z]{2,40}")]  # (cut by max_tokens: length)
    prompts = ["Describe a person as JSON.", "An order code:", "A colour:", "Answer:", "A word:"]
    params = [SamplingParams(temperature=0, max_tokens=24 if i < 4 else 5, structured_outputs=s)
              for i, s in enumerate(specs)]
    params += [SamplingParams(temperature=0.9, seed=5, n=2, max_tokens=24, structured_outputs=specs[0])]
    runs = {}
    for way in ("pyo3", "cpp"):
        monkeypatch.setenv(GRAMMAR_WORKER_ENV, way)
        llm = LLM(model=tiny_dir, tokenizer=pagedcore.default_model_path(), num_kv_blocks=64, max_model_len=256,
                  max_num_seqs=8, async_output_proc=True, async_scheduling=True)
        runs[way] = llm.generate(prompts + prompts[:1], params, use_tqdm=False)
        assert (llm.llm_engine._structured.worker is not None) == (way == "cpp")
        assert live_worker_matchers(llm) in (None, 0)
    assert summary(runs["cpp"]) == summary(runs["pyo3"])
    outs = runs["cpp"]
    for out in (outs[0], outs[5]):
        for c in out.outputs:
            assert c.finish_reason == "stop", c
            BoundedPerson.model_validate_json(c.text)
    assert len(outs[5].outputs) == 2
    [c] = outs[1].outputs
    assert c.finish_reason == "stop" and re.fullmatch(REGEX, c.text), c
    [c] = outs[2].outputs
    assert c.finish_reason == "stop" and c.text in CHOICES, c
    [c] = outs[3].outputs
    assert c.finish_reason == "stop" and c.text in ("yes", "no", "maybe"), c
    [c] = outs[4].outputs
    assert c.finish_reason == "length" and len(c.token_ids) == 5 and re.fullmatch("[a-z]+", c.text), c


def test_the_cpp_worker_is_the_default_where_llguidance_has_its_library(monkeypatch) -> None:
    """Unset, $PAGEDCORE_GRAMMAR_WORKER means the C++ worker when llguidance's wheel has
    its shared library (it has, here), else the PyO3 way (no library: no error)."""
    from pagedcore import structured_outputs
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(pagedcore.default_model_path())
    monkeypatch.delenv(GRAMMAR_WORKER_ENV)
    assert structured_outputs.grammar_worker_way() == "cpp"
    assert StructuredOutputManager(tokenizer, 49152, [2]).worker is not None
    monkeypatch.setattr(structured_outputs, "_llg_library_path", lambda llg: "/nonexistent/_lib.abi3.so")
    assert structured_outputs.grammar_worker_way() == "pyo3"
    assert StructuredOutputManager(tokenizer, 49152, [2]).worker is None
    monkeypatch.setenv(GRAMMAR_WORKER_ENV, "cpp")  # (asked for: refused without the library)
    with pytest.raises(ValueError, match="shared library"):
        StructuredOutputManager(tokenizer, 49152, [2])


def test_grammar_worker_switch_is_checked(monkeypatch) -> None:
    monkeypatch.setenv(GRAMMAR_WORKER_ENV, "rust")
    with pytest.raises(ValueError, match=GRAMMAR_WORKER_ENV):  # (before the tokenizer is read)
        StructuredOutputManager(object(), 49152, [2])


def test_the_cpp_workers_masks_store_the_ready_flag(monkeypatch) -> None:
    """With the C++ worker, start_masks hands BitmaskStaging's ready flag (the word the
    CUDA sampler polls) to the worker, which stores the step's ticket once the masks are
    in; the masks are those of the regex "[0-9]{3}" (digit tokens, no EOS yet), checked
    against the tokenizer's vocabulary."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(pagedcore.default_model_path())
    monkeypatch.setenv(GRAMMAR_WORKER_ENV, "cpp")
    manager = StructuredOutputManager(tokenizer, 49152, [2])
    matchers = [manager.new_matcher(StructuredOutputsParams(regex="[0-9]{3}")) for _ in range(2)]
    out = torch.zeros(2, manager.num_words, dtype=torch.int32)
    flag = np.zeros(1, dtype=np.uint32)
    job = manager.start_masks(matchers, out, ready=(flag, 7))
    assert job.wait() and job.done() and flag[0] == 7
    bits = (out.numpy().view(np.uint32)[:, :, None] >> np.arange(32, dtype=np.uint32)) & 1
    allowed = np.flatnonzero(bits[0].reshape(-1))
    expected = [t for t in range(len(tokenizer)) if re.fullmatch("[0-9]{1,3}", tokenizer.decode([t]))]
    assert allowed.tolist() == expected and (bits[1] == bits[0]).all()
    for m in matchers:
        manager.free(m)
    assert manager.live_matchers() == 0


@pytest.mark.parametrize("kwargs, field", [
    (dict(regex="(ab"), "regex"),
    (dict(json={"type": "frobnicate"}), "json"),
    (dict(json="{not json"), "json"),
    (dict(json=[1, 2]), "json"),
    (dict(choice=[]), "choice"),
    (dict(choice=["a", 3]), "choice"),
    (dict(grammar="start: foo"), "grammar"),
    (dict(regex="a", choice=["a"]), "exactly one"),
    (dict(), "exactly one"),
    (dict(regex="a", disable_any_whitespace=True), "disable_any_whitespace"),
])
def test_invalid_specs_are_refused(kwargs, field) -> None:
    with pytest.raises(ValueError, match=re.escape(field)):
        StructuredOutputsParams(**kwargs)


def test_structured_outputs_type_checked() -> None:
    with pytest.raises(TypeError, match="structured_outputs"):
        SamplingParams(structured_outputs={"regex": "a"})


# --------------------------------------------------------------------------
# The masks' machinery, on a byte-level tokenizer of the tests' own


def byte_level_tokenizer(path: Path) -> int:
    """A byte-level BPE tokenizer (GPT-2's byte-to-character map) over the 256 bytes and
    three merges ("12", "ab", "-a": tokens that cross the regex's parts), with <bos> and
    <eos>; saved at ``path``. Returns its EOS id."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    printable = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    chars, shifted = {}, 0
    for b in range(256):
        chars[b] = chr(b) if b in printable else chr(256 + shifted)
        shifted += b not in printable
    merges = [("1", "2"), ("a", "b"), ("-", "a")]
    vocab = {chars[b]: b for b in range(256)}
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<bos>", eos_token="<eos>")
    fast.save_pretrained(path)
    return fast.eos_token_id


BYTE_VOCAB = 320  # the model's vocabulary: the tokenizer's 261 tokens, padded


@pytest.fixture(scope="module")
def byte_model(tmp_path_factory) -> tuple[str, int]:
    """A 1-layer random Llama (hidden size 64) over the byte-level tokenizer, written
    directly; returns its path (the tokenizer's too) and EOS."""
    import transformers
    from safetensors.torch import save_file

    path = Path(tmp_path_factory.mktemp("bytes"))
    eos = byte_level_tokenizer(path)
    config = transformers.LlamaConfig(vocab_size=BYTE_VOCAB, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                      head_dim=32, max_position_embeddings=256, bos_token_id=eos - 1,
                                      eos_token_id=eos, tie_word_embeddings=True, architectures=["LlamaForCausalLM"])
    config.save_pretrained(path)
    gen = torch.Generator().manual_seed(1)
    weights = {"model.embed_tokens.weight": (BYTE_VOCAB, 64), "model.norm.weight": None}
    for name, shape in (("self_attn.q_proj", (64, 64)), ("self_attn.k_proj", (32, 64)), ("self_attn.v_proj", (32, 64)),
                        ("self_attn.o_proj", (64, 64)), ("mlp.gate_proj", (128, 64)), ("mlp.up_proj", (128, 64)),
                        ("mlp.down_proj", (64, 128)), ("input_layernorm", None), ("post_attention_layernorm", None)):
        weights[f"model.layers.0.{name}.weight"] = shape
    save_file({name: torch.ones(64) if shape is None else torch.randn(shape, generator=gen) * 0.5
               for name, shape in weights.items()}, str(path / "model.safetensors"), metadata={"format": "pt"})
    return str(path), eos


@functools.lru_cache(maxsize=None)
def regex_mask(tokenizer, pattern: str, text: str, eos: int) -> tuple[int, ...]:
    """The tokens a grammar of ``pattern`` may allow after ``text``, by the regex module:
    a token whose text extends ``text`` to a prefix of a match; EOS once it matches.
    (llguidance allows fewer where the grammar forces the next bytes: then only the
    first token of their tokenization.)"""
    import regex

    allowed = []
    for t, piece in enumerate(token_texts(tokenizer)):
        if t == eos:
            if regex.fullmatch(pattern, text):
                allowed.append(t)
        elif piece and regex.fullmatch(pattern, text + piece, partial=True):
            allowed.append(t)
    return tuple(allowed)


@functools.lru_cache(maxsize=None)
def token_texts(tokenizer) -> list[str]:
    special = set(tokenizer.all_special_ids)
    return ["" if t in special else tokenizer.decode([t]) for t in range(len(tokenizer))]


def test_masks_on_the_pool_spread_over_lanes(byte_model, monkeypatch) -> None:
    """A pool of two threads: each spec's matchers come from two compiled copies of its
    grammar in turn (their lexers have a lock each), and take a step's tokens on the
    pool; a step's masks, computed in the
    background and in line in turn (the manager's trials of the two), are each row's own, step by step to the end of random walks under three
    grammars: equal to an independent matcher's (compiled apart, its mask computed on
    this thread through llguidance's other entry point), within what the regex module
    allows, EOS exactly at a full match; all in the buffer when the job's release runs."""
    import llguidance
    import transformers

    from pagedcore import structured_outputs
    from pagedcore.structured_outputs import _grammar_text

    monkeypatch.setenv("PAGEDCORE_MASK_THREADS", "2")
    monkeypatch.setattr(structured_outputs, "CONSUME_POOL_MIN_ROWS", 2)  # (the tokens fed on the pool too)
    path, eos = byte_model
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    manager = StructuredOutputManager(tokenizer, BYTE_VOCAB, [eos])
    assert (manager.mask_threads, manager.num_lanes, manager.background) == (2, 2, True)
    choices = ["ab-12", "abab", "-a-a"]
    patterns = [REGEX, "|".join(re.escape(c) for c in choices), "[a-c]{2}[0-9]{1,3}"]
    specs = [StructuredOutputsParams(regex=REGEX), StructuredOutputsParams(choice=choices),
             StructuredOutputsParams(regex=patterns[2])]
    rows = [0, 1, 2, 0, 1, 0]  # each row's spec
    matchers = [manager.new_matcher(specs[k]) for k in rows]
    alone = [llguidance.LLMatcher(manager._tokenizer, _grammar_text(specs[k].key)) for k in rows]
    assert [m.lane for m in matchers] == [0, 0, 0, 1, 1, 0]
    templates = manager._compiled[specs[0].key].templates
    assert len(templates) == 2 and templates[0] is not templates[1]
    rng = np.random.default_rng(0)
    n = len(rows)
    texts, done, ways = [""] * n, [False] * n, set()
    out = torch.empty((n, manager.num_words), dtype=torch.int32)
    while not all(done):
        out.fill_(0x5A5A5A5A)  # (poison: a mask not written shows)
        seen = []
        job = manager.start_masks(matchers, out, release=lambda: seen.append(out.clone()))
        ways.add(job.background)
        job.wait()
        assert len(seen) == 1 and torch.equal(seen[0], out)
        bits = np.unpackbits(out.numpy().view(np.uint8), axis=1, bitorder="little")[:, :BYTE_VOCAB]
        tokens = []
        for r in range(n):
            allowed = np.nonzero(bits[r])[0].tolist()
            own = np.unpackbits(np.frombuffer(alone[r].compute_bitmask(), dtype=np.uint8), bitorder="little")
            assert allowed == np.nonzero(own[:BYTE_VOCAB])[0].tolist(), (r, texts[r])
            if done[r]:
                assert allowed == [eos]
            else:
                may = regex_mask(tokenizer, patterns[rows[r]], texts[r], eos)
                assert allowed and set(allowed) <= set(may) and (eos in allowed) == (eos in may), (r, texts[r])
            token = int(rng.choice(allowed))
            assert alone[r].consume_token(token)
            done[r] = done[r] or token == eos
            texts[r] += "" if token == eos else tokenizer.decode([token])
            tokens.append(token)
        assert all(manager.consume(matchers, tokens))
    assert all(re.fullmatch(patterns[k], t) for k, t in zip(rows, texts)), texts
    assert ways == {True, False}


def byte_llm(path: str, monkeypatch, threads: int, device_wait: bool = True, **kw) -> LLM:
    monkeypatch.setenv("PAGEDCORE_MASK_THREADS", str(threads))
    monkeypatch.setenv("PAGEDCORE_MASK_DEVICE_WAIT", "1" if device_wait else "0")
    return LLM(model=path, num_kv_blocks=64, max_model_len=128, max_num_seqs=8, **kw)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_masks_in_the_background_give_the_outputs_of_masks_in_line(byte_model, monkeypatch, device) -> None:
    """The masks computed on the pool while the step goes on (on CUDA also queued behind
    the device's wait for them, or without it), or on the pool in line (the way the
    manager's trials may keep), give the outputs of masks computed on the engine's
    thread before the sampler: regexes and choices that hold (re, the list),
    n = 2, a stop string, an unconstrained request beside them, async scheduling on
    and off."""
    from pagedcore import structured_outputs

    path, eos = byte_model
    choices = ["ab-12", "abab", "-a-a"]
    specs = [StructuredOutputsParams(regex=REGEX), StructuredOutputsParams(choice=choices),
             StructuredOutputsParams(regex="[a-c]{2}[0-9]{1,3}"), None]
    params = [SamplingParams(temperature=1.0, seed=3 + i, n=2, max_tokens=16, structured_outputs=spec)
              for i, spec in enumerate(specs)]
    params.append(SamplingParams(temperature=1.0, seed=9, max_tokens=16, stop=["-"],
                                 structured_outputs=StructuredOutputsParams(regex=REGEX)))
    prompts = ["a1", "b2", "c3", "d4", "e5"]
    # (way "inline": every step's masks in line, past the trials too; "device wait": every
    # step's in the background, the device waiting for them even when they are in already)
    configs = [dict(threads=0)] + ([dict(threads=2, device_wait=True, way="device wait"),
                                    dict(threads=2, device_wait=False)] if device == "cuda" else [dict(threads=2)])
    configs.append(dict(threads=2, way="inline"))
    runs = []
    for config in configs:
        config = dict(config)
        way = config.pop("way", None)
        for mode in (False, True):
            llm = byte_llm(path, monkeypatch, device=device, async_scheduling=mode, **config)
            with monkeypatch.context() as patch:
                if way is not None:
                    background = way != "inline"
                    patch.setattr(StructuredOutputManager, "_choose_mask_way", lambda self, rows: background)
                if way == "device wait":
                    patch.setattr(structured_outputs.MaskJob, "done", lambda self: False)
                outs = llm.generate(prompts, params, use_tqdm=False)
            assert llm.llm_engine._structured.mask_threads == config["threads"]
            staging = llm.llm_engine._bitmask_staging
            assert staging.device_wait == (config["threads"] > 0 and config.get("device_wait", True)
                                           and device == "cuda")
            runs.append([[(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in outs])
            for c in outs[0].outputs + outs[2].outputs:
                pattern = REGEX if c in outs[0].outputs else "[a-c]{2}[0-9]{1,3}"
                assert c.finish_reason == "stop" and re.fullmatch(pattern, c.text), c
            assert all(c.finish_reason == "stop" and c.text in choices for c in outs[1].outputs)
            assert all(c.finish_reason == "length" for c in outs[3].outputs)  # (garbage: no EOS in sight)
            cut = outs[4].outputs[0]
            assert cut.finish_reason == "stop" and cut.stop_reason == "-" and re.fullmatch(r"[0-9]{3}", cut.text)
    assert all(run == runs[0] for run in runs), "the outputs differ between the ways of computing the masks"


@pytest.mark.parametrize("pool_cost, loop_cost, chosen", [(1, 5, True), (5, 1, False)])
def test_consume_keeps_the_faster_way_after_its_trials(byte_model, monkeypatch, pool_cost, loop_cost, chosen) -> None:
    """The tokens go one by one and on the pool in turn over the first CONSUME_TRIALS
    calls of 16+ rows, then the way with the lower median time per token stays: here
    each way's time on a fake clock that its (fake) matchers and pool advance."""
    import transformers

    from pagedcore import structured_outputs
    from pagedcore.structured_outputs import CONSUME_TRIALS, GrammarMatcher

    monkeypatch.setenv("PAGEDCORE_MASK_THREADS", "2")
    clock = [0.0]
    monkeypatch.setattr(structured_outputs.time, "perf_counter", lambda: clock[0])

    class Matcher:
        def consume_token(self, token: int) -> bool:
            clock[0] += loop_cost
            return token >= 0

    class Pool:
        def consume_token_par(self, pairs):
            clock[0] += pool_cost * len(pairs)
            return [t >= 0 for _, t in pairs]

    path, eos = byte_model
    manager = StructuredOutputManager(transformers.AutoTokenizer.from_pretrained(path), BYTE_VOCAB, [eos])
    manager._executor = Pool()
    matchers = [GrammarMatcher(Matcher(), lane=i % 2) for i in range(16)]
    ways = []
    for step in range(CONSUME_TRIALS + 3):
        before = clock[0]
        assert manager.consume(matchers, [step] * 16) == [True] * 16
        ways.append(clock[0] - before == 16 * pool_cost)  # (True: it went on the pool)
    assert ways[:CONSUME_TRIALS] == [False, True] * (CONSUME_TRIALS // 2)
    assert ways[CONSUME_TRIALS:] == [chosen] * 3
    before = clock[0]
    assert manager.consume(matchers[:15], [1] * 15) == [True] * 15
    assert clock[0] - before == 15 * loop_cost  # (fewer than 16 rows: one by one)


@pytest.mark.parametrize("background_cost, inline_cost, chosen", [(1, 5, True), (5, 1, False)])
def test_masks_keep_the_cheaper_way_after_their_trials(byte_model, monkeypatch, background_cost, inline_cost,
                                                        chosen) -> None:
    """With a pool, a step's masks go to the background and in line in turn over the
    first MASK_TRIALS jobs, then the way that cost the engine's thread less per row
    (median) stays for MASK_TRIAL_PERIOD jobs, then the trials run again; each
    power-of-two bucket of batch sizes apart. Each job's cost here: its rows times its
    way's cost (plus, for the background, a fixed cost per job), as if measured."""
    import transformers

    from pagedcore import structured_outputs
    from pagedcore.structured_outputs import MASK_TRIALS, MaskJob

    monkeypatch.setenv("PAGEDCORE_MASK_THREADS", "2")
    monkeypatch.setattr(structured_outputs, "MASK_TRIAL_PERIOD", 5)
    path, eos = byte_model
    manager = StructuredOutputManager(transformers.AutoTokenizer.from_pretrained(path), BYTE_VOCAB, [eos])

    def jobs(row_counts: list[int]) -> list[bool]:
        ways = []
        for rows in row_counts:
            background = manager._choose_mask_way(rows)
            ways.append(background)
            job = MaskJob(None, background=background)
            job._run(lambda: None)
            job.host_seconds = rows * (background_cost if background else inline_cost) + 12 * background
            manager._last_job = (job, rows)
        return ways

    # 8-15 rows: the trials (the rows differ: per row), then the choice for 5 jobs, then the trials again
    ways = jobs([8, 15, 12] * (MASK_TRIALS // 3) + [8] * (MASK_TRIALS % 3) + [15, 9, 8, 12, 13] + [8] * 2)
    assert ways[:MASK_TRIALS] == [True, False] * (MASK_TRIALS // 2)
    assert ways[MASK_TRIALS:MASK_TRIALS + 5] == [chosen] * 5
    assert ways[MASK_TRIALS + 5:] == [True, False]
    # 1 row (bucket 1): trials of its own, where the background's fixed cost decides;
    # meanwhile the 8-15 rows' bucket goes on with its trials where it was
    assert jobs([1] * MASK_TRIALS + [1]) == [True, False] * (MASK_TRIALS // 2) + [False]
    assert jobs([8, 8]) == [True, False]
    assert manager.mask_ways[1].medians == (background_cost + 12, inline_cost)
