"""The few-pair routed-expert kernels against a plain per-pair loop and against `routed_experts`'s
grouped-GEMM path: odd sizes, experts repeated across tokens, pairs of other ranks' experts, and a
different weight per slot. On a GPU; on CPU under the Triton interpreter (TRITON_INTERPRET=1)."""
from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F
from tests.kernels import DEVICE, ON_KERNELS

pytestmark = ON_KERNELS


def _loop(x, ids, weights, gate_up, down, first=0):
    """Per pair, in float64: what each (token, slot) adds; other ranks' experts add nothing."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(ids.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j]) - first
            if 0 <= e < gate_up.shape[0]:
                gate, up = (gate_up[e].double().cpu() @ x[t].double().cpu()).chunk(2)
                out[t] += float(weights[t, j]) * (down[e].double().cpu() @ (F.silu(gate) * up))
    return out


def _case(t, e, k, h, i, seed, repeat=True):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=gen)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    if repeat and t > 1:
        ids[1, 0] = ids[0, 1]                       # one expert serves two tokens (other slots)
    weights = torch.rand(t, k, generator=gen) + torch.arange(k) * 0.5   # a distinct weight per slot
    gate_up = torch.randn(e, 2 * i, h, generator=gen) / h ** 0.5
    down = torch.randn(e, h, i, generator=gen) / i ** 0.5
    return [a.to(DEVICE) for a in (x, ids, weights, gate_up, down)]


def _close(got, want):
    torch.testing.assert_close(got.double().cpu(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("t,k", [(1, 2), (1, 4), (3, 2), (3, 4)])
@pytest.mark.parametrize("h,i", [(48, 40), (96, 72)])
def test_equals_per_pair_loop(t, k, h, i):
    from pipespec.kernels.moe_experts import few_pair_experts
    args = _case(t, 8, k, h, i, seed=t * 10 + k + h)
    _close(few_pair_experts(*args), _loop(*args))


@pytest.mark.parametrize("t,k", [(1, 4), (3, 4), (3, 2)])
def test_other_ranks_experts_add_zero(t, k):
    """This rank holds global experts [4, 10): pairs routed below or above add nothing."""
    from pipespec.kernels.moe_experts import few_pair_experts
    x, ids, weights, gate_up, down = _case(t, 16, k, 96, 72, seed=7 + t)
    ids[0, 0], ids[0, 1] = 2, 13                    # certainly another rank's (below, above)
    local_up, local_down = gate_up[4:10].contiguous(), down[4:10].contiguous()
    got = few_pair_experts(x, ids, weights, local_up, local_down, first=4)
    _close(got, _loop(x, ids, weights, local_up, local_down, first=4))
    elsewhere = torch.where((ids >= 4) & (ids < 10), ids + 6, ids)    # none of this rank's
    assert torch.equal(few_pair_experts(x, elsewhere, weights, local_up, local_down, first=4),
                       torch.zeros_like(x))


@pytest.mark.parametrize("t,k,block", [(1, 4, (8, 8)), (3, 2, (8, 16)), (2, 4, (16, 8))])
def test_fp8_stacks_equal_their_dequantized_weights(t, k, block):
    """FP8 expert stacks (e4m3 with block scales, as DeepSeek's FP8 release stores experts) give what
    the dense stacks of their dequantized weights give, `first` included: the kernels scale each
    element by its own block (blocks narrower and wider than the tile rows)."""
    from pipespec.kernels.moe_experts import few_pair_experts
    from pipespec.model.quant.experts import Fp8Stack
    from pipespec.model.quant.packed import Fp8Weight
    from tests.model.quant import writers
    e, h, i = 6, 48, 32
    x, ids, weights, gate_up, down = _case(t, e + 2, k, h, i, seed=11 * t + k)
    stacks, dense = [], []
    for w in (gate_up[2:].reshape(-1, h), down[2:].reshape(-1, i)):       # this rank: experts 2..7
        parts, ref = writers.fp8(w.cpu(), block)
        stacks.append(Fp8Stack(Fp8Weight(parts["weight"].to(DEVICE), parts["weight_scale_inv"].to(DEVICE), block), e))
        dense.append(ref.to(DEVICE))
    got = few_pair_experts(x, ids, weights, stacks[0], stacks[1], first=2)
    _close(got, _loop(x, ids, weights, dense[0].view(e, 2 * i, h), dense[1].view(e, h, i), first=2))


@pytest.mark.parametrize("t,k,layout", [(1, 4, "awq"), (3, 2, "gptq"), (2, 4, "awq")])
def test_int4_stacks_equal_their_dequantized_weights(t, k, layout):
    """int4 expert stacks (AWQ or GPTQ, repacked per expert, gate and up side by side) give what the
    dense stacks of their dequantized weights give, `first` included."""
    from pipespec.kernels.moe_experts import few_pair_int4_experts
    from pipespec.model.quant.experts import Int4Stack
    from pipespec.model.quant.packed import Int4Weight, concat
    from tests.model.quant import writers
    e, h, i, group = 6, 64, 32, 16
    x, ids, weights, gate_up, down = _case(t, e + 2, k, h, i, seed=13 * t + k)

    def packed(w):                    # one checkpoint matrix [out, in] -> (Int4Weight, dequantized)
        if layout == "awq":
            parts, ref = writers.awq(w.cpu(), group)
            return Int4Weight.from_awq(parts["qweight"], parts["qzeros"], parts["scales"].float(), group), ref
        parts, ref = writers.gptq(w.cpu(), group, act_order=False)
        return Int4Weight.from_gptq(parts["qweight"], parts["qzeros"], parts["scales"].float(), parts["g_idx"]), ref

    ups, downs, dense_up, dense_down = [], [], [], []
    for j in range(2, e + 2):                                        # this rank: experts 2..7
        (g, g_ref), (u, u_ref), (d, d_ref) = packed(gate_up[j, :i]), packed(gate_up[j, i:]), packed(down[j])
        ups.append(concat([g, u]).to(torch.device(DEVICE)))
        downs.append(d.to(torch.device(DEVICE)))
        dense_up.append(torch.cat([g_ref, u_ref]))
        dense_down.append(d_ref)
    got = few_pair_int4_experts(x, ids, weights, Int4Stack(ups), Int4Stack(downs), first=2)
    _close(got, _loop(x, ids, weights, torch.stack(dense_up), torch.stack(dense_down), first=2))


def test_slot_weights_and_gate_up_halves_matter():
    """The data tells a wrong slot weighting or swapped gate/up halves apart from the right answer."""
    from pipespec.kernels.moe_experts import few_pair_experts
    x, ids, weights, gate_up, down = _case(3, 8, 4, 48, 40, seed=3)
    got = few_pair_experts(x, ids, weights, gate_up, down).double().cpu()
    i = gate_up.shape[1] // 2
    swapped = torch.cat([gate_up[:, i:], gate_up[:, :i]], 1)
    for wrong in (_loop(x, ids, weights.flip(1), gate_up, down), _loop(x, ids, weights, swapped, down)):
        assert (got - wrong).abs().max() > 0.05 * wrong.abs().max()
    _close(got, _loop(x, ids, weights, gate_up, down))


@pytest.mark.parametrize("pairs_over", [False, True])
def test_routed_experts_takes_the_kernel_for_few_pairs(monkeypatch, pairs_over):
    """Inference mode with kernels on: few pairs run the kernels, more run the grouped GEMMs; both
    equal the PyTorch path outside inference mode, with `first` and pairs of other ranks."""
    import pipespec.kernels.moe_experts as moe_experts
    from pipespec.model import routed_experts as module
    x, ids, weights, gate_up, down = _case(3, 12, 4, 96, 72, seed=11)
    ids[2, 3] = 1                                   # another rank's: this one holds [2, 12)
    args = (x, ids, weights, gate_up[2:].contiguous(), down[2:].contiguous(), 2)
    calls = []
    kernel = moe_experts.few_pair_experts
    monkeypatch.setattr(moe_experts, "few_pair_experts", lambda *a: calls.append(1) or kernel(*a))
    monkeypatch.setattr(module, "FEW_PAIRS", 11 if pairs_over else 12)
    want = module.routed_experts(*args)             # no inference mode: the grouped-GEMM path
    with torch.inference_mode():
        got = module.routed_experts(*args)
    assert len(calls) == (0 if pairs_over else 1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


# the interpreter rounds bf16 unlike the GPU (and torch): bit-exact bf16 checks run on a GPU only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16] if torch.cuda.is_available() else [torch.float32])
def test_shared_output_added_by_the_kernel_equals_adding_it_after(dtype):
    """`add` (the shared experts' output) summed into the result by the second kernel: the same bits
    as the separate add it replaces (round the routed sum, then add in float32 and round)."""
    from pipespec.kernels.moe_experts import few_pair_experts
    x, ids, weights, gate_up, down = _case(3, 8, 4, 96, 72, seed=13)
    x, gate_up, down = x.to(dtype), gate_up.to(dtype), down.to(dtype)
    shared = torch.randn(x.shape, generator=torch.Generator().manual_seed(14)).to(DEVICE, dtype)
    alone = few_pair_experts(x, ids, weights, gate_up, down)
    assert torch.equal(few_pair_experts(x, ids, weights, gate_up, down, add=shared), alone + shared)
    with pytest.raises(ValueError, match="adds a \\[T, H\\] tensor"):
        few_pair_experts(x, ids, weights, gate_up, down, add=shared[:, :10])


@pytest.mark.parametrize("t", [1, 3])
def test_a_shared_expert_rides_along_as_one_more_pair(t):
    """A shared expert shaped like a routed one, run inside the kernels (weight 1, added after the
    routed sum), equals the separate MLP added afterwards; `routed_experts` takes that path for a
    GatedMLP that fits and keeps the separate add for one that does not (TP-split: another I)."""
    from pipespec.kernels.moe_experts import few_pair_experts
    from pipespec.model import routed_experts as module
    from pipespec.model.layers import GatedMLP
    x, ids, weights, gate_up, down = _case(t, 8, 4, 96, 72, seed=17 + t)
    mlp = GatedMLP(96, 72).to(DEVICE)
    g = torch.Generator().manual_seed(18)
    with torch.no_grad():
        mlp.gate_up_proj.weight.copy_(torch.randn(144, 96, generator=g) / 96 ** 0.5)
        mlp.down_proj.weight.copy_(torch.randn(96, 72, generator=g) / 72 ** 0.5)
    with torch.inference_mode():
        want = few_pair_experts(x, ids, weights, gate_up, down) + mlp(x)
        got = few_pair_experts(x, ids, weights, gate_up, down,
                               shared=(mlp.gate_up_proj.weight, mlp.down_proj.weight))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
        assert (got - few_pair_experts(x, ids, weights, gate_up, down)).abs().max() > 0.05 * want.abs().max()
        torch.testing.assert_close(module.routed_experts(x, ids, weights, gate_up, down, shared=mlp), got)
        narrow = GatedMLP(96, 36).to(DEVICE)           # another intermediate size: added separately
        narrow.gate_up_proj.weight.copy_(torch.randn(72, 96, generator=g) / 96 ** 0.5)
        narrow.down_proj.weight.copy_(torch.randn(96, 36, generator=g) / 36 ** 0.5)
        torch.testing.assert_close(module.routed_experts(x, ids, weights, gate_up, down, shared=narrow),
                                   few_pair_experts(x, ids, weights, gate_up, down) + narrow(x))
        with pytest.raises(ValueError, match="shaped like a routed one"):
            few_pair_experts(x, ids, weights, gate_up, down, shared=(narrow.gate_up_proj.weight,
                                                                     narrow.down_proj.weight))
