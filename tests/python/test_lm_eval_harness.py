"""Evaluation harnesses against ``pagedcore serve`` (default model, float32):
``/v1/completions`` with ``echo`` + ``logprobs`` returns the prompt's token
logprobs in OpenAI's legacy shape (checked against transformers' log-softmax),
and lm-evaluation-harness's ``local-completions`` model scores a local
multiple-choice task (tests/python/lm_eval_task/, no network) exactly as its
``hf`` model does on the same weights: same accuracy, log-likelihoods within
1e-3."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
try:
    import httpx
except ImportError:  # the openai client of this environment ships httpx as `httpx2`
    httpx = pytest.importorskip("httpx2")

import pagedcore  # noqa: E402

MODEL = "smol"
TASK_DIR = Path(__file__).parent / "lm_eval_task"
PROMPT = "The capital of France is Paris, and the capital of Italy is"
TOL = 2e-4
STARTUP_TIMEOUT_S = 120


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def model_dir() -> str:
    return pagedcore.default_model_path()


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory) -> Iterator[str]:
    port = _free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    cmd = [sys.executable, "-m", "pagedcore", "serve", "--model", model_dir, "--port", str(port),
           "--served-model-name", MODEL, "--dtype", "float32", "--num-kv-blocks", "64", "--max-model-len", "256"]
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read_text()}")
            try:
                if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"no /health after {STARTUP_TIMEOUT_S} s:\n{log.read_text()}")
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert "Traceback" not in log.read_text(), log.read_text()


@pytest.fixture(scope="module")
def http(server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return transformers.AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def hf_model(model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def complete(http, **body) -> dict:
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def check_prompt_part(lp: dict, ids: list[int], hf_model, tokenizer, k: int) -> None:
    """The first len(ids) entries of a legacy logprobs object against transformers."""
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)
    texts = [tokenizer.decode([t]) for t in ids]
    assert lp["tokens"][:len(ids)] == texts
    assert lp["text_offset"][:len(ids)] == [sum(len(t) for t in texts[:i]) for i in range(len(ids))]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for p in range(1, len(ids)):
        row = ref[p - 1]
        assert lp["token_logprobs"][p] == pytest.approx(row[ids[p]].item(), abs=TOL), p
        top = row.topk(k)
        expected = {tokenizer.decode([t]): v for t, v in zip(top.indices.tolist(), top.values.tolist())}
        expected[texts[p]] = row[ids[p]].item()  # the token itself, as OpenAI sends it
        got = lp["top_logprobs"][p]
        assert got.keys() == expected.keys(), p
        assert all(got[t] == pytest.approx(v, abs=TOL) for t, v in expected.items()), p


def test_echo_with_max_tokens_0_returns_the_prompt_logprobs(http, hf_model, tokenizer) -> None:
    ids = tokenizer.encode(PROMPT)
    out = complete(http, echo=True, logprobs=2, max_tokens=0)
    [choice] = out["choices"]
    assert choice["text"] == PROMPT
    assert choice["finish_reason"] == "length"
    assert out["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)}
    assert len(choice["logprobs"]["tokens"]) == len(ids)
    check_prompt_part(choice["logprobs"], ids, hf_model, tokenizer, 2)
    # The same prompt as token ids, twice in one request (lm-eval sends batches of them).
    both = complete(http, prompt=[ids, ids], echo=True, logprobs=2, max_tokens=0)
    assert [c["logprobs"] for c in both["choices"]] == [choice["logprobs"]] * 2


def test_echo_then_the_completion(http, hf_model, tokenizer) -> None:
    ids = tokenizer.encode(PROMPT)
    plain = complete(http, logprobs=1, max_tokens=3)["choices"][0]
    out = complete(http, echo=True, logprobs=1, max_tokens=3)
    [choice] = out["choices"]
    assert choice["text"] == PROMPT + plain["text"]
    lp = choice["logprobs"]
    check_prompt_part(lp, ids, hf_model, tokenizer, 1)
    generated = {key: values[len(ids):] for key, values in lp.items()}
    assert generated["tokens"] == plain["logprobs"]["tokens"]
    assert generated["token_logprobs"] == plain["logprobs"]["token_logprobs"]
    assert generated["text_offset"] == [len(PROMPT) + o for o in plain["logprobs"]["text_offset"]]
    assert out["usage"]["completion_tokens"] == 3
    # Streamed: the first chunk carries the prompt's part, the chunks add up to the same.
    with http.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "temperature": 0,
                                                      "echo": True, "logprobs": 1, "max_tokens": 3,
                                                      "stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    merged = {key: [] for key in lp}
    for chunk in chunks:
        for key, values in chunk["choices"][0]["logprobs"].items():
            merged[key] += values
    assert merged == lp
    assert "".join(c["choices"][0]["text"] for c in chunks) == choice["text"]


def test_echo_with_n_2_gives_each_choice_the_prompt(http, tokenizer) -> None:
    ids = tokenizer.encode(PROMPT)
    out = complete(http, echo=True, logprobs=0, max_tokens=2, n=2, temperature=1.0, seed=3)
    lps = [c["logprobs"] for c in out["choices"]]
    assert len(lps) == 2 and all(len(lp["tokens"]) == len(ids) + 2 for lp in lps)
    assert lps[0]["token_logprobs"][:len(ids)] == lps[1]["token_logprobs"][:len(ids)]
    # logprobs=0: the token itself only.
    assert all(len(top) == 1 for top in lps[0]["top_logprobs"][1:len(ids)])


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": PROMPT, "prompt_logprobs": 1}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": PROMPT, "echo": True, "logprobs": 21, "max_tokens": 0}, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "echo": True}, "echo"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 1},
     "prompt_logprobs"),
])
def test_unsupported_combinations_are_refused(http, path, body, param) -> None:
    r = http.post(path, json={"model": MODEL, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def _samples(results: dict) -> list[tuple[int, list[float], int]]:
    """(doc id, log-likelihood of each choice, the argmax) per question."""
    out = []
    for s in sorted(results["samples"]["pagedcore_mc"], key=lambda s: s["doc_id"]):
        lls = [float(r[0]) for r in s["filtered_resps"]]
        out.append((s["doc_id"], lls, s["acc"]))
    return out


def test_lm_eval_local_completions_equals_hf(server, model_dir, monkeypatch) -> None:
    pytest.importorskip("lm_eval")
    pytest.importorskip("accelerate")  # (lm-eval's hf model)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    monkeypatch.chdir(TASK_DIR)  # the task's data file is relative to it
    import lm_eval
    from lm_eval.tasks import TaskManager

    # Only the local task: indexing lm-eval's thousands of built-in ones takes ~7 s.
    tasks = TaskManager(include_path=str(TASK_DIR), include_defaults=False)
    served = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={"base_url": f"{server}/v1/completions", "model": MODEL, "tokenizer": model_dir,
                    "tokenizer_backend": "huggingface", "tokenized_requests": True, "batch_size": 8,
                    "num_concurrent": 1, "max_retries": 1},
        tasks=["pagedcore_mc"], task_manager=tasks, log_samples=True, bootstrap_iters=0)
    hf = lm_eval.simple_evaluate(
        model="hf", model_args={"pretrained": model_dir, "dtype": "float32", "device": "cpu"},
        tasks=["pagedcore_mc"], task_manager=tasks, log_samples=True, batch_size=8, bootstrap_iters=0)
    got, ref = _samples(served), _samples(hf)
    assert len(got) == len(ref) == 8
    assert served["results"]["pagedcore_mc"]["acc,none"] == hf["results"]["pagedcore_mc"]["acc,none"]
    assert hf["results"]["pagedcore_mc"]["acc,none"] >= 0.75  # a task the model mostly gets right
    for (doc, lls, acc), (ref_doc, ref_lls, ref_acc) in zip(got, ref):
        assert doc == ref_doc and acc == ref_acc
        assert lls == pytest.approx(ref_lls, abs=1e-3), doc
