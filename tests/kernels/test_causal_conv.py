"""Gated DeltaNet's causal conv kernel equals the PyTorch steps it replaces: committing the plan's
candidate, the conv with its SiLU on every real row (`causal_conv_lines`), and the conv half of the
state update (`LinearMeta.store`): a plain line's last inputs to its slot, a verify line's window
after each row to its candidates. GPU; on CPU under TRITON_INTERPRET=1 in float32."""
import copy

import pytest
import torch

from pipespec.model.gated_deltanet import causal_conv_lines
from pipespec.model.linear_state import LinearFlags, LinearMeta, LinearState
from tests.kernels import DEVICE, ON_KERNELS

pytestmark = ON_KERNELS


@pytest.mark.parametrize("lengths,drafts", [([1, 1, 1], [0, 0, 0]), ([3, 1, 2], [0, 0, 1]), ([4, 4], [3, 3]),
                                           ([40, 1, 63], [0, 0, 0])])
@pytest.mark.parametrize("channels,kernel", [(24, 4), (1100, 4), (40, 2)])
def test_causal_conv_equals_the_pytorch_steps(lengths, drafts, channels, kernel):
    """Request 0 starts here (zeros), request 1 commits its candidate 1 first, the others run from
    their slots; a request with drafts verifies and keeps a candidate a row (3 rows kept)."""
    from pipespec.kernels.causal_conv import causal_conv
    g = torch.Generator(device=DEVICE).manual_seed(channels + len(lengths))
    b, width, rows = len(lengths), max(lengths), 3
    qsl = torch.tensor([0] + lengths, device=DEVICE).cumsum(0)
    positions = torch.cat([torch.arange(n, device=DEVICE) + (0 if i == 0 else 7) for i, n in enumerate(lengths)])
    slots = torch.randperm(b + 2, device=DEVICE, generator=g)[:b]
    drafts, commit = torch.tensor(drafts), torch.tensor([-1, 1, -1][:b])
    flags = LinearFlags.of(width, commit, drafts)
    meta = LinearMeta.build(qsl, positions, slots, commit.to(DEVICE), drafts.to(DEVICE), [], flags)
    # the step's rows as a strided view of a wider projection, as the layer's split gives
    x = torch.randn(int(qsl[-1]), channels + 9, device=DEVICE, generator=g)[:, 3:3 + channels]
    weight = torch.randn(channels, 1, kernel, device=DEVICE, generator=g)
    w = kernel - 1
    state = LinearState(torch.randn(b + 2, w, channels, device=DEVICE, generator=g),
                        torch.zeros(b + 2, 1, 1, 1, device=DEVICE),         # recurrent states: not this kernel's
                        torch.randn(b + 2, rows, w, channels, device=DEVICE, generator=g),
                        torch.zeros(b + 2, rows, 1, 1, 1, device=DEVICE))
    want_state = copy.deepcopy(state)
    meta.commit_candidates(want_state)
    want, full = causal_conv_lines(x, meta, want_state.conv, weight)
    meta.store(want_state, full, torch.zeros(b, 1, 1, 1, device=DEVICE), torch.zeros(b, width, 1, 1, 1, device=DEVICE))
    got = causal_conv(x, meta.rows, meta.valid, meta.lengths, state.conv, state.cand_conv, slots, meta.fresh,
                      meta.commit, meta.settles, weight)
    assert meta.fresh.tolist() == [True] + [False] * (b - 1)
    torch.testing.assert_close(got[meta.valid], want[meta.valid], atol=1e-5, rtol=1e-5)
    # the states a later step reads: settling lines' slots, verifying lines' candidates; other slots untouched
    settles = meta.settles.tolist()
    for i, slot in enumerate(slots.tolist()):
        if settles[i]:
            assert torch.equal(state.conv[slot], want_state.conv[slot])
        else:
            n = min(width, rows)
            assert torch.equal(state.cand_conv[slot, :n], want_state.cand_conv[slot, :n])
    others = [s for s in range(b + 2) if s not in slots.tolist()]
    assert torch.equal(state.conv[others], want_state.conv[others])
    assert torch.equal(state.cand_conv[others], want_state.cand_conv[others])
