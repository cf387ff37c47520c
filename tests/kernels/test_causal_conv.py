"""Gated DeltaNet's causal conv kernel equals the PyTorch lines (`causal_conv_lines`): the conv with
its SiLU on every real row, and the lines' input buffer the state update reads (past inputs from the
slot or zeros for a fresh request, then the rows, padding zero); the state pool is only read. GPU; on
CPU under TRITON_INTERPRET=1 in float32."""
import importlib.util
import os

import pytest
import torch

from pipespec.model.gated_deltanet import causal_conv_lines
from pipespec.model.linear_state import LinearFlags, LinearMeta

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not (torch.cuda.is_available() or INTERPRET),
                                 reason="needs a CUDA device (or TRITON_INTERPRET=1 with triton)")]


@pytest.mark.parametrize("lengths", [[1, 1, 1], [3, 1, 2], [5]])
@pytest.mark.parametrize("channels,kernel", [(24, 4), (1100, 4), (40, 2)])
def test_causal_conv_equals_the_pytorch_lines(lengths, channels, kernel):
    from pipespec.kernels.causal_conv import causal_conv
    g = torch.Generator(device=DEVICE).manual_seed(channels + len(lengths))
    b, width = len(lengths), max(lengths)
    qsl = torch.tensor([0] + lengths, device=DEVICE).cumsum(0)
    positions = torch.cat([torch.arange(n, device=DEVICE) + (0 if i == 0 else 7) for i, n in enumerate(lengths)])
    slots = torch.randperm(b + 2, device=DEVICE, generator=g)[:b]
    drafts, commit = torch.zeros(b, dtype=torch.int64), torch.full((b,), -1)
    meta = LinearMeta.build(qsl, positions, slots, commit, drafts, [], LinearFlags.of(width, commit, drafts))
    # the step's rows as a strided view of a wider projection, as the layer's split gives
    x = torch.randn(int(qsl[-1]), channels + 9, device=DEVICE, generator=g)[:, 3:3 + channels]
    pool = torch.randn(b + 2, kernel - 1, channels, device=DEVICE, generator=g)
    weight = torch.randn(channels, 1, kernel, device=DEVICE, generator=g)
    want, want_full = causal_conv_lines(x, meta, pool, weight)
    before = pool.clone()
    got, full = causal_conv(x, meta.rows, meta.valid, pool, slots, meta.fresh, weight)
    assert meta.fresh.tolist() == [True] + [False] * (b - 1)       # request 0 starts here: zero past
    torch.testing.assert_close(got[meta.valid], want[meta.valid], atol=1e-5, rtol=1e-5)
    assert torch.equal(full, want_full)
    assert torch.equal(pool, before)
