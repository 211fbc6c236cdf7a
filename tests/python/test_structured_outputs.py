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
whitespace, so a constrained output ends well within max_tokens."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("llguidance")

pydantic = pytest.importorskip("pydantic")  # (the GPU machine has none unless .gpuwheels is carried)
import torch  # noqa: E402

import pagedcore  # noqa: E402
from pagedcore import LLM, SamplingParams  # noqa: E402
from pagedcore.sampler import apply_token_bitmask  # noqa: E402
from pagedcore.structured_outputs import StructuredOutputsParams  # noqa: E402


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


@pytest.fixture(scope="module")
def tiny_llms(tiny_dir) -> dict[bool, LLM]:
    return tiny_pair(tiny_dir, num_kv_blocks=128, max_model_len=256, max_num_seqs=16)


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
    assert summary(runs[True]) == summary(runs[False])
    return runs[True]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_apply_token_bitmask_matches_bit_arithmetic(device) -> None:
    # (numpy unpacks the bits on the CPU, torch's shifts on CUDA)
    gen = torch.Generator().manual_seed(0)
    vocab = 70  # 3 words: the last one partly past the vocabulary
    logits = torch.randn(4, vocab, generator=gen)
    words = torch.randint(-2**31, 2**31 - 1, (4, 3), generator=gen, dtype=torch.int64).to(torch.int32)

    def expected(rows: list[int]) -> torch.Tensor:
        out = logits.clone()
        for i, row in enumerate(rows):
            for t in range(vocab):
                if (int(words[i, t // 32]) >> (t % 32)) & 1 == 0:
                    out[row, t] = float("-inf")
        return out

    for rows in ([3, 1], [0, 1, 2, 3]):  # some rows; every row (no gather and scatter)
        got = apply_token_bitmask(logits.clone().to(device), torch.tensor(rows, device=device),
                                  words[:len(rows)].to(device))
        assert torch.equal(got.cpu(), expected(rows)), rows
    # A bitmask narrower than the logits blocks the columns past it.
    narrow = apply_token_bitmask(logits.clone().to(device), torch.tensor([0], device=device),
                                 torch.full((1, 1), -1, dtype=torch.int32, device=device)).cpu()
    assert torch.equal(narrow[0, :32], logits[0, :32]) and bool((narrow[0, 32:] == float("-inf")).all())
    assert torch.equal(narrow[1:], logits[1:])


def test_json_schema_holds_on_smollm2(smollm2: LLM) -> None:
    # Two samples, the model's own whitespace (the string form of a schema: tiny below).
    params = SamplingParams(temperature=0.9, n=2, seed=7, max_tokens=40,
                            structured_outputs=StructuredOutputsParams(json=SCHEMA))
    [out] = smollm2.generate(["Describe a person as JSON."], params, use_tqdm=False)
    for c in out.outputs:
        assert c.finish_reason == "stop", c
        Person.model_validate_json(c.text)  # raises if invalid
        assert list(json.loads(c.text)) == ["name", "age"]  # the schema's order


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


def test_stop_strings_end_constrained_outputs(tiny_llms) -> None:
    # A stop string still ends a constrained output (where the user asked).
    cut = generate(tiny_llms, ["Describe a person as JSON."], SamplingParams(
        temperature=0, max_tokens=24, stop=['"age"'], structured_outputs=bounded_json()))[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == '"age"' and '"age"' not in cut.text
    assert cut.text.startswith('{"name":"')


def test_schema_cut_by_max_tokens_finishes_with_length(tiny_llms) -> None:
    out = generate(tiny_llms, ["Describe a person as JSON."], SamplingParams(
        temperature=0.8, seed=1, n=2, max_tokens=4, structured_outputs=bounded_json()))[0]
    for c in out.outputs:
        assert c.finish_reason == "length" and len(c.token_ids) == 4
        with pytest.raises(pydantic.ValidationError):
            BoundedPerson.model_validate_json(c.text)


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
        texts[mode] = text
    assert texts[True] == texts[False]


def test_constrained_sequences_waiting_and_preempted(tiny_dir) -> None:
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
