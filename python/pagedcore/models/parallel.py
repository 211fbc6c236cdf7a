"""Tensor-parallel (Megatron) shards of the decoder.

Each of N ranks holds a slice of every layer and runs the same forward pass on
the same tokens; two all-reduces per layer and one gather at the head make the
ranks' results whole:

- q/k/v and gate/up are column-parallel: rank r keeps its heads of q (``H / N``
  of them), the kv heads those q heads read, and ``I / N`` rows of gate and of
  up. The fused parameters are split part by part (rank r's q rows, then its k
  rows, then its v rows), never as one concatenation, so that the local matrix
  is again ``[q | k | v]`` and the decoder's split works unchanged.
- o and down are row-parallel: rank r keeps the input columns that match its
  heads / its intermediate rows; the partial outputs are all-reduced
  (:meth:`ParallelDecoderLayer.reduce`). A bias of o or down is held by rank 0
  only (zeros elsewhere), so the sum adds it once.
- The embedding and the LM head are vocabulary-parallel: rank r keeps
  ``ceil(V / N)`` rows (the last rank's tail zero-padded). An embedding looks up
  the ids of its range, zeroes the others and all-reduces (exactly one rank
  contributes each row, so the result is bit-for-bit the unsharded one); the
  head computes the logits of its rows and all-gathers them.
- KV heads: split when ``num_kv_heads % N == 0``; when ``N % num_kv_heads == 0``
  (fewer kv heads than ranks) each rank keeps the one kv head its q heads read,
  replicated over ``N / num_kv_heads`` ranks (vLLM's rule). Beyond vLLM, more kv
  heads than ranks that N does not divide (SmolLM2's 3 over 2 ranks: 1 + 2) are
  split unevenly by whole kv heads, each with its q heads, the larger shares on
  the last ranks (rank 0 also samples; ranks then differ in shape and work); fewer kv heads than ranks that do not divide N are refused.
  Each rank's KV cache holds its own kv heads; the block tables are the same on
  every rank.

The per-rank :class:`ModelSpec` (``TensorParallelShard.local_spec``) has the
local head counts and intermediate size, so the decoder, the KV-cache layout and
the attention plans see an ordinary smaller model; its ``vocab_size`` stays the
whole vocabulary (the logits are gathered whole).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .. import ops
from .decoder import CausalLM, DecoderLayer, _ops_linear
from .spec import ModelSpec


def check_tensor_parallel(spec: ModelSpec, size: int) -> None:
    """Raises ValueError, naming the field, when ``spec`` cannot be split over
    ``size`` ranks."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {size!r}")
    kv, heads = spec.num_kv_heads, spec.num_heads
    if kv < size and (size % kv or heads % size):
        raise ValueError(
            f"{spec.architecture} has {kv} kv heads and {heads} attention heads: fewer kv heads than "
            f"tensor_parallel_size {size} are replicated only when num_key_value_heads divides it and it "
            f"divides num_attention_heads"
        )
    if spec.intermediate_size % size:
        raise ValueError(f"tensor_parallel_size {size} does not divide intermediate_size "
                         f"({spec.intermediate_size}) of {spec.architecture}")


@dataclass(frozen=True)
class TensorParallelShard:
    """What rank ``rank`` of ``size`` holds of a model with ``spec``.

    With at least as many kv heads as ranks, rank r holds a contiguous run of kv
    heads (``kv // size``, one more for the last ``kv % size`` ranks: an even
    split when ``size`` divides them, else as even as whole heads allow) and the
    q heads that read them. With fewer, the q heads are split evenly and each
    rank keeps the one kv head they read.
    """

    spec: ModelSpec
    rank: int
    size: int

    def __post_init__(self) -> None:
        check_tensor_parallel(self.spec, self.size)
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} outside 0..{self.size - 1}")

    @property
    def replicated_kv(self) -> bool:
        return self.spec.num_kv_heads < self.size

    @property
    def group(self) -> int:
        """q heads per kv head."""
        return self.spec.num_heads // self.spec.num_kv_heads

    @property
    def num_kv_heads(self) -> int:
        if self.replicated_kv:
            return 1
        kv, size = self.spec.num_kv_heads, self.size
        # NOTE: the extra heads of an uneven split go to the last ranks: rank 0
        # also schedules and samples.
        return kv // size + (1 if self.rank >= size - kv % size else 0)

    @property
    def kv_head_start(self) -> int:
        if self.replicated_kv:
            return self.head_start // self.group  # the kv head this rank's q heads read
        kv, size = self.spec.num_kv_heads, self.size
        return self.rank * (kv // size) + max(0, self.rank - (size - kv % size))

    @property
    def num_heads(self) -> int:
        if self.replicated_kv:
            return self.spec.num_heads // self.size
        return self.num_kv_heads * self.group

    @property
    def head_start(self) -> int:
        if self.replicated_kv:
            return self.rank * self.num_heads
        return self.kv_head_start * self.group

    @property
    def intermediate_size(self) -> int:
        return self.spec.intermediate_size // self.size

    @property
    def vocab_rows(self) -> int:
        """Rows of the embedding / LM head per rank (the vocabulary padded to a multiple of ``size``)."""
        return -(-self.spec.vocab_size // self.size)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_rows

    @property
    def local_spec(self) -> ModelSpec:
        return dataclasses.replace(self.spec, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                                   intermediate_size=self.intermediate_size)

    def weight_slice(self, name: str, shape: tuple[int, ...]) -> tuple[int, int, int] | None | str:
        """How this rank reads the checkpoint tensor ``name`` (``model.`` prefix
        stripped) of ``shape``: ``(dim, start, stop)``, None (whole), or ``"rank0"``
        (a row-parallel bias: whole on rank 0, zeros elsewhere)."""
        d = self.spec.head_dim
        if name in ("embed_tokens.weight", "lm_head.weight"):
            return (0, self.vocab_start, min(self.vocab_start + self.vocab_rows, shape[0]))
        if not name.startswith("layers."):
            return None
        module, _, kind = name.split(".", 2)[2].rpartition(".")
        if module == "self_attn.q_proj":
            return (0, self.head_start * d, (self.head_start + self.num_heads) * d)
        if module in ("self_attn.k_proj", "self_attn.v_proj"):
            return (0, self.kv_head_start * d, (self.kv_head_start + self.num_kv_heads) * d)
        if module in ("mlp.gate_proj", "mlp.up_proj"):
            start = self.rank * self.intermediate_size
            return (0, start, start + self.intermediate_size)
        if module == "self_attn.o_proj" or module == "mlp.down_proj":
            if kind == "bias":
                return "rank0"
            if module == "self_attn.o_proj":
                return (1, self.head_start * d, (self.head_start + self.num_heads) * d)
            start = self.rank * self.intermediate_size
            return (1, start, start + self.intermediate_size)
        return None


class ParallelDecoderLayer(DecoderLayer):
    """A decoder layer whose o and down projections are row-parallel: their
    partial outputs are summed over the ranks (one all-reduce each)."""

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        from ..distributed.group import get_tp_group

        return get_tp_group().all_reduce(partial)


class ParallelCausalLM(CausalLM):
    """Rank ``shard.rank``'s part of a :class:`CausalLM` (see the module docstring).

    ``spec`` is the shard's ``local_spec``. Forward passes must run on every rank
    at once, with the same inputs (their collectives pair up); ``compute_logits``
    returns the whole vocabulary's logits on every rank.
    """

    decoder_layer = ParallelDecoderLayer

    def __init__(self, shard: TensorParallelShard) -> None:
        super().__init__(dataclasses.replace(shard.local_spec, vocab_size=shard.vocab_rows))
        self.spec = shard.local_spec  # the whole vocabulary's size: the logits are gathered whole
        self.shard = shard

    def embed(self, input_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        from ..distributed.group import get_tp_group

        local = input_ids - self.shard.vocab_start
        outside = (local < 0) | (local >= self.shard.vocab_rows)
        # Another rank's id reads row 0 here, then its row is zeroed: only the
        # owner contributes to the sum, so each embedding is exact.
        hidden = torch.index_select(self.embed_tokens.weight, 0, local.masked_fill(outside, 0), out=out)
        hidden.masked_fill_(outside.unsqueeze(1), 0)
        summed = get_tp_group().all_reduce(hidden)
        if summed is not hidden:  # (a symmetric-memory all-reduce's new tensor; callers' out= holds the sum)
            hidden.copy_(summed)
        return hidden

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        from ..distributed.group import get_tp_group

        weight = self.lm_head_weight
        local = ops.linear(hidden, weight) if _ops_linear(hidden, weight) else F.linear(hidden, weight)
        rows, size = hidden.shape[0], self.shard.size
        gathered = get_tp_group().all_gather_rows(local)  # [size * rows, vocab_rows], rank-major
        logits = gathered.view(size, rows, -1).permute(1, 0, 2).reshape(rows, -1)
        return logits[:, :self.spec.vocab_size].float()
