"""The grouped-GEMM routed experts equal a plain loop over experts, including experts that get no
token and a token sent twice to one expert's neighbours."""
import pytest
import torch
import torch.nn.functional as F

from pipespec.model.routed_experts import routed_experts


def loop_reference(x, ids, weights, gate_up, down):
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            g, u = F.linear(x[t], gate_up[ids[t, j]]).chunk(2)
            out[t] += weights[t, j] * F.linear(F.silu(g) * u, down[ids[t, j]])
    return out


def _case(t, e, k, h, i, dtype, device="cpu"):
    gen = torch.Generator().manual_seed(t * 100 + e)
    x = torch.randn(t, h, generator=gen).to(device, dtype)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)]).to(device)
    weights = torch.rand(t, k, generator=gen).to(device)
    gate_up = (torch.randn(e, 2 * i, h, generator=gen) / h ** 0.5).to(device, dtype)
    down = (torch.randn(e, h, i, generator=gen) / i ** 0.5).to(device, dtype)
    return x, ids, weights, gate_up, down


@pytest.mark.parametrize("t,e,k", [(1, 8, 2), (7, 16, 4), (33, 6, 6)])
def test_equals_loop_fp32(t, e, k):
    args = _case(t, e, k, h=24, i=40, dtype=torch.float32)
    got = routed_experts(*args)
    assert torch.allclose(got, loop_reference(*args), atol=1e-5, rtol=1e-5)
    # experts that got no token do not matter: zeroing one changes nothing
    x, ids, weights, gate_up, down = args
    unused = sorted(set(range(e)) - set(ids.flatten().tolist()))
    if unused:
        gate_up[unused[0]] = 0
        assert torch.equal(routed_experts(x, ids, weights, gate_up, down), got)


def test_wrong_expert_changes_result():
    x, ids, weights, gate_up, down = _case(5, 8, 2, h=16, i=16, dtype=torch.float32)
    swapped = ids.clone()
    swapped[0, 0] = (swapped[0, 0] + 1) % 8
    if swapped[0, 0] == swapped[0, 1]:
        swapped[0, 0] = (swapped[0, 0] + 1) % 8
    assert not torch.allclose(routed_experts(x, swapped, weights, gate_up, down), loop_reference(x, ids, weights, gate_up, down))


@pytest.mark.gpu
def test_bf16_cuda_grouped_gemm_and_graph_capture():
    args = _case(64, 128, 8, h=256, i=128, dtype=torch.bfloat16, device="cuda")
    ref = loop_reference(*(a.float() if a.is_floating_point() else a for a in args))
    got = routed_experts(*args)
    assert (got.float() - ref).abs().max() < 0.05 * ref.abs().max()
    # no host sync: the call captures into a CUDA graph and replays the same result
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = routed_experts(*args)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, got)


@pytest.mark.gpu
def test_float32_cuda_gathers_expert_weights():
    args = _case(9, 16, 4, h=24, i=40, dtype=torch.float32, device="cuda")
    got = routed_experts(*args)
    ref = loop_reference(*(a.cpu() for a in args))
    assert torch.allclose(got.cpu(), ref, atol=1e-4, rtol=1e-4)
