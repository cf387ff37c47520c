"""The fused recurrent gated delta rule (decode and verify lines, its inputs prepared in the kernel)
equals the PyTorch preparation and recurrence: outputs of real rows, each committing line's final
state written to its slot (the others' slots untouched), and the candidate state after every row;
padding rows leave the state as it was. GPU; on CPU under
TRITON_INTERPRET=1 in float32."""
import importlib.util
import os

import pytest
import torch

from pipespec.model.gated_deltanet import delta_rule_inputs, gated_delta_rule

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not (torch.cuda.is_available() or INTERPRET),
                                 reason="needs a CUDA device (or TRITON_INTERPRET=1 with triton)")]


@pytest.mark.parametrize("rows,lengths", [(1, [1, 1, 1]), (4, [4, 2, 1]), (9, [9, 9, 3])])
@pytest.mark.parametrize("keep", [False, True])
@pytest.mark.parametrize("hk,hv,dk,dv", [(1, 1, 8, 8), (1, 3, 16, 32), (2, 4, 128, 128)])
def test_fused_recurrence_equals_reference(rows, lengths, keep, hk, hv, dk, dv):
    """From the conv output, a and b (padding lines zero, as the layer builds them) and the states in
    their slots (a fresh request from zeros) to outputs and states: the kernel's in-register
    preparation and recurrence against the PyTorch functions."""
    from pipespec.kernels.delta_rule_recurrent import fused_gated_delta_rule
    g = torch.Generator(device=DEVICE).manual_seed(rows + hv)
    b = len(lengths)
    valid = torch.arange(rows, device=DEVICE)[None, :] < torch.tensor(lengths, device=DEVICE)[:, None]
    conv = torch.randn(b, rows, 2 * hk * dk + hv * dv, device=DEVICE, generator=g) * valid[..., None]
    a = torch.randn(b, rows, hv, device=DEVICE, generator=g) * 3     # softplus on both sides of 0
    beta_in = torch.randn(b, rows, hv, device=DEVICE, generator=g)
    a_log = torch.randn(hv, device=DEVICE, generator=g) * 0.5
    dt_bias = torch.randn(hv, device=DEVICE, generator=g) * 0.5
    pool = torch.randn(b + 3, hv, dk, dv, device=DEVICE, generator=g) * 0.1     # a layer's state slots
    slots = torch.randperm(b + 3, device=DEVICE, generator=g)[:b]
    fresh = torch.arange(b, device=DEVICE) == 1                     # request 1 starts here: zero state
    state = torch.where(fresh[:, None, None, None], 0.0, pool[slots])
    q, k, v, decay, beta = delta_rule_inputs(conv, a, beta_in, a_log, dt_bias, hk, dk, dv)
    want, want_final, want_after = gated_delta_rule(q, k, v, decay, beta, state, valid, keep=keep)
    before = pool.clone()
    commit = torch.arange(b, device=DEVICE) != 2                   # request 2 verifies: its slot is only read
    got, got_after = fused_gated_delta_rule(conv, a, beta_in, a_log, dt_bias, pool, slots, fresh, valid, commit,
                                            hk, dk, keep=keep)
    torch.testing.assert_close(got[valid], want[valid], atol=1e-5, rtol=1e-5)
    # committing lines' final states are in their slots; every other slot is as it was
    torch.testing.assert_close(pool[slots[commit]], want_final[commit], atol=1e-5, rtol=1e-5)
    untouched = torch.ones(b + 3, dtype=torch.bool, device=DEVICE)
    untouched[slots[commit]] = False
    assert torch.equal(pool[untouched], before[untouched])
    if keep:
        torch.testing.assert_close(got_after, want_after, atol=1e-5, rtol=1e-5)
    else:
        assert got_after is None
