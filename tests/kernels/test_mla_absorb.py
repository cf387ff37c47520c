"""MLA's absorbed per-head products equal the einsums over kv_b's weight split per head, for the
strided q_nope the layer passes and every row count they serve (GPU; on CPU under TRITON_INTERPRET=1)."""
import pytest
import torch

from tests.kernels import DEVICE, INTERPRET, ON_KERNELS

pytestmark = ON_KERNELS

SHAPES = [(4, 24, 40, 32), (3, 16, 8, 48)]           # heads, dn, dv, R: tiles that do not divide them
if not INTERPRET:
    SHAPES.append((20, 192, 256, 512))               # GLM-4.7-Flash


@pytest.mark.parametrize("heads,dn,dv,rank", SHAPES)
@pytest.mark.parametrize("rows", [1, 2, 4, 8])
def test_products_equal_the_einsums(heads, dn, dv, rank, rows):
    """Every row count the kernels take (the layer uses them at FAST_ROWS only, the einsum past it)."""
    from pipespec.kernels.mla_absorb import absorb_output, absorb_query
    g = torch.Generator(device=DEVICE).manual_seed(rows)
    w = torch.randn(heads * (dn + dv), rank, device=DEVICE, generator=g)
    per_head = w.view(heads, dn + dv, rank)
    q = torch.randn(rows, heads, dn + 16, device=DEVICE, generator=g)[..., :dn]     # a slice of q, as split gives
    o_lat = torch.randn(rows, heads, rank, device=DEVICE, generator=g)
    want_q = torch.einsum("thd,hdr->thr", q, per_head[:, :dn])
    want_o = torch.einsum("thr,hvr->thv", o_lat, per_head[:, dn:])
    torch.testing.assert_close(absorb_query(q, w, dn, dv), want_q, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(absorb_output(o_lat, w, dn, dv), want_o, atol=1e-4, rtol=1e-4)
    # the halves are not interchangeable: W_uk's rows are the first dn of each head
    assert not torch.allclose(absorb_query(q, w.roll(1, 0), dn, dv), want_q, atol=1e-2)


@pytest.mark.gpu             # bf16 on the GPU (not under the interpreter)
def test_bf16_within_rounding():
    from pipespec.kernels.mla_absorb import absorb_output, absorb_query
    w = torch.randn(20 * 448, 512, device=DEVICE, dtype=torch.bfloat16) * 0.05
    q = torch.randn(1, 20, 256, device=DEVICE, dtype=torch.bfloat16)[..., :192]
    o = torch.randn(1, 20, 512, device=DEVICE, dtype=torch.bfloat16)
    per_head = w.view(20, 448, 512)
    torch.testing.assert_close(absorb_query(q, w, 192, 256).float(),
                               torch.einsum("thd,hdr->thr", q.float(), per_head[:, :192].float()), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(absorb_output(o, w, 192, 256).float(),
                               torch.einsum("thr,hvr->thv", o.float(), per_head[:, 192:].float()), atol=2e-2, rtol=2e-2)


def test_too_many_rows_is_refused():
    from pipespec.kernels.mla_absorb import MAX_ROWS, absorb_query
    with pytest.raises(ValueError, match="rows"):
        absorb_query(torch.zeros(MAX_ROWS + 1, 2, 4, device=DEVICE), torch.zeros(2 * 8, 4, device=DEVICE), 4, 4)
