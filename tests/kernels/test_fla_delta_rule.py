"""fla-core's chunked gated delta rule, as the engine calls it on padded lines, equals the PyTorch
recurrence: outputs of real rows and each line's final state (GPU with fla-core installed)."""
import pytest
import torch

from pipespec.kernels.fla_delta_rule import fla_available
from pipespec.model.gated_deltanet import gated_delta_rule, l2_normalize

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not fla_available(), reason="needs fla-core and einops installed")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_kernel_equals_recurrence(dtype):
    from pipespec.kernels.fla_delta_rule import chunked_delta_rule
    g = torch.Generator(device="cuda").manual_seed(0)
    b, L, h, dk, dv = 3, 150, 4, 64, 64
    lengths = torch.tensor([150, 77, 9], device="cuda")
    valid = torch.arange(L, device="cuda")[None, :] < lengths[:, None]
    q = l2_normalize(torch.randn(b, L, h, dk, device="cuda", generator=g)) * dk ** -0.5
    k = l2_normalize(torch.randn(b, L, h, dk, device="cuda", generator=g))
    v = torch.randn(b, L, h, dv, device="cuda", generator=g)
    decay = -torch.rand(b, L, h, device="cuda", generator=g) * 0.5
    beta = torch.rand(b, L, h, device="cuda", generator=g)
    state = torch.randn(b, h, dk, dv, device="cuda", generator=g) * 0.1
    want, want_state, _ = gated_delta_rule(q, k, v, decay, beta, state, valid)
    got, got_state = chunked_delta_rule(q.to(dtype), k.to(dtype), v.to(dtype), decay, beta, state, valid)
    tol = 1e-2 if dtype == torch.float32 else 3e-2     # fla multiplies in tf32 at best
    torch.testing.assert_close(got[valid], want[valid], atol=tol, rtol=tol)
    torch.testing.assert_close(got_state, want_state, atol=tol, rtol=tol)
