"""Structured outputs (``SamplingParams(structured_outputs=StructuredOutputsParams(...))``):
the real default model on the CPU with async output processing on (the code path
the GPU takes by default); every output is checked by an independent validator
(pydantic for JSON schemas, Python's ``re`` for regexes, membership for choices)."""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("transformers")
pytest.importorskip("llguidance")

import pydantic  # noqa: E402
import torch  # noqa: E402

import pagedcore  # noqa: E402
from pagedcore import LLM, SamplingParams  # noqa: E402
from pagedcore.sampler import apply_token_bitmask  # noqa: E402
from pagedcore.structured_outputs import StructuredOutputsParams  # noqa: E402


class Person(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    name: str = pydantic.Field(max_length=8)
    age: int


SCHEMA = Person.model_json_schema()
REGEX = r"[0-9]{3}-[a-z]{2,4}"
CHOICES = ["red", "green", "blue"]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(model=pagedcore.default_model_path(), num_kv_blocks=256, max_model_len=512,
               max_num_seqs=16, async_output_proc=True)


def test_apply_token_bitmask_matches_bit_arithmetic() -> None:
    gen = torch.Generator().manual_seed(0)
    vocab = 70  # 3 words: the last one partly past the vocabulary
    logits = torch.randn(4, vocab, generator=gen)
    words = torch.randint(-2**31, 2**31 - 1, (2, 3), generator=gen, dtype=torch.int64).to(torch.int32)
    rows = [3, 1]
    expected = logits.clone()
    for i, row in enumerate(rows):
        for t in range(vocab):
            if (int(words[i, t // 32]) >> (t % 32)) & 1 == 0:
                expected[row, t] = float("-inf")
    got = apply_token_bitmask(logits.clone(), torch.tensor(rows), words)
    assert torch.equal(got, expected)
    # A bitmask narrower than the logits blocks the columns past it.
    narrow = apply_token_bitmask(logits.clone(), torch.tensor([0]), torch.full((1, 1), -1, dtype=torch.int32))
    assert torch.equal(narrow[0, :32], logits[0, :32]) and bool((narrow[0, 32:] == float("-inf")).all())


def test_json_regex_choice_grammar_in_one_batch(llm: LLM) -> None:
    specs = [
        StructuredOutputsParams(json=SCHEMA),
        StructuredOutputsParams(json=json.dumps(SCHEMA)),
        StructuredOutputsParams(regex=REGEX),
        StructuredOutputsParams(choice=CHOICES),
        StructuredOutputsParams(grammar='start: "yes" | "no" | "maybe"'),
        StructuredOutputsParams(json_object=True),
        None,  # an unconstrained request in the same batch
    ]
    prompts = ["Describe a person as JSON.", "Write a JSON object about a person.",
               "An order code:", "Your favourite colour?", "Answer:", '{"a": 1, "b": 2} is JSON. Another:',
               "The sky is"]
    params = [SamplingParams(temperature=0.9, n=3, seed=7 + i, max_tokens=40 if s else 4, structured_outputs=s)
              for i, s in enumerate(specs)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for out in outs[:2]:
        for c in out.outputs:
            assert c.finish_reason == "stop", c
            Person.model_validate_json(c.text)  # raises if invalid
            assert list(json.loads(c.text)) == ["name", "age"]  # the schema's order
    for c in outs[2].outputs:
        assert c.finish_reason == "stop" and re.fullmatch(REGEX, c.text), c
    for c in outs[3].outputs:
        assert c.finish_reason == "stop" and c.text in CHOICES, c
    for c in outs[4].outputs:
        assert c.finish_reason == "stop" and c.text in ("yes", "no", "maybe"), c
    for c in outs[5].outputs:  # any JSON object, or cut by max_tokens
        assert c.finish_reason == "length" or isinstance(json.loads(c.text), dict), c
    assert any(c.finish_reason == "stop" for c in outs[5].outputs)
    # n = 3 samples draw independently (their own matchers): not all alike.
    assert len({c.text for c in outs[0].outputs}) > 1


def test_stop_strings_end_constrained_outputs(llm: LLM) -> None:
    # A stop string still ends a constrained output (where the user asked).
    cut = llm.generate(["Describe a person as JSON."], SamplingParams(
        temperature=0, max_tokens=60, stop=['"age"'], structured_outputs=StructuredOutputsParams(json=SCHEMA)),
        use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == '"age"' and '"age"' not in cut.text


def test_schema_cut_by_max_tokens_finishes_with_length(llm: LLM) -> None:
    out = llm.generate(["Describe a person as JSON."], SamplingParams(
        temperature=0.8, seed=1, n=2, max_tokens=6, structured_outputs=StructuredOutputsParams(json=SCHEMA)),
        use_tqdm=False)[0]
    for c in out.outputs:
        assert c.finish_reason == "length" and len(c.token_ids) == 6
        with pytest.raises(pydantic.ValidationError):
            Person.model_validate_json(c.text)


def test_streaming_deltas_concatenate_to_valid_json(llm: LLM) -> None:
    engine = llm.llm_engine
    engine.add_request("so-stream", "Describe a person as JSON.", None, SamplingParams(
        temperature=0.7, seed=3, max_tokens=60, structured_outputs=StructuredOutputsParams(json=SCHEMA)),
        stream=True)
    text, reasons = "", []
    while engine.has_unfinished_requests():
        for out in engine.step():
            text += out.outputs[0].text if out.outputs else ""
            reasons += [c.finish_reason for c in out.outputs if c.finish_reason]
    assert reasons == ["stop"]
    Person.model_validate_json(text)


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
