"""`model/linear.py`: which path a dense product takes, and that every path computes the same."""
from __future__ import annotations


import pytest
import torch

from pipespec.model.linear import linear
from tests.kernels import DEVICE



def _rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def test_gated_product_is_silu_of_the_gate_times_up_then_the_projection():
    w, b, gate_up = _rand(24, 40, seed=1), _rand(24, seed=2), _rand(3, 80, seed=3)
    want = (torch.nn.functional.silu(gate_up[:, :40]) * gate_up[:, 40:]) @ w.t() + b
    torch.testing.assert_close(linear(gate_up, w, b, gated=True), want)
    torch.testing.assert_close(linear(gate_up[:, :40], w, b), gate_up[:, :40] @ w.t() + b)


@pytest.mark.gpu(interpret=True)
@pytest.mark.parametrize("gated", [False, True])
def test_decode_rows_take_the_gemv_kernel_and_prefill_rows_do_not(monkeypatch, gated):
    from pipespec.kernels import gemv
    calls, kernel = [], gemv.rowmajor_gemv
    monkeypatch.setattr(gemv, "rowmajor_gemv", lambda x, w, **kw: calls.append(x.shape[0]) or kernel(x, w, **kw))
    width = 128 if gated else 64
    # a small weight (<= SMALL_WEIGHT_BYTES) takes up to SMALL_WEIGHT_ROWS rows, a larger one DENSE_GEMV.max_m
    for n, taken in ((48, [1, 2, 3, 4]), (gemv.SMALL_WEIGHT_BYTES // 256 + 8, [1, 2])):
        calls.clear()
        w, b = _rand(n, 64, seed=4), _rand(n, seed=5)
        with torch.inference_mode():
            for rows in (1, 2, 3, 4, 5, 16):
                x = _rand(rows, width, seed=rows)
                ref = (torch.nn.functional.silu(x[:, :64]) * x[:, 64:]) if gated else x
                torch.testing.assert_close(linear(x, w, b, gated=gated), ref @ w.t() + b, rtol=1e-5, atol=1e-5)
            assert calls == taken, f"decode rows only, at most dense_gemv_rows ({n} x 64 weight)"
            linear(_rand(1, 64, seed=6), w.t().contiguous().t())      # a transposed weight: F.linear
            assert calls == taken


@pytest.mark.gpu(interpret=True)
def test_a_float32_weight_widens_a_narrower_input_on_every_path(monkeypatch):
    """A router's float32 weight against a bf16 row: float32 products and a float32 result, the
    decode kernel reading the bf16 row itself (no converted copy), the same as converting first."""
    from pipespec.kernels import gemv
    calls, kernel = [], gemv.rowmajor_gemv
    monkeypatch.setattr(gemv, "rowmajor_gemv", lambda x, w, **kw: calls.append(x.dtype) or kernel(x, w, **kw))
    w = _rand(64, 256, seed=7)
    for rows in (1, 5):
        x = _rand(rows, 256, seed=8).bfloat16()
        with torch.inference_mode():
            got = linear(x, w)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, x.float() @ w.t(), rtol=1e-5, atol=1e-5)
        if rows == 1:       # the kernel, on the bf16 row: what it gives on the converted one, to the
            # float32 rounding of a sum (the bf16 tile takes another register layout on the GPU, so
            # its lanes may sum in another order: an H200 differed in the last bits)
            torch.testing.assert_close(got, kernel(x.float(), w), rtol=1e-6, atol=1e-6 * got.abs().max().item())
    assert calls == [torch.bfloat16]
