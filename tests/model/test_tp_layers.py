"""Tensor-parallel layers load exactly their rank's shard, and only that part of the checkpoint; head
counts that do not split are refused by name. (Numerics across ranks: tests/engine/test_tensor_parallel.py.)"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from pipespec.model.llama import LlamaForCausalLM
from pipespec.checkpoint.source import resolve_model
from pipespec.model.tp_layers import kv_head_range
from pipespec.model.weights import load_weights
from pipespec.parallel import TensorParallel


class _Recording:
    """A weight source that counts whole-tensor reads and lazy-slice reads by name."""

    def __init__(self, source):
        self.source, self.whole, self.sliced = source, set(), set()

    def names(self):
        return self.source.names()

    def get(self, name):
        self.whole.add(name)
        return self.source.get(name)

    def get_slice(self, name):
        self.sliced.add(name)
        return self.source.get_slice(name)


def _load(folder, tp: TensorParallel, source=None):
    src = resolve_model(str(folder))
    model = LlamaForCausalLM(src.arch, tp=tp)
    load_weights(model, source or src.weights(), torch.float32, "cpu")
    return src.arch, model


@pytest.mark.parametrize("size", [2, 4])
def test_each_rank_holds_its_shard(tiny_models, size):
    """tiny llama: 4 heads, 2 KV heads, intermediate 96, vocab 49152. At TP = 4 each KV head is
    kept by two ranks (replicated)."""
    folder = tiny_models["llama"][0]
    arch, full = _load(folder, TensorParallel())
    f = dict(full.named_parameters())
    d, h = arch.head_dim, arch.num_heads // size
    for rank in range(size):
        tp = TensorParallel(rank, size)
        _, part = _load(folder, tp)
        p = dict(part.named_parameters())
        k0, nk = kv_head_range(arch.num_kv_heads, tp)
        assert nk == max(1, arch.num_kv_heads // size)
        q_size, kv_size = arch.num_heads * d, arch.num_kv_heads * d
        qkv = f["model.layers.1.self_attn.qkv_proj.weight"]
        want = torch.cat((qkv[rank * h * d:(rank + 1) * h * d],
                          qkv[q_size + k0 * d:q_size + (k0 + nk) * d],
                          qkv[q_size + kv_size + k0 * d:q_size + kv_size + (k0 + nk) * d]))
        assert torch.equal(p["model.layers.1.self_attn.qkv_proj.weight"], want)
        cols = slice(rank * h * d, (rank + 1) * h * d)
        assert torch.equal(p["model.layers.1.self_attn.o_proj.weight"], f["model.layers.1.self_attn.o_proj.weight"][:, cols])
        i = arch.intermediate_size // size
        gate_up = f["model.layers.0.mlp.gate_up_proj.weight"]
        assert torch.equal(p["model.layers.0.mlp.gate_up_proj.weight"],
                           torch.cat((gate_up[rank * i:(rank + 1) * i], gate_up[arch.intermediate_size + rank * i:
                                                                             arch.intermediate_size + (rank + 1) * i])))
        v = arch.vocab_size // size
        assert torch.equal(p["model.embed_tokens.weight"], f["model.embed_tokens.weight"][rank * v:(rank + 1) * v])
        assert torch.equal(p["lm_head.weight"], f["lm_head.weight"][rank * v:(rank + 1) * v])
        assert torch.equal(p["model.norm.weight"], f["model.norm.weight"])        # replicated
        assert part.cache_shapes()[0].kv_heads == nk


def test_a_rank_reads_only_its_slices(tiny_models):
    folder = tiny_models["llama"][0]
    src = resolve_model(str(folder))
    rec = _Recording(src.weights())
    _load(folder, TensorParallel(1, 2), rec)
    assert "model.layers.0.self_attn.q_proj.weight" in rec.sliced
    assert "model.embed_tokens.weight" in rec.sliced and "lm_head.weight" in rec.sliced
    assert rec.whole and all("norm" in name for name in rec.whole), sorted(rec.whole)


def test_uneven_vocabulary_pads_the_last_shard():
    from pipespec.model.tp_layers import VocabParallelEmbedding, vocab_shard
    tp = TensorParallel(2, 3)
    emb = VocabParallelEmbedding(100, 8, tp)
    assert emb.weight.shape[0] == 34 and vocab_shard(100, tp).ranges == ((68, 100),)


def test_indivisible_heads_are_refused_by_name(tiny_models):
    arch = resolve_model(str(tiny_models["llama"][0])).arch     # 4 heads, 2 KV heads
    with pytest.raises(ValueError, match="num_attention_heads=4 is not divisible by tensor_parallel_size=3"):
        LlamaForCausalLM(arch, tp=TensorParallel(0, 3))
    with pytest.raises(ValueError, match="num_key_value_heads=3 is smaller than tensor_parallel_size=4"):
        LlamaForCausalLM(dataclasses.replace(arch, num_heads=12, num_kv_heads=3), tp=TensorParallel(0, 4))


def test_dummy_weights_are_the_same_model_at_every_tp_size(tiny_models):
    """`load_format="dummy"` cuts each rank's shard from the tensor TP = 1 draws (benchmarks compare
    TP sizes on the same random model)."""
    from pipespec.model.weights import init_dummy_weights
    arch = resolve_model(str(tiny_models["llama"][0])).arch
    full = LlamaForCausalLM(arch)
    init_dummy_weights(full, torch.float32, "cpu")
    f = dict(full.named_parameters())
    for rank in range(2):
        part = LlamaForCausalLM(arch, tp=TensorParallel(rank, 2))
        init_dummy_weights(part, torch.float32, "cpu")
        p = dict(part.named_parameters())
        i, v = arch.intermediate_size // 2, arch.vocab_size // 2
        assert torch.equal(p["model.layers.2.mlp.down_proj.weight"], f["model.layers.2.mlp.down_proj.weight"][:, rank * i:(rank + 1) * i])
        assert torch.equal(p["model.embed_tokens.weight"], f["model.embed_tokens.weight"][rank * v:(rank + 1) * v])
        gate_up = f["model.layers.2.mlp.gate_up_proj.weight"]
        assert torch.equal(p["model.layers.2.mlp.gate_up_proj.weight"][i:], gate_up[2 * i + rank * i:2 * i + (rank + 1) * i])


def test_routed_experts_split_over_ranks_sum_to_the_whole():
    """Expert parallelism inside a TP group: each rank runs the pairs routed to its own experts and
    adds nothing for the others'; the partial outputs (summed by the all-reduce) are the whole."""
    from pipespec.model.routed_experts import routed_experts
    g = torch.Generator().manual_seed(3)
    t, h, inter, e, k = 7, 16, 8, 8, 3
    x = torch.randn(t, h, generator=g)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    weights = torch.rand(t, k, generator=g)
    gate_up, down = torch.randn(e, 2 * inter, h, generator=g), torch.randn(e, h, inter, generator=g)
    whole = routed_experts(x, ids, weights, gate_up, down)
    for size in (2, 4):
        per = e // size
        parts = [routed_experts(x, ids, weights, gate_up[r * per:(r + 1) * per], down[r * per:(r + 1) * per], r * per)
                 for r in range(size)]
        torch.testing.assert_close(sum(parts), whole, rtol=1e-5, atol=1e-5)
