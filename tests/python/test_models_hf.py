"""Every supported architecture against Hugging Face transformers on the same
(tiny, random) weights, in float32 on the CPU: the same greedy tokens for a
batch of prompts of different lengths, close log-probabilities, and outputs
that do not change with prefix caching, chunked prefill or preemption."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from pagedcore import LLM, SamplingParams  # noqa: E402

VOCAB = 384
NEW_TOKENS = 32
PROMPT_LENS = (3, 17, 40, 77)

COMMON = dict(
    vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
    rms_norm_eps=1e-6, initializer_range=0.2, tie_word_embeddings=False,
    bos_token_id=1, eos_token_id=2, pad_token_id=0,
)
CONFIGS = {
    "llama": ("LlamaConfig", {"attention_bias": True}),
    "llama3-rope": (
        "LlamaConfig",
        {
            "rope_parameters": {
                "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
            },
            "tie_word_embeddings": True,
        },
    ),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {}),
    "mistral": ("MistralConfig", {"sliding_window": 24}),
}


def make_checkpoint(name: str, root: Path) -> Path:
    cls_name, extra = CONFIGS[name]
    config = getattr(transformers, cls_name)(**{**COMMON, **extra})
    torch.manual_seed(1234)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # transformers initialises biases to zero: give them values, or a bias dropped
    # anywhere (llama's attention_bias, Qwen2's q/k/v biases) would go unnoticed.
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param_name.endswith(".bias"):
                param.normal_(0.0, 0.2)
    path = root / name
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tokenizer_dir() -> str:
    from pagedcore import default_model_path

    return default_model_path()


@pytest.fixture(scope="module", params=list(CONFIGS))
def checkpoint(request, tmp_path_factory) -> tuple[str, Path]:
    return request.param, make_checkpoint(request.param, tmp_path_factory.mktemp("ckpt"))


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENS]


def hf_greedy(path: Path, prompt: list[int], new_tokens: int) -> tuple[list[int], torch.Tensor]:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    # No EOS at all, as ignore_eos: EOS may be the argmax (min_new_tokens would mask it).
    model.generation_config.eos_token_id = None
    out = model.generate(
        torch.tensor([prompt]), do_sample=False, max_new_tokens=new_tokens,
        return_dict_in_generate=True, output_logits=True, pad_token_id=0,
    )
    logprobs = torch.log_softmax(torch.stack(out.logits, dim=1)[0].float(), dim=-1)
    return out.sequences[0, len(prompt):].tolist(), logprobs


def greedy(n: int = NEW_TOKENS, logprobs: int | None = None) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=logprobs)


def run(llm: LLM, ps: list[list[int]], params: SamplingParams):
    return llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)


def test_same_greedy_tokens_and_close_logprobs(checkpoint, tokenizer_dir) -> None:
    name, path = checkpoint
    ps = prompts()
    llm = LLM(model=str(path), tokenizer=tokenizer_dir, num_kv_blocks=256, max_model_len=256)
    outs = run(llm, ps, greedy(logprobs=5))
    for prompt, out in zip(ps, outs):
        expected, hf_logprobs = hf_greedy(path, prompt, NEW_TOKENS)
        got = out.outputs[0]
        assert got.token_ids == expected, f"{name}: prompt of {len(prompt)} tokens"
        for step, entry in enumerate(got.logprobs):
            top = sorted(entry.items(), key=lambda kv: -kv[1].logprob)[:5]
            ref_values, ref_ids = hf_logprobs[step].topk(5)
            assert [t for t, _ in top] == ref_ids.tolist(), f"{name} step {step}"
            ours = torch.tensor([lp.logprob for _, lp in top])
            torch.testing.assert_close(ours, ref_values, atol=2e-4, rtol=0)
    assert llm.stats()["num_free_blocks"] == llm.stats()["num_blocks"]


@pytest.mark.parametrize(
    "variant",
    ["no-prefix-cache", "chunked-prefill", "preempt-recompute", "preempt-swap"],
)
def test_paging_never_changes_greedy_outputs(variant, tokenizer_dir, tmp_path) -> None:
    path = make_checkpoint("mistral", tmp_path)  # sliding window: the hardest case
    ps = prompts() + prompts()[:2]  # repeated prompts: prefix-cache hits
    reference = LLM(model=str(path), tokenizer=tokenizer_dir, num_kv_blocks=256, max_model_len=256)
    expected = [o.outputs[0].token_ids for o in run(reference, ps, greedy())]
    kwargs = dict(model=str(path), tokenizer=tokenizer_dir, max_model_len=256, num_kv_blocks=256)
    if variant == "no-prefix-cache":
        kwargs["enable_prefix_caching"] = False
    elif variant == "chunked-prefill":
        kwargs["max_num_batched_tokens"] = 16
    else:
        kwargs.update(num_kv_blocks=14, max_model_len=128, preemption_mode=variant.split("-")[1])
        if variant == "preempt-swap":
            kwargs["swap_space"] = 0.01
    llm = LLM(**kwargs)
    got = [o.outputs[0].token_ids for o in run(llm, ps, greedy())]
    assert got == expected
    stats = llm.stats()
    if variant.startswith("preempt"):
        assert stats["num_preemptions"] > 0
        if variant == "preempt-swap":
            assert stats["num_swap_preemptions"] > 0
    if variant != "no-prefix-cache":
        assert stats["prefix_cache_hits"] > 0
    assert stats["num_free_blocks"] == stats["num_blocks"]


def test_unsupported_architecture_names_the_supported_ones(tmp_path) -> None:
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"):
        LLM(model=str(tmp_path), num_kv_blocks=16)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs_close_to_float32(dtype, tokenizer_dir, tmp_path) -> None:
    path = make_checkpoint("qwen3", tmp_path)
    ps = prompts()
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)
    ref = LLM(model=str(path), tokenizer=tokenizer_dir, num_kv_blocks=64, max_model_len=256)
    half = LLM(model=str(path), tokenizer=tokenizer_dir, num_kv_blocks=64, max_model_len=256, dtype=dtype)
    assert half.llm_engine.runner.kv_caches[0][0].dtype == getattr(torch, dtype)
    for a, b in zip(run(ref, ps, params), run(half, ps, params)):
        lp_a, lp_b = a.outputs[0].logprobs[0], b.outputs[0].logprobs[0]
        best = a.outputs[0].token_ids[0]
        assert best in lp_b  # the float32 choice is in the half-precision top 5
        assert abs(lp_a[best].logprob - lp_b[best].logprob) < 0.1
