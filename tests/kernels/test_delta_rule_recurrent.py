"""The fused recurrent gated delta rule (decode and verify lines) equals the PyTorch recurrence:
outputs of real rows, each line's final state, and the candidate state after every row; padding
rows leave the state as it was. GPU; on CPU under TRITON_INTERPRET=1 in float32."""
import importlib.util
import os

import pytest
import torch

from pipespec.model.gated_deltanet import gated_delta_rule, l2_normalize

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not (torch.cuda.is_available() or INTERPRET),
                                 reason="needs a CUDA device (or TRITON_INTERPRET=1 with triton)")]


@pytest.mark.parametrize("rows,lengths", [(1, [1, 1, 1]), (4, [4, 2, 1]), (9, [9, 9, 3])])
@pytest.mark.parametrize("keep", [False, True])
@pytest.mark.parametrize("dk,dv", [(8, 8), (16, 32), (128, 128)])
def test_fused_recurrence_equals_reference(rows, lengths, keep, dk, dv):
    from pipespec.kernels.delta_rule_recurrent import recurrent_delta_rule
    g = torch.Generator(device=DEVICE).manual_seed(rows)
    b, h = len(lengths), 3
    valid = torch.arange(rows, device=DEVICE)[None, :] < torch.tensor(lengths, device=DEVICE)[:, None]
    q = l2_normalize(torch.randn(b, rows, h, dk, device=DEVICE, generator=g)) * dk ** -0.5
    k = l2_normalize(torch.randn(b, rows, h, dk, device=DEVICE, generator=g))
    v = torch.randn(b, rows, h, dv, device=DEVICE, generator=g)
    decay = -torch.rand(b, rows, h, device=DEVICE, generator=g) * 0.5
    beta = torch.rand(b, rows, h, device=DEVICE, generator=g)
    state = torch.randn(b, h, dk, dv, device=DEVICE, generator=g) * 0.1
    want, want_final, want_after = gated_delta_rule(q, k, v, decay, beta, state, valid, keep=keep)
    got, got_final, got_after = recurrent_delta_rule(q, k, v, decay, beta, state, valid, keep=keep)
    torch.testing.assert_close(got[valid], want[valid], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_final, want_final, atol=1e-5, rtol=1e-5)
    if keep:
        torch.testing.assert_close(got_after, want_after, atol=1e-5, rtol=1e-5)
    else:
        assert got_after is None
