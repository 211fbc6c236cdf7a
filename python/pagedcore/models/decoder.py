"""The decoder-only transformer of the Llama family over the paged KV cache.

Llama 2/3 (and SmolLM2), Mistral, Qwen2/2.5 and Qwen3 differ only in details
that :class:`~pagedcore.models.spec.ModelSpec` names (q/k/v biases, q/k norms,
rotary scaling, sliding window), so one implementation serves them all.

Inputs are flat: the tokens of every sequence of the step one after another
(no batch dimension, no padding). Attention reads and writes the paged cache
through :mod:`pagedcore.ops`. The arithmetic follows Hugging Face's modules
operation for operation (RMSNorm in float32, rotate-half rotary, the same
residual order, the same rounding points in the activation dtype), so that
float32 results agree with transformers. The elementwise work runs in the fused
kernels of :mod:`pagedcore.ops` (RMSNorm fused with the residual add, rotary from
a table computed once, SiLU-and-multiply); the residual is carried between layers
as vLLM does (each layer returns ``(hidden, residual)`` and the next norm adds them).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .. import ops
from ..model_loader import kv_scale_name
from .spec import ModelSpec


@dataclass
class AttentionMetadata:
    """Where this step's tokens go in the paged cache and what they attend to.

    Shapes: ``slot_mapping [num_tokens]``, ``block_tables [num_seqs,
    max_blocks]``, ``seq_lens [num_seqs]`` (tokens cached after this step),
    ``query_start_loc [num_seqs + 1]``; all int32 on the model's device.
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    plan: ops.AttentionPlan | None = None  # CUDA: the step's work split, shared by all layers


def _ops_linear(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``x @ weight.T`` goes to :func:`pagedcore.ops.linear` (else torch)."""
    if weight.device.type == "cpu":
        return x.shape[0] <= ops.LINEAR_MAX_ROWS and weight.dtype == torch.float32
    return ops.cuda_linear_eligible(x, weight)


def _linear(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``layer(x)``; the few rows of a decode step through :func:`pagedcore.ops.linear`,
    which reads the weights at memory speed where the GEMM libraries do not (MKL's
    float32 product at a few CPU rows; cuBLAS, latency-bound, at one CUDA row)."""
    if _ops_linear(x, layer.weight):
        return ops.linear(x, layer.weight, layer.bias)
    return layer(x)


class RMSNorm(nn.Module):
    """Hugging Face's RMSNorm through :func:`pagedcore.ops.rms_norm` (one kernel)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps, out=out)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual += x`` then ``x = norm(residual)``, in place (one kernel); returns ``x``."""
        ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
        return x


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        h, d = spec.hidden_size, spec.head_dim
        self.spec = spec
        self.input_layernorm = RMSNorm(h, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, spec.rms_norm_eps)
        # q, k and v projections fused into one matrix: one GEMM instead of three.
        self.qkv_proj = nn.Linear(h, spec.q_size + 2 * spec.kv_size, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(spec.q_size, h, bias=spec.o_bias)
        self.gate_up_proj = nn.Linear(h, 2 * spec.intermediate_size, bias=spec.mlp_bias)
        self.down_proj = nn.Linear(spec.intermediate_size, h, bias=spec.mlp_bias)
        if spec.qk_norm:
            self.q_norm = RMSNorm(d, spec.rms_norm_eps)
            self.k_norm = RMSNorm(d, spec.rms_norm_eps)
        self.scale = d**-0.5
        # Per-tensor scales of an fp8 KV cache: it stores k / k_scale and v / v_scale.
        # Plain floats, baked into captured CUDA graphs: set them before capture
        # (checkpoint tensors in load_weights, else the engine's calculated scales).
        # Caches of the model's dtype ignore them.
        self.k_scale = 1.0
        self.v_scale = 1.0
        for p in self.parameters():
            p.requires_grad_(False)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        cos_sin_cache: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        md: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer, vLLM's way: returns ``(hidden, residual)`` with the layer's
        residual add left to the next norm (``hidden + residual`` is HF's output).
        ``residual`` is None for the first layer (``hidden`` is then the embeddings).
        A decode step runs about nine kernels here: norm, qkv GEMM, (q/k norm,)
        rotary + cache write, attention, o GEMM, add+norm, gate_up GEMM, SiLU-mul,
        down GEMM."""
        q, residual = self.pre_attention(positions, hidden, residual, cos_sin_cache, key_cache, value_cache,
                                         md.slot_mapping)
        attn = ops.paged_attention(
            q, key_cache, value_cache, md.block_tables, md.seq_lens, md.query_start_loc,
            scale=self.scale, sliding_window=self.spec.sliding_window, plan=md.plan, k_scale=self.k_scale,
            v_scale=self.v_scale,
        )
        return self.post_attention(attn, residual)

    def pre_attention(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        cos_sin_cache: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        qkv_out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer up to attention: input norm (with the previous layer's residual
        add), qkv GEMM (into ``qkv_out`` ``[T, q_size + 2 * kv_size]`` when given),
        q/k norm, rotary and the cache write of k and v. Returns ``(q [T, heads,
        head_dim], residual)``; q is a view into the qkv output."""
        spec = self.spec
        t = hidden.shape[0]
        if residual is None:
            residual = hidden
            x = self.input_layernorm(hidden)
        else:
            x = self.input_layernorm.add_forward(hidden, residual)
        if qkv_out is None:
            qkv = _linear(self.qkv_proj, x)
        elif self.qkv_proj.bias is not None:  # (what F.linear runs, into a given buffer)
            qkv = torch.addmm(self.qkv_proj.bias, x, self.qkv_proj.weight.t(), out=qkv_out)
        else:
            qkv = torch.mm(x, self.qkv_proj.weight.t(), out=qkv_out)
        q, k, v = qkv.split([spec.q_size, spec.kv_size, spec.kv_size], dim=-1)
        q = q.view(t, spec.num_heads, spec.head_dim)
        k = k.view(t, spec.num_kv_heads, spec.head_dim)
        v = v.view(t, spec.num_kv_heads, spec.head_dim)
        if spec.qk_norm:  # Qwen3: per head, in place inside qkv
            self.q_norm(q, out=q)
            self.k_norm(k, out=k)
        # Rotary on q and k in place, and the cache write of k and v, in one kernel.
        ops.rotary_embedding(positions, q, k, cos_sin_cache, value=v, key_cache=key_cache,
                             value_cache=value_cache, slot_mapping=slot_mapping, k_scale=self.k_scale,
                             v_scale=self.v_scale)
        return q, residual

    def post_attention(self, attn: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer after attention (``attn`` ``[T, heads, head_dim]``): o GEMM,
        add+norm, gate_up GEMM, SiLU-mul, down GEMM. Returns ``(hidden, residual)``."""
        hidden = self.reduce(_linear(self.o_proj, attn.reshape(attn.shape[0], self.spec.q_size)))
        x = self.post_attention_layernorm.add_forward(hidden, residual)
        gate_up = self.gate_up_proj
        if x.device.type == "cuda" and _ops_linear(x, gate_up.weight):
            # (a decode step of 1-16 rows: the product and SiLU-mul in one kernel)
            act = ops.linear_silu_and_mul(x, gate_up.weight, gate_up.bias)
        else:
            act = ops.silu_and_mul(_linear(gate_up, x))
        return self.reduce(_linear(self.down_proj, act)), residual

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """The sum over tensor-parallel ranks of a row-parallel projection's output
        (o, down); one rank holds the whole layer here, so it is ``partial`` itself
        (:class:`pagedcore.models.parallel.ParallelDecoderLayer` all-reduces)."""
        return partial


class CausalLM(nn.Module):
    """A Llama-family causal LM over the paged KV cache.

    Examples
    --------
    >>> model = CausalLM(spec)                       # doctest: +SKIP
    >>> model.load_weights(iter_safetensors(path))   # doctest: +SKIP
    >>> hidden = model(input_ids, positions, md, kv_caches)
    >>> logits = model.compute_logits(hidden[sample_indices])
    """

    # The layer class (tensor parallelism substitutes one whose projections all-reduce).
    decoder_layer: type[DecoderLayer] = DecoderLayer

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(self.decoder_layer(spec) for _ in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        if not spec.tie_word_embeddings:
            self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        self.register_buffer("inv_freq", spec.inv_freq(), persistent=False)
        # Rotary cos/sin table (float32; a plain attribute, so that .to(dtype) keeps
        # it float32): made by init_rotary, else at the first forward.
        self.cos_sin_cache: torch.Tensor | None = None
        # Whether load_weights found fp8 KV-cache scales (k_scale / v_scale) in the checkpoint.
        self.checkpoint_kv_scales = False
        for p in self.parameters():
            p.requires_grad_(False)

    @property
    def dtype(self) -> torch.dtype:
        """The weights' (and activations') dtype."""
        return self.embed_tokens.weight.dtype

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.spec.tie_word_embeddings else self.lm_head.weight

    def rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[num_tokens, 1, head_dim]`` for the given positions."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]

    @property
    def max_positions(self) -> int:
        """Positions the rotary table covers (``spec.max_position_embeddings`` until
        :meth:`init_rotary` is called)."""
        table = self.cos_sin_cache
        return self.spec.max_position_embeddings if table is None else table.shape[0]

    def init_rotary(self, max_positions: int) -> None:
        """Computes the rotary cos/sin table the layers read (float32 ``[max_positions,
        head_dim]``, :func:`pagedcore.ops.cos_sin_cache`) once, on the weights' device,
        from :meth:`ModelSpec.inv_freq` (rope scaling applied) with the arithmetic of
        :meth:`rotary`. Positions must stay below ``max_positions``; call before CUDA
        graphs are captured (they hold its address)."""
        device = self.embed_tokens.weight.device
        self.cos_sin_cache = ops.cos_sin_cache(self.spec.inv_freq().to(device), max_positions)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        md: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """Final hidden states ``[num_tokens, hidden_size]`` of the step's tokens.

        ``input_ids`` and ``positions`` are ``[num_tokens]``; ``kv_caches`` holds
        one ``(key_cache, value_cache)`` pair per layer, each ``[num_blocks,
        block_size, num_kv_heads, head_dim]``.
        """
        table = self.cos_sin_cache
        if table is None or table.device != self.embed_tokens.weight.device:
            self.init_rotary(self.spec.max_position_embeddings)
            table = self.cos_sin_cache
        hidden = self.embed(input_ids)
        residual = None
        for layer, (key_cache, value_cache) in zip(self.layers, kv_caches):
            hidden, residual = layer(positions, hidden, residual, table, key_cache, value_cache, md)
        if residual is None:  # no layers
            return self.norm(hidden)
        return self.norm.add_forward(hidden, residual)

    def embed(self, input_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The embeddings ``[num_tokens, hidden_size]`` of ``input_ids`` (into ``out`` when given)."""
        return torch.index_select(self.embed_tokens.weight, 0, input_ids, out=out)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits ``[rows, vocab_size]`` of the given hidden rows."""
        weight = self.lm_head_weight
        if _ops_linear(hidden, weight):
            return ops.linear(hidden, weight).float()
        return F.linear(hidden, weight).float()

    # ---- weights ------------------------------------------------------------

    @torch.no_grad()
    def init_dummy_weights(self, seed: int = 0) -> None:
        """Random weights for benchmarks (vLLM's ``load_format="dummy"``): every
        matrix and bias uniform in [-1e-3, 1e-3), norm weights 1. Seeded; drawn on
        the parameters' device."""
        g = torch.Generator(device=self.embed_tokens.weight.device).manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.rand(p.shape, generator=g, device=p.device, dtype=torch.float32)
                        .mul_(2e-3).sub_(1e-3).to(p.dtype))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copies Hugging Face-named tensors into the (fused) parameters.

        Raises
        ------
        ValueError
            For an unexpected tensor name or shape, or when a parameter
            received no weight.
        """
        spec = self.spec
        fused = {  # HF projection -> (fused parameter, row offset, rows)
            "self_attn.q_proj": ("qkv_proj", 0, spec.q_size),
            "self_attn.k_proj": ("qkv_proj", spec.q_size, spec.kv_size),
            "self_attn.v_proj": ("qkv_proj", spec.q_size + spec.kv_size, spec.kv_size),
            "mlp.gate_proj": ("gate_up_proj", 0, spec.intermediate_size),
            "mlp.up_proj": ("gate_up_proj", spec.intermediate_size, spec.intermediate_size),
        }
        renamed = {
            "self_attn.o_proj": "o_proj",
            "mlp.down_proj": "down_proj",
            "self_attn.q_norm": "q_norm",
            "self_attn.k_norm": "k_norm",
        }
        params = dict(self.named_parameters())
        filled: dict[str, int] = {name: 0 for name in params}
        for name, tensor in weights:
            if name.startswith("model."):
                name = name[len("model.") :]
            if name == "lm_head.weight" and spec.tie_word_embeddings:
                continue  # tied: the embedding serves as the head
            if "rotary_emb" in name:
                continue
            scale = kv_scale_name(name)
            if scale is not None:
                self._load_kv_scale(name, scale, tensor)
                continue
            target, offset, rows = name, None, None
            if name.startswith("layers."):
                _, index, rest = name.split(".", 2)
                module, _, kind = rest.rpartition(".")
                if module in fused:
                    fused_name, offset, rows = fused[module]
                    target = f"layers.{index}.{fused_name}.{kind}"
                elif module in renamed:
                    target = f"layers.{index}.{renamed[module]}.{kind}"
            if target not in params:
                raise ValueError(f"unexpected weight '{name}' in the checkpoint")
            param = params[target]
            dest = param.data if offset is None else param.data.narrow(0, offset, rows)
            if dest.shape != tensor.shape:
                raise ValueError(
                    f"weight '{name}' has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}"
                )
            dest.copy_(tensor)
            filled[target] += dest.numel()
        missing = [n for n, p in params.items() if filled[n] != p.numel()]
        if missing:
            raise ValueError(f"the checkpoint has no (or partial) weights for {missing[:5]}")

    def _load_kv_scale(self, name: str, scale: tuple[int, str], tensor: torch.Tensor) -> None:
        """Sets a layer's fp8 KV-cache scale(s) from a checkpoint tensor (see kv_scale_name)."""
        index, which = scale
        if not 0 <= index < len(self.layers):
            raise ValueError(f"unexpected weight '{name}' in the checkpoint: the model has {len(self.layers)} layers")
        if which == "unused":  # a query or softmax scale (fp8 attention): not the cache's
            return
        if tensor.numel() != 1:
            raise ValueError(f"KV-cache scale '{name}' must hold one value (per-tensor), got shape "
                             f"{tuple(tensor.shape)}")
        value = float(tensor.float().reshape(()))
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"KV-cache scale '{name}' must be finite and > 0, got {value}")
        layer = self.layers[index]
        if which in ("k", "kv"):
            layer.k_scale = value
        if which in ("v", "kv"):
            layer.v_scale = value
        self.checkpoint_kv_scales = True
