"""References and checks for the fused layer ops (pagedcore.ops.layer), shared by
test_layer_ops_cpu.py and test_layer_ops_cuda.py.

The references are the unfused arithmetic in float64, rounded to the activation dtype
exactly where Hugging Face's modules round (they compute op by op in that dtype):

* RMSNorm:  ``round(weight * round(x * rsqrt(mean(x^2) + eps)))``, with the residual
  sum ``round(residual + x)`` first for the fused add;
* rotary:   ``round(round(x * c) + round(rotate_half(x) * s))``, c and s rounded;
* SiLU-mul: ``round(round(silu(gate)) * up)``.

``round`` is a cast to the dtype (identity for float32). A kernel computes the
variance, rsqrt and exp in float32, so its results may differ from the float64
reference by a few units in the last place of the dtype, on few elements:
:func:`check` allows that and nothing more.
"""

from __future__ import annotations

import torch

NAN = float("nan")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def rnd(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float64 x rounded to dtype (and back to float64)."""
    return x.to(dtype).to(torch.float64)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """(normalised, new residual or None), float64, over the last dimension."""
    dtype = x.dtype
    h = x.double()
    new_residual = None
    if residual is not None:
        h = rnd(residual.double() + h, dtype)
        new_residual = h
    inv = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return rnd(weight.double() * rnd(h * inv, dtype), dtype), new_residual


def rotary_ref(x: torch.Tensor, positions: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] rotated, float64; table [P, D] float32 (cos | sin)."""
    dtype = x.dtype
    half = x.shape[-1] // 2
    rows = table[positions.long().cpu()].double()
    c = rnd(torch.cat((rows[:, :half], rows[:, :half]), -1), dtype)[:, None, :]
    s = rnd(torch.cat((rows[:, half:], rows[:, half:]), -1), dtype)[:, None, :]
    h = x.double()
    rotated = torch.cat((-h[..., half:], h[..., :half]), -1)
    return rnd(rnd(h * c, dtype) + rnd(rotated * s, dtype), dtype)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    dtype = x.dtype
    size = x.shape[-1] // 2
    g, u = x[:, :size].double(), x[:, size:].double()
    return rnd(rnd(g / (1 + torch.exp(-g)), dtype) * u, dtype)


def ulp(ref: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One unit in the last place of dtype at each value of ref (float64)."""
    info = torch.finfo(dtype)
    mag = ref.abs().clamp_min(info.tiny)
    return torch.exp2(torch.floor(torch.log2(mag))) * info.eps


def check(out: torch.Tensor, ref: torch.Tensor, *, ulps: float | None = None, max_off: float | None = None) -> None:
    """out (any device, its dtype) against the float64 reference: every element within
    ``ulps`` units in the last place, and at most a ``max_off`` fraction not equal to the
    reference rounded to the dtype (a rounding point skipped moves far more).

    Defaults: 16-bit dtypes 3 ulps and 2% (the float32 variance, rsqrt or exp tip the
    rounding of an intermediate now and then, and the weight or ``up`` factor that
    multiplies it scales that ulp); float32 4 ulps (rsqrt in float32 plus two
    roundings) and no limit on the fraction."""
    fp32 = out.dtype == torch.float32
    ulps = (4.0 if fp32 else 3.0) if ulps is None else ulps
    max_off = (1.0 if fp32 else 0.02) if max_off is None else max_off
    got = out.detach().cpu().double()
    assert not torch.isnan(got).any(), "NaN in the output (an element left unwritten?)"
    want = rnd(ref, out.dtype)
    err = (got - want).abs()
    bound = ulps * ulp(want, out.dtype)
    worst = float((err / bound).max()) if err.numel() else 0.0
    assert bool((err <= bound).all()), f"off by up to {worst * ulps:.2f} ulp (allowed {ulps})"
    off = float((err > 0).double().mean()) if err.numel() else 0.0
    assert off <= max_off, f"{off:.3%} of the elements differ from the reference (allowed {max_off:.1%})"


def llama_spec(rope_scaling: dict | None = None, *, theta: float = 10000.0, head_dim: int = 64,
               max_positions: int = 8192):
    """The ModelSpec of a Llama config with the given rope parameters."""
    import transformers
    from pagedcore.models import model_spec_from_config

    rope = {"rope_type": "default", "rope_theta": theta}
    if rope_scaling:
        rope.update(rope_scaling)
    config = transformers.LlamaConfig(
        architectures=["LlamaForCausalLM"], hidden_size=head_dim * 2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=head_dim, intermediate_size=64, num_hidden_layers=1,
        vocab_size=32, max_position_embeddings=max_positions, rope_parameters=rope,
    )
    return model_spec_from_config(config), config


LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 1024}


def qkv_views(tokens: int, heads: int, kv_heads: int, head_dim: int, dtype, device, pad: int = 0, seed: int = 0):
    """A fused qkv output [T, (heads + 2 kv_heads) * head_dim + pad] and its q, k, v views."""
    g = torch.Generator().manual_seed(seed)
    width = (heads + 2 * kv_heads) * head_dim + pad
    qkv = torch.randn(tokens, width, generator=g).to(dtype).to(device)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim : (heads + 2 * kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    return qkv, q, k, v


def assert_same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    """a equals b bit for bit (NaN included)."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    a, b = a.detach().cpu().contiguous(), b.detach().cpu().contiguous()
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a.view(ints[a.element_size()]), b.view(ints[b.element_size()]))


def rel_close_fp32(out: torch.Tensor, ref: torch.Tensor, ulps: float) -> None:
    got = out.detach().cpu().double()
    bound = ulps * ulp(ref, torch.float32) + 1e-30
    err = (got - ref).abs()
    assert bool((err <= bound).all()), f"off by up to {float((err / bound).max()) * ulps:.2f} ulp"

