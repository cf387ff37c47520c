"""The fused recurrent gated delta rule (decode and verify lines, its inputs prepared in the kernel)
equals the PyTorch preparation and recurrence: outputs of real rows, the state each line starts from
(zeros, the committed candidate or the slot's), each settling line's final state written to its slot
and each verifying line's state after every row to its candidates; padding rows leave the state as
it was. GPU; on CPU under
TRITON_INTERPRET=1 in float32."""

import pytest
import torch

from pipespec.model.gated_deltanet import delta_rule_inputs, gated_delta_rule
from tests.kernels import DEVICE, ON_KERNELS

pytestmark = ON_KERNELS


@pytest.mark.parametrize("rows,lengths", [(1, [1, 1, 1]), (4, [4, 2, 1]), (9, [9, 9, 3]), (40, [17, 40, 33])])
@pytest.mark.parametrize("keep", [False, True])
@pytest.mark.parametrize("hk,hv,dk,dv", [(1, 1, 8, 8), (1, 3, 16, 32), (2, 4, 128, 128)])
def test_fused_recurrence_equals_reference(rows, lengths, keep, hk, hv, dk, dv):
    """From the conv output, a and b (padding lines zero, as the layer builds them) and the states in
    their pools to outputs and states: request 0 starts from the candidate its plan commits, request
    1 from zeros (it starts here), request 2 from its candidate 0, which (with `keep`) it verifies
    over, so its candidates are overwritten by the ones this step keeps. The kernel's in-register
    preparation and recurrence against the PyTorch functions."""
    from pipespec.kernels.delta_rule_recurrent import fused_gated_delta_rule
    g = torch.Generator(device=DEVICE).manual_seed(rows + hv)
    b, cand_rows = len(lengths), 3
    valid = torch.arange(rows, device=DEVICE)[None, :] < torch.tensor(lengths, device=DEVICE)[:, None]
    starts = torch.tensor([0] + lengths[:-1], device=DEVICE).cumsum(0)
    flat_rows = torch.where(valid, starts[:, None] + torch.arange(rows, device=DEVICE), 0)   # as LinearMeta
    conv = torch.randn(b, rows, 2 * hk * dk + hv * dv, device=DEVICE, generator=g) * valid[..., None]
    # the step's a and b rows, as column slices of one projection
    ab = torch.randn(sum(lengths), 2 * hv + 5, device=DEVICE, generator=g)
    a, beta_in = ab[:, :hv] * 3, ab[:, hv + 5:]                     # a: softplus on both sides of 0
    a_log = torch.randn(hv, device=DEVICE, generator=g) * 0.5
    dt_bias = torch.randn(hv, device=DEVICE, generator=g) * 0.5
    rec = torch.randn(b + 3, hv, dk, dv, device=DEVICE, generator=g) * 0.1     # a layer's state slots
    cand = torch.randn(b + 3, cand_rows, hv, dk, dv, device=DEVICE, generator=g) * 0.1
    slots = torch.randperm(b + 3, device=DEVICE, generator=g)[:b]
    fresh = torch.arange(b, device=DEVICE) == 1
    commit = torch.tensor([1, -1, 0], device=DEVICE)
    settles = torch.tensor([True, True, not keep], device=DEVICE)
    start = torch.where((commit >= 0)[:, None, None, None], cand[slots, commit.clamp(min=0)], rec[slots])
    state = torch.where(fresh[:, None, None, None], 0.0, start)
    q, k, v, decay, beta = delta_rule_inputs(conv, a[flat_rows], beta_in[flat_rows], a_log, dt_bias, hk, dk, dv)
    want, want_final, want_after = gated_delta_rule(q, k, v, decay, beta, state, valid, keep=True)
    want_rec, want_cand = rec.clone(), cand.clone()
    want_rec[slots[settles]] = want_final[settles]
    n = min(rows, cand_rows)
    want_cand[slots[~settles], :n] = want_after[~settles, :n]
    got = fused_gated_delta_rule(conv, a, beta_in, a_log, dt_bias, rec, cand, slots, fresh, commit, settles,
                                 flat_rows, valid, hk, dk, keep=keep)
    torch.testing.assert_close(got, want[valid], atol=1e-5, rtol=1e-5)            # the step's rows, in order
    # settling lines' final states are in their slots, verifying lines' candidates in theirs, nothing else moved
    torch.testing.assert_close(rec, want_rec, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cand, want_cand, atol=1e-5, rtol=1e-5)
