"""LLM end to end on the real default model (SmolLM2-135M-Instruct), against
Hugging Face transformers on the same weights, plus the API behaviours that
need a real tokenizer: n > 1 sharing, seeds, stop strings, min_tokens, chat,
beam search, bad input and the CLI."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

import pagedcore  # noqa: E402
from pagedcore import LLM, BeamSearchParams, SamplingParams  # noqa: E402

RAW_PROMPTS = [
    "The history of the printing press",
    "def fibonacci(n):",
    "自作PCで80万円の予算ならどんな構成がベスト?",
]
CHAT = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
]


@pytest.fixture(scope="module")
def model_dir() -> str:
    return pagedcore.default_model_path()


@pytest.fixture(scope="module")
def llm(model_dir) -> LLM:
    return LLM(model=model_dir, num_kv_blocks=512, max_model_len=1024, max_num_seqs=16)


@pytest.fixture(scope="module")
def hf_model(model_dir):
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.generation_config.eos_token_id = None  # run on past EOS, like ignore_eos
    return model


def hf_generate(model, ids: list[int], **kwargs) -> torch.Tensor:
    # NOTE: an explicit attention mask: the pad token (2, <|im_end|>) occurs
    # inside chat prompts, and generate() would otherwise mask it out.
    x = torch.tensor([ids])
    return model.generate(x, attention_mask=torch.ones_like(x), pad_token_id=2, **kwargs)


def hf_greedy(hf_model, ids: list[int], n: int) -> list[int]:
    out = hf_generate(hf_model, ids, do_sample=False, max_new_tokens=n)
    return out[0, len(ids):].tolist()


def test_greedy_tokens_equal_transformers_batched(llm, hf_model) -> None:
    tok = llm.get_tokenizer()
    prompts = [tok.encode(p) for p in RAW_PROMPTS]
    for conv in CHAT:
        text = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
        prompts.append(tok(text, add_special_tokens=False)["input_ids"])
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for ids, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf_model, ids, 48), tok.decode(ids)
    assert llm.stats()["num_free_blocks"] == llm.stats()["num_blocks"]


def test_chat_matches_the_template(llm) -> None:
    outs = llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)
    assert outs[0].outputs[0].text == "The capital of France is Paris."
    assert outs[0].outputs[0].finish_reason == "stop"
    assert outs[0].outputs[0].stop_reason is None  # EOS
    assert outs[0].prompt.startswith("<|im_start|>")


def test_n_samples_share_the_prompt_blocks_and_differ(llm) -> None:
    engine = llm.llm_engine
    prompt = llm.get_tokenizer().encode("Once upon a time " * 20)
    blocks = -(-len(prompt) // 16)
    assert len(prompt) % 16 != 0  # the last prompt block is partial: copy-on-write
    engine.add_request("share", None, prompt, SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=20))
    engine.step()  # prefill, fork into 4
    used_after_fork = llm.stats()["num_used_blocks"]
    engine.step()  # each sample writes its first token: copy-on-write of the last block
    used = llm.stats()["num_used_blocks"]
    # 4 independent copies would hold 4 x `blocks`; shared, the prompt's blocks
    # once, plus a private copy of the partial last block for 3 of the 4.
    assert used_after_fork == blocks
    assert used == blocks + 3
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    texts = [c.text for c in outs[0].outputs]
    assert len(set(texts)) == 4
    assert llm.stats()["num_free_blocks"] == llm.stats()["num_blocks"]


def test_seeded_request_is_independent_of_the_batch(llm) -> None:
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=24)
    alone = llm.generate(["Tell me a story"], seeded, use_tqdm=False)[0].outputs[0].text
    others = SamplingParams(temperature=1.0, max_tokens=30)
    batch = llm.generate(
        ["Hello", "Tell me a story", "Why is the sky blue?"], [others, seeded, others], use_tqdm=False
    )
    assert batch[1].outputs[0].text == alone
    other_seed = llm.generate(["Tell me a story"], SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=24), use_tqdm=False)
    assert other_seed[0].outputs[0].text != alone


def test_stop_strings_and_stop_tokens(llm) -> None:
    chat = CHAT[0]
    base = llm.chat(chat, SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)[0].outputs[0]
    assert "Paris" in base.text
    cut = llm.chat(chat, SamplingParams(temperature=0, max_tokens=30, stop=["Par"]), use_tqdm=False)[0].outputs[0]
    assert cut.text == base.text[: base.text.index("Par")]
    assert (cut.finish_reason, cut.stop_reason) == ("stop", "Par")
    kept = llm.chat(
        chat, SamplingParams(temperature=0, max_tokens=30, stop=["is Par"], include_stop_str_in_output=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert kept.text == base.text[: base.text.index("is Par") + len("is Par")]
    stop_token = base.token_ids[2]
    tok = llm.chat(chat, SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop_token]), use_tqdm=False)[0].outputs[0]
    assert tok.token_ids == base.token_ids[:3]
    assert (tok.finish_reason, tok.stop_reason) == ("stop", stop_token)


def test_stop_strings_count_only_from_min_tokens(llm) -> None:
    chat = CHAT[0]
    base = llm.chat(chat, SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)[0].outputs[0]
    first = base.text.index("Par")
    at = len(llm.get_tokenizer().decode(base.token_ids[:1]))  # text after one token
    assert at <= first  # "Par" is completed by a later token
    late = llm.chat(chat, SamplingParams(temperature=0, max_tokens=30, stop=["Par"], min_tokens=len(base.token_ids) - 1),
                    use_tqdm=False)[0].outputs[0]
    # "Par" is completed before min_tokens outputs: it does not stop the sequence,
    # which then ends as without stop strings (EOS is allowed from min_tokens on).
    assert (late.token_ids, late.text) == (base.token_ids, base.text)
    assert late.stop_reason != "Par"


def test_min_tokens_holds_eos_back(llm) -> None:
    chat = CHAT[0]
    base = llm.chat(chat, SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[0].outputs[0]
    n = len(base.token_ids)  # ends with EOS
    longer = llm.chat(chat, SamplingParams(temperature=0, max_tokens=40, min_tokens=n + 3), use_tqdm=False)[0].outputs[0]
    assert len(longer.token_ids) >= n + 3
    assert longer.token_ids[: n - 1] == base.token_ids[: n - 1]
    assert longer.token_ids[n - 1] != base.token_ids[-1]  # EOS was blocked there


def test_logprobs_are_the_model_distribution(llm, hf_model) -> None:
    ids = llm.get_tokenizer().encode("The quick brown fox")
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=1, logprobs=5), use_tqdm=False)
    entry = out[0].outputs[0].logprobs[0]
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0, -1].float(), dim=-1)
    values, top = ref.topk(5)
    assert sorted(entry, key=lambda t: entry[t].rank) == top.tolist()
    for rank, (t, v) in enumerate(zip(top.tolist(), values.tolist()), start=1):
        assert entry[t].rank == rank
        assert abs(entry[t].logprob - v) < 1e-4
    assert out[0].outputs[0].cumulative_logprob == pytest.approx(values[0].item(), abs=1e-4)


def test_beam_search_equals_transformers(llm, hf_model, model_dir) -> None:
    tok = llm.get_tokenizer()
    prompts = ["The best way to learn a language is", "In a small village"]
    outs = llm.beam_search(prompts, BeamSearchParams(beam_width=3, max_tokens=12))
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for prompt, out in zip(prompts, outs):
        ids = tok.encode(prompt)
        ref = hf_generate(
            model, ids, num_beams=3, num_return_sequences=3, do_sample=False,
            max_new_tokens=12, early_stopping=False, length_penalty=1.0,
        )
        expected = []
        for row in ref.tolist():
            gen = row[len(ids):]
            if 2 in gen:
                gen = gen[: gen.index(2) + 1]
            expected.append(ids + gen)
        assert [s.tokens for s in out.sequences] == expected
    assert llm.stats()["num_free_blocks"] == llm.stats()["num_blocks"]


def test_bad_input_is_a_value_error_and_the_llm_stays_usable(llm, tmp_path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        LLM(model=str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="more than max_model_len"):
        llm.generate({"prompt_token_ids": [5] * 1025}, use_tqdm=False)
    with pytest.raises(ValueError, match="max_tokens"):
        llm.generate({"prompt_token_ids": [5] * 1000}, SamplingParams(max_tokens=100), use_tqdm=False)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=1.5)
    with pytest.raises(ValueError, match="sampling_params has 1 entries for 2 prompts"):
        llm.generate(["a", "b"], [SamplingParams()], use_tqdm=False)
    with pytest.raises(ValueError, match="prompts\\[1\\]"):
        llm.generate(["a", 5], use_tqdm=False)
    stats = llm.stats()
    assert stats["num_requests"] == 0 and stats["num_free_blocks"] == stats["num_blocks"]
    out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_stats_has_the_documented_keys(llm) -> None:
    stats = llm.stats()
    for key in ("num_blocks", "num_free_blocks", "num_preemptions", "prefix_cache_hit_rate"):
        assert key in stats


def test_cli_generate_prints_the_completion(model_dir) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "pagedcore", "generate", "What is the capital of France?", "--chat",
         "--max-tokens", "12", "--model", model_dir],
        capture_output=True, text=True, timeout=300, check=True,
    )
    assert out.stdout.strip() == "The capital of France is Paris."
