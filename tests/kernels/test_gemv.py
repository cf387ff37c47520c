"""The dense decode GEMV (`kernels/gemv.py`) against x @ W.T, and its gated input against the
unfused silu_mul then product. On a GPU; on CPU only under the Triton interpreter."""
from __future__ import annotations


import pytest
import torch
from tests.kernels import DEVICE, ON_KERNELS

pytestmark = ON_KERNELS
DTYPES = [torch.float32, torch.bfloat16] if torch.cuda.is_available() else [torch.float32]
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
SAME = {torch.float32: 1e-6, torch.bfloat16: 4e-3}     # the same products summed in another order


def _rand(*shape, seed, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


# (N, K): whole tiles; partial N tiles and K steps that do not divide K
SHAPES = [(256, 512), (200, 328), (8200, 136)]
LAUNCH = [None, dict(block_n=8, block_k=64, num_warps=2, split_k=3), dict(block_n=32, block_k=128, num_warps=4,
                                                                          split_k=1)]


def _shape(launch):
    from pipespec.kernels.gemv import DENSE_GEMV, Gemv
    return DENSE_GEMV if launch is None else Gemv(**launch)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("launch", LAUNCH, ids=lambda s: "default" if s is None else "n{block_n}_k{block_k}".format(**s))
@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("nk", SHAPES, ids=str)
def test_dense_gemv_equals_the_product(nk, m, launch, dtype):
    from pipespec.kernels.gemv import rowmajor_gemv
    n, k = nk
    w, x = _rand(n, k, seed=1, dtype=dtype), _rand(m, k, seed=2, dtype=dtype)
    got = rowmajor_gemv(x, w, shape=_shape(launch))
    assert got.shape == (m, n) and got.dtype == dtype
    assert _rel(got, x.float() @ w.float().t()) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("launch", LAUNCH[:2], ids=["default", "split3"])
@pytest.mark.parametrize("m", [1, 5])
@pytest.mark.parametrize("nk", SHAPES, ids=str)
def test_gated_input_is_silu_mul_then_the_product(nk, m, launch, dtype):
    """The fused activation rounds as silu_mul does, so fused and unfused multiply the same values;
    only the order of the sums may differ (the input's layout in registers does): float32's error."""
    from pipespec.kernels.fused_ops import silu_mul
    from pipespec.kernels.gemv import rowmajor_gemv
    n, k = nk
    w, gate_up = _rand(n, k, seed=3, dtype=dtype), _rand(m, 2 * k, seed=4, dtype=dtype)
    with torch.inference_mode():
        h = silu_mul(gate_up)
    shape = _shape(launch)
    got = rowmajor_gemv(gate_up, w, gated=True, shape=shape)
    assert _rel(got, rowmajor_gemv(h, w, shape=shape)) < SAME[dtype]
    ref = torch.nn.functional.silu(gate_up[:, :k].float()) * gate_up[:, k:].float()
    assert _rel(got, ref @ w.float().t()) < TOL[dtype]


def test_a_gated_input_of_the_wrong_width_is_refused():
    from pipespec.kernels.gemv import rowmajor_gemv
    with pytest.raises(ValueError, match="gated: twice that"):
        rowmajor_gemv(_rand(1, 64, seed=5), _rand(16, 64, seed=6), gated=True)


def test_split_k_sums_equal_the_unsplit_sum_in_split_order():
    """Split-K sums the splits' float32 partials in split order: the products of K's thirds added
    one after the other, and the same bits at every call."""
    from pipespec.kernels.gemv import Gemv, rowmajor_gemv
    n, k = 72, 192
    w, x = _rand(n, k, seed=7), _rand(2, k, seed=8)
    parts = [x[:, j:j + 64].double() @ w[:, j:j + 64].double().t() for j in (0, 64, 128)]
    split = Gemv(block_n=8, block_k=64, num_warps=2, split_k=3)
    for _ in range(3):
        got = rowmajor_gemv(x, w, shape=split)
        torch.testing.assert_close(got.double(), parts[0] + parts[1] + parts[2], atol=1e-4, rtol=1e-5)
    assert torch.equal(got, rowmajor_gemv(x, w, shape=split))


@pytest.mark.parametrize("nk", [(72, 192), (200, 328)], ids=str)
def test_a_split_tile_s_last_program_sums_the_partials_as_the_sum_kernel_does(nk):
    """With tail_sum a split tile's last program to finish adds the partials itself: the bits of
    the separate sum launch at every call (a count left above zero, or a partial read before it
    was stored, would change them), and every tile's count is zero again afterwards."""
    from dataclasses import replace

    from pipespec.kernels.gemv import Gemv, rowmajor_gemv, split_counts
    n, k = nk
    w, x = _rand(n, k, seed=30), _rand(2, k, seed=31)
    split = Gemv(block_n=8, block_k=64, num_warps=2, split_k=3)
    want = rowmajor_gemv(x, w, shape=replace(split, tail_sum=False))
    for _ in range(3):
        assert torch.equal(rowmajor_gemv(x, w, shape=split), want)
    counts = split_counts(torch.device(DEVICE), 1)
    assert counts is not None and int(counts.count_nonzero()) == 0


@pytest.mark.gpu             # CUDA graphs: a device, compiled kernels
def test_split_k_products_replayed_from_a_graph_stay_exact():
    """Many split products in a row, each reading the last one's output, replayed from a CUDA graph:
    every replay gives the eager chain's bits (a sum that read partials before they were written
    would not)."""
    from pipespec.kernels.gemv import Gemv, rowmajor_gemv
    split = Gemv(block_n=8, block_k=64, num_warps=2, split_k=4)
    ws = [_rand(256, 256, seed=20 + i, dtype=torch.bfloat16) * 0.1 for i in range(16)]
    x = _rand(1, 256, seed=9, dtype=torch.bfloat16)

    def chain():
        y = x
        for w in ws:
            y = rowmajor_gemv(y, w, shape=split)
        return y

    want = chain()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain()
    for _ in range(50):
        graph.replay()
        assert torch.equal(out, want)
