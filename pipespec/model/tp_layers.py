"""Tensor-parallel layers: column- and row-parallel linear layers, the vocabulary-parallel embedding
and LM head, each loading only its own shard of the checkpoint.

- `ColumnParallelLinear` keeps a slice of the output rows of each of its parts (a fused q/k/v
  keeps its q heads and its k and v heads; a fused gate/up its slice of each), no collective.
- `RowParallelLinear` keeps the matching slice of the input columns and all-reduces its output (the
  bias, replicated, is added once after the sum).
- `VocabParallelEmbedding` / `ParallelLMHead` (in layers.py, beside `LMHead`) keep rows `[r * ceil(V/T), ...)` of the vocabulary; a
  lookup of a token another rank holds gives zeros here and the all-reduce fills it in; the head's
  logits are gathered in rank order, so every rank holds the same full-vocabulary logits and samples
  the same tokens (`pipespec.sampling` is a pure function of logits, seed and position).

A layer's `checkpoint_shards()` tells the loader (`weights.load_weights`) which slice of each
checkpoint tensor it reads: {param: Shard(dim, [(start, stop) per checkpoint part], pad)}. With
`TensorParallel()` (size 1) every layer is the plain layer it subclasses, shard = the whole tensor.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pipespec.model.linear import Linear, linear
from pipespec.parallel import TensorParallel

SINGLE = TensorParallel()      # size 1: holds no group and no state, safe to share


@dataclass(frozen=True)
class Shard:
    dim: int
    # per checkpoint part, concatenated along dim 0: (start, stop), or several (start, stop) pairs
    # concatenated (a tensor holding q, k and v heads one after the other, say)
    ranges: tuple
    sizes: tuple[int, ...]                # each part's full length along dim (dummy weights draw it whole)
    pad: bool = False                     # the parameter may be longer than the slice (vocab padding)


def kv_head_range(num_kv_heads: int, tp: TensorParallel) -> tuple[int, int]:
    """(first KV head, count) of this rank: split when there are at least T KV heads, else each rank
    keeps one, shared by T / num_kv_heads ranks (vLLM's replication)."""
    if num_kv_heads >= tp.size:
        return tp.split(num_kv_heads, "num_key_value_heads")
    if tp.size % num_kv_heads:
        raise ValueError(f"num_key_value_heads={num_kv_heads} is smaller than tensor_parallel_size="
                         f"{tp.size} and does not divide it, so the KV heads cannot be replicated evenly")
    return tp.rank // (tp.size // num_kv_heads), 1


class ColumnParallelLinear(Linear):
    """Output rows split: `parts` are (start, length) of this rank's rows of each fused part."""

    def __init__(self, in_features: int, parts: list[tuple[int, int]], bias: bool, sizes: list[int]):
        super().__init__(in_features, sum(n for _, n in parts), bias=bias)
        self.ranges = tuple((s, s + n) for s, n in parts)
        self.sizes = tuple(sizes)

    def checkpoint_shards(self) -> dict[str, Shard]:
        shard = Shard(0, self.ranges, self.sizes)
        return {"weight": shard, "bias": shard} if self.bias is not None else {"weight": shard}


def pairs(part_range) -> list[tuple[int, int]]:
    """A part's (start, stop) pairs (see `Shard.ranges`)."""
    return [part_range] if isinstance(part_range[0], int) else list(part_range)


class RowParallelLinear(nn.Linear):
    """Input columns split over the group; the output is all-reduced, then the bias added. With
    `reduce=False` it returns this rank's partial sum, for a caller that adds several partial sums
    and reduces once (an MoE's experts and its shared expert)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel, what: str,
                 reduce: bool = True):
        start, n = tp.split(in_features, what)
        super().__init__(n, out_features, bias=bias)
        if bias and not reduce and tp.size > 1:
            raise ValueError("a row-parallel layer that does not reduce cannot add its bias")
        self.tp, self.start, self.full, self.reduce = tp, start, in_features, reduce

    def forward(self, x: torch.Tensor, gated: bool = False) -> torch.Tensor:
        """gated: x is a fused gate/up row and the layer multiplies silu(gate) * up (`linear`)."""
        if self.tp.size == 1:
            return linear(x, self.weight, self.bias, gated)
        out = linear(x, self.weight, gated=gated)
        if not self.reduce:
            return out
        out = self.tp.all_reduce(out)
        return out if self.bias is None else out + self.bias

    def checkpoint_shards(self) -> dict[str, Shard]:
        return {"weight": Shard(1, ((self.start, self.start + self.in_features),), (self.full,))}


def vocab_shard(vocab: int, tp: TensorParallel) -> Shard:
    start, per = tp.vocab_range(vocab)
    return Shard(0, ((min(start, vocab), min(start + per, vocab)),), (vocab,), pad=True)


def vocab_embedding(input_ids: torch.Tensor, weight: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Rows of a vocabulary-sharded embedding `weight` (this rank's [ceil(V/T), H] slice): ids held
    elsewhere read zeros here, and the all-reduce sums in the one rank's row that holds each."""
    if tp.size == 1:
        return nn.functional.embedding(input_ids, weight)
    per = weight.shape[0]
    local = input_ids - tp.rank * per
    mine = (local >= 0) & (local < per)
    out = nn.functional.embedding(local.clamp(0, per - 1), weight)
    return tp.all_reduce(out * mine[:, None].to(out.dtype))


def gather_vocab(local_logits: torch.Tensor, tp: TensorParallel, vocab: int) -> torch.Tensor:
    """Full-vocabulary logits [N, V] from each rank's slice, in rank order (identical on every rank)."""
    if tp.size == 1:
        return local_logits
    return tp.all_gather(local_logits)[:, :vocab]


class VocabParallelEmbedding(nn.Embedding):
    def __init__(self, vocab: int, hidden: int, tp: TensorParallel = SINGLE):
        rows = tp.vocab_range(vocab)[1]
        super().__init__(rows, hidden)
        self.tp, self.vocab = tp, vocab

    def reset_parameters(self) -> None:
        # built on the meta device for the loader, there is nothing to draw; and drawing there would
        # import torch._dynamo (normal_ on meta runs a Python reference): seconds in every new process
        if not self.weight.is_meta:
            super().reset_parameters()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return vocab_embedding(input_ids, self.weight, self.tp)

    def checkpoint_shards(self) -> dict[str, Shard]:
        return {"weight": vocab_shard(self.vocab, self.tp)} if self.tp.size > 1 else {}


def qkv_parallel(hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, bias: bool,
                 tp: TensorParallel) -> tuple[ColumnParallelLinear, int, int]:
    """A fused q/k/v projection keeping this rank's heads; (layer, local heads, local KV heads)."""
    q0, nq = tp.split(num_heads, "num_attention_heads")
    k0, nk = kv_head_range(num_kv_heads, tp)
    d = head_dim
    layer = ColumnParallelLinear(hidden, [(q0 * d, nq * d), (k0 * d, nk * d), (k0 * d, nk * d)], bias,
                                 [num_heads * d, num_kv_heads * d, num_kv_heads * d])
    return layer, nq, nk


def expert_range(num_experts: int, tp: TensorParallel) -> tuple[int, int]:
    """(first expert, count) this rank holds: the routed experts are split across the TP group; each
    rank runs the tokens routed to its own and the partial outputs are summed by one all-reduce."""
    return tp.split(num_experts, "the number of routed experts")


def gate_up_parallel(hidden: int, intermediate: int, tp: TensorParallel,
                     what: str = "intermediate_size") -> tuple[ColumnParallelLinear, int]:
    """A fused gate/up projection keeping this rank's slice of each; (layer, local intermediate)."""
    s, n = tp.split(intermediate, what)
    return ColumnParallelLinear(hidden, [(s, n), (s, n)], False, [intermediate, intermediate]), n
