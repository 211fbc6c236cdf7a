"""load_format="dummy": random weights in a checkpoint's shape, from config.json
alone. The weights follow the documented distribution (uniform in [-1e-3,
1e-3), norm weights 1, seeded), and generation with them equals transformers
run on the very same weights, copied out of the pagedcore model."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from pagedcore import LLM, SamplingParams  # noqa: E402
from test_gpu_path import add_toy_tokenizer  # noqa: E402
from test_models_hf import COMMON, make_checkpoint, prompts  # noqa: E402

NEW_TOKENS = 8


@pytest.fixture(scope="module")
def config_only(tmp_path_factory):
    path = make_checkpoint("llama", tmp_path_factory.mktemp("dummy"))
    add_toy_tokenizer(path, COMMON["vocab_size"])
    for f in path.glob("*.safetensors"):
        f.unlink()
    return path


def dummy_llm(path, seed: int) -> LLM:
    return LLM(model=str(path), device="cpu", dtype="float32", load_format="dummy", seed=seed,
               num_kv_blocks=64, max_model_len=128)


@pytest.fixture(scope="module")
def llm(config_only) -> LLM:
    return dummy_llm(config_only, seed=3)


def weights(llm: LLM) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in llm.llm_engine.model.named_parameters()}


def test_dummy_weights_follow_the_documented_distribution(llm, config_only) -> None:
    ours = weights(llm)
    spec = llm.llm_engine.spec
    hidden, layers = COMMON["hidden_size"], COMMON["num_hidden_layers"]
    expected_shapes = {
        "embed_tokens.weight": (COMMON["vocab_size"], hidden),
        "lm_head.weight": (COMMON["vocab_size"], hidden),
        "norm.weight": (hidden,),
    }
    qkv = spec.q_size + 2 * spec.kv_size
    for i in range(layers):
        expected_shapes |= {
            f"layers.{i}.input_layernorm.weight": (hidden,),
            f"layers.{i}.post_attention_layernorm.weight": (hidden,),
            f"layers.{i}.qkv_proj.weight": (qkv, hidden),
            f"layers.{i}.qkv_proj.bias": (qkv,),  # attention_bias=True in this checkpoint
            f"layers.{i}.o_proj.weight": (hidden, spec.q_size),
            f"layers.{i}.o_proj.bias": (hidden,),
            f"layers.{i}.gate_up_proj.weight": (2 * COMMON["intermediate_size"], hidden),
            f"layers.{i}.down_proj.weight": (hidden, COMMON["intermediate_size"]),
        }
    assert {n: tuple(t.shape) for n, t in ours.items()} == expected_shapes
    for name, t in ours.items():
        assert t.dtype == torch.float32, name
        if name.endswith("norm.weight"):
            assert torch.equal(t, torch.ones_like(t)), name
            continue
        assert t.min() >= -1e-3 and t.max() < 1e-3, name
        assert (t != 0).float().mean() > 0.99, name  # not zeros, not a constant
        if t.numel() >= 16384:
            # U(-a, a): mean 0, standard deviation a / sqrt(3); both within a few
            # standard errors (these tensors have 16k-98k elements).
            assert abs(t.mean().item()) < 2e-5, name
            assert t.std().item() == pytest.approx(1e-3 / 3**0.5, rel=0.02), name
    # Seeded: the same seed gives the same weights, another seed others.
    same, other = weights(dummy_llm(config_only, seed=3)), weights(dummy_llm(config_only, seed=4))
    for name, t in ours.items():
        assert torch.equal(same[name], t), name
        if not name.endswith("norm.weight"):
            assert not torch.equal(other[name], t), name


def hf_model_with(llm: LLM):
    """A transformers Llama holding the pagedcore model's weights, unfused by hand."""
    config = transformers.LlamaConfig(**{**COMMON, "attention_bias": True})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    ours = weights(llm)
    q = COMMON["num_attention_heads"] * COMMON["head_dim"]
    kv = COMMON["num_key_value_heads"] * COMMON["head_dim"]
    inter = COMMON["intermediate_size"]
    state = {
        "model.embed_tokens.weight": ours["embed_tokens.weight"],
        "model.norm.weight": ours["norm.weight"],
        "lm_head.weight": ours["lm_head.weight"],
    }
    for i in range(COMMON["num_hidden_layers"]):
        pre, hf = f"layers.{i}.", f"model.layers.{i}."
        for kind in ("weight", "bias"):
            fused = ours[f"{pre}qkv_proj.{kind}"]
            state[f"{hf}self_attn.q_proj.{kind}"] = fused[:q]
            state[f"{hf}self_attn.k_proj.{kind}"] = fused[q: q + kv]
            state[f"{hf}self_attn.v_proj.{kind}"] = fused[q + kv:]
            state[f"{hf}self_attn.o_proj.{kind}"] = ours[f"{pre}o_proj.{kind}"]
        state[f"{hf}mlp.gate_proj.weight"] = ours[f"{pre}gate_up_proj.weight"][:inter]
        state[f"{hf}mlp.up_proj.weight"] = ours[f"{pre}gate_up_proj.weight"][inter:]
        state[f"{hf}mlp.down_proj.weight"] = ours[f"{pre}down_proj.weight"]
        state[f"{hf}input_layernorm.weight"] = ours[f"{pre}input_layernorm.weight"]
        state[f"{hf}post_attention_layernorm.weight"] = ours[f"{pre}post_attention_layernorm.weight"]
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary_emb" in m for m in missing), (missing, unexpected)
    return model.eval()


def test_dummy_generation_equals_transformers_on_the_same_weights(llm) -> None:
    hf = hf_model_with(llm)
    hf.generation_config.eos_token_id = None  # ignore_eos
    ps = prompts()
    outs = llm.generate([{"prompt_token_ids": p} for p in ps],
                        SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=3),
                        use_tqdm=False)
    for p, out in zip(ps, outs):
        x = torch.tensor([p])
        ref = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=NEW_TOKENS,
                          pad_token_id=0, return_dict_in_generate=True, output_logits=True)
        got = out.outputs[0]
        assert got.token_ids == ref.sequences[0, len(p):].tolist(), f"prompt of {len(p)} tokens"
        ref_logprobs = torch.log_softmax(torch.stack(ref.logits, dim=1)[0], dim=-1)
        for step, (token, entry) in enumerate(zip(got.token_ids, got.logprobs)):
            assert entry[token].logprob == pytest.approx(ref_logprobs[step, token].item(), abs=1e-5)
    # Near-uniform logits (weights of 1e-3): yet not all alike, or the argmax is arbitrary.
    assert len({t for o in outs for t in o.outputs[0].token_ids}) > 1


def test_unknown_load_format_is_refused(config_only) -> None:
    with pytest.raises(ValueError, match="load_format must be 'auto', 'safetensors' or 'dummy', got 'pt'"):
        LLM(model=str(config_only), device="cpu", load_format="pt")
