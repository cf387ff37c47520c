"""The grouped FP8 expert kernels (many pairs) against a per-pair loop over the dequantized weights:
experts picked by many tokens, by none, pairs of other ranks' experts, both tile heights. On a GPU;
on CPU under the Triton interpreter (TRITON_INTERPRET=1)."""
from __future__ import annotations

import pytest
import torch

from tests.kernels import DEVICE, ON_KERNELS
from tests.kernels.test_moe_experts import _case, _close, _loop

pytestmark = ON_KERNELS


def _fp8_stacks(gate_up, down, block):
    from pipespec.model.quant.experts import Fp8Stack
    from pipespec.model.quant.packed import Fp8Weight
    from tests.model.quant import writers
    e, two_i, h = gate_up.shape
    stacks, dense = [], []
    for w, shape in ((gate_up, (e, two_i, h)), (down, (e, h, two_i // 2))):
        parts, ref = writers.fp8(w.reshape(-1, w.shape[-1]).cpu(), block)
        stacks.append(Fp8Stack(Fp8Weight(parts["weight"].to(DEVICE), parts["weight_scale_inv"].to(DEVICE), block), e))
        dense.append(ref.view(shape).to(DEVICE))
    return stacks, dense


def test_tiles_pad_each_experts_group_and_leave_other_ranks_pairs_out():
    from pipespec.kernels.moe_grouped import _tiles
    ids = torch.tensor([[3, 1], [1, 9], [3, 2]])              # this rank: experts 1..4 (first = 1)
    rows, tile_expert = _tiles(ids, 1, 4, 2)
    tiles = tile_expert.tolist()
    got = {}
    for t, e in enumerate(tiles):
        if e < 4:
            got.setdefault(e, []).extend(r for r in rows[2 * t:2 * t + 2].tolist() if r >= 0)
    assert got == {0: [1, 2], 1: [5], 2: [0, 4]}             # local experts 0 (global 1), 1, 2
    assert all(r < 0 for t, e in enumerate(tiles) if e == 4 for r in rows[2 * t:2 * t + 2].tolist())
    assert (rows >= 0).sum() == 5 and 3 not in rows.tolist()  # pair 3 (expert 9) is elsewhere


@pytest.mark.parametrize("t,k,block,first", [(9, 4, (16, 16), 0), (20, 2, (32, 16), 2), (5, 4, (16, 32), 2)])
def test_grouped_fp8_experts_equal_the_dequantized_loop(t, k, block, first):
    from pipespec.kernels.moe_grouped import fits, grouped_fp8_experts
    e, h, i = 6, 64, 64
    x, ids, weights, gate_up, down = _case(t, e + first + 1, k, h, i, seed=5 * t + k)  # + pairs elsewhere
    ids[0, 0] = ids[1, 0] = ids[2, 1] = first            # one expert picked by several tokens
    (gu, dn), (dgu, ddn) = _fp8_stacks(gate_up[first:first + e].contiguous(), down[first:first + e].contiguous(),
                                       block)
    assert fits(gu, dn, h)
    got = grouped_fp8_experts(x, ids, weights, gu, dn, first)
    _close(got, _loop(x, ids, weights, dgu, ddn, first=first))


def test_many_fp8_pairs_take_the_grouped_kernels(monkeypatch):
    """Past FEW_FP8_PAIRS the quantized routing runs the grouped kernels, below it the GEMVs; both
    equal the dequantized loop."""
    from pipespec.kernels import moe_grouped
    from pipespec.model.quant import experts as module
    x, ids, weights, gate_up, down = _case(12, 8, 4, 64, 32, seed=3)
    (gu, dn), (dgu, ddn) = _fp8_stacks(gate_up, down, (16, 16))
    calls = []
    kernel = moe_grouped.grouped_fp8_experts
    monkeypatch.setattr(moe_grouped, "grouped_fp8_experts", lambda *a: calls.append(1) or kernel(*a))
    want = _loop(x, ids, weights, dgu, ddn)
    for few, grouped in ((48, False), (47, True)):
        monkeypatch.setattr(module, "FEW_FP8_PAIRS", few)
        with torch.inference_mode():
            got = module.quantized_routed_experts(x, ids, weights, gu, dn)
        assert bool(calls) == grouped
        _close(got, want)


@pytest.mark.gpu             # CUDA graphs: a device, compiled kernels
def test_grouped_fp8_experts_capture_in_a_cuda_graph():
    """Nothing reads the routing back to the host: a replay with new ids equals an eager call."""
    from pipespec.kernels.moe_grouped import grouped_fp8_experts
    x, ids, weights, gate_up, down = _case(40, 8, 4, 128, 128, seed=9)
    x = x.bfloat16()
    (gu, dn), _ = _fp8_stacks(gate_up, down, (64, 64))
    grouped_fp8_experts(x, ids, weights, gu, dn)                  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = grouped_fp8_experts(x, ids, weights, gu, dn)
    ids.copy_(ids.flip(0))
    graph.replay()
    torch.testing.assert_close(out, grouped_fp8_experts(x, ids, weights, gu, dn), rtol=0, atol=0)
