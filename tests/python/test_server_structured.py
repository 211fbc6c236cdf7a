"""Structured outputs through the server: OpenAI's ``response_format`` with the
official client's ``chat.completions.parse`` (a pydantic model as the format),
vLLM's ``structured_outputs`` and ``guided_*`` fields on both APIs, and the 400s
for invalid specs. The server runs the tiny random Llama of test_server_api
(SmolLM2's tokenizer): its outputs are arbitrary, so only a constraint makes them
valid, and pydantic / ``re`` check every one."""

from __future__ import annotations

import json
import re
from typing import Literal

import pytest

pytest.importorskip("llguidance")

pydantic = pytest.importorskip("pydantic")  # (the GPU machine has none unless .gpuwheels is carried)
from test_server_api import MODEL, checkpoint, client, http, openai, serve, server  # noqa: E402,F401


class Pet(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")  # (else any further key is valid JSON too)
    kind: Literal["cat", "dog", "fish"]
    name: str = pydantic.Field(max_length=6)
    age: int = pydantic.Field(ge=0, le=30)
    indoor: bool


def test_parse_with_a_pydantic_response_format(client) -> None:
    completion = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Describe a pet."}], response_format=Pet,
        n=4, temperature=1.0, seed=5, max_tokens=120,
        # (the random model would fill the output with whitespace, which JSON allows)
        extra_body={"structured_outputs": {"disable_any_whitespace": True}})
    assert len(completion.choices) == 4
    for choice in completion.choices:
        assert choice.finish_reason == "stop", choice
        assert isinstance(choice.message.parsed, Pet)
        Pet.model_validate_json(choice.message.content)
    assert len({c.message.content for c in completion.choices}) > 1


def test_json_object_regex_choice_grammar_on_both_apis(client) -> None:
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "JSON please"}], response_format={"type": "json_object"},
        temperature=0.8, seed=1, max_tokens=200, extra_body={"structured_outputs": {"disable_any_whitespace": True}})
    choice = chat.choices[0]
    assert choice.finish_reason == "length" or isinstance(json.loads(choice.message.content), dict)
    regex = r"[A-Z][a-z]{2,5} [0-9]{2}"
    out = client.completions.create(model=MODEL, prompt="Code:", n=3, temperature=1.0, seed=2, max_tokens=20,
                                    extra_body={"structured_outputs": {"regex": regex}})
    for c in out.choices:
        assert c.finish_reason == "stop" and re.fullmatch(regex, c.text), c
    out = client.completions.create(model=MODEL, prompt="Colour:", n=3, temperature=1.0, seed=3, max_tokens=20,
                                    extra_body={"guided_choice": ["red", "green", "blue"]})
    assert all(c.finish_reason == "stop" and c.text in ("red", "green", "blue") for c in out.choices)
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "?"}], temperature=1.0, seed=4, max_tokens=20, n=2,
        extra_body={"guided_grammar": 'start: ("yes" | "no") "!"'})
    assert all(c.message.content in ("yes!", "no!") for c in chat.choices)
    out = client.completions.create(model=MODEL, prompt="Pet:", temperature=1.0, seed=6, max_tokens=120,
                                    extra_body={"guided_json": Pet.model_json_schema(),
                                                "structured_outputs": {"disable_any_whitespace": True}})
    assert out.choices[0].finish_reason == "stop", out.choices[0].text
    Pet.model_validate_json(out.choices[0].text)


def test_streamed_constrained_chat_joins_to_valid_json(client) -> None:
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "A pet"}], stream=True, temperature=1.0, seed=8,
        max_tokens=120, response_format={"type": "json_schema",
                                         "json_schema": {"name": "Pet", "schema": Pet.model_json_schema()}},
        extra_body={"structured_outputs": {"disable_any_whitespace": True}})
    text, reasons = "", []
    for chunk in stream:
        for c in chunk.choices:
            text += c.delta.content or ""
            if c.finish_reason:
                reasons.append(c.finish_reason)
    assert reasons == ["stop"]
    Pet.model_validate_json(text)


@pytest.mark.parametrize("route, fields, param", [
    ("completions", {"structured_outputs": {"regex": "(ab"}}, "structured_outputs"),
    ("completions", {"guided_json": {"type": "frobnicate"}}, "guided_json"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 3}}}},
     "response_format"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ("chat", {"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ("chat", {"guided_grammar": "start: undefined_rule"}, "guided_grammar"),
])
def test_invalid_specs_are_400_naming_the_field(http, route, fields, param) -> None:
    body = {"model": MODEL, "max_tokens": 4, **fields}
    if route == "chat":
        r = http.post("/v1/chat/completions", json={**body, "messages": [{"role": "user", "content": "hi"}]})
    else:
        r = http.post("/v1/completions", json={**body, "prompt": "hi"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_schema_cut_by_max_tokens_is_length_and_parse_refuses_it(client) -> None:
    with pytest.raises(openai.LengthFinishReasonError):
        client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "pet"}],
                                      response_format=Pet, max_tokens=3, temperature=1.0, seed=1)
