"""The FP8 tensor-core decode kernel (`kernels/fp8_mma.py`) against x @ W.T with the dequantized
weight, and which rows `fp8_block_matmul` gives it. Gluon kernels do not run under the Triton
interpreter: GPU only (the CUDA-core GEMV it stands in for is checked on CPU too)."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tests.kernels import rel, rows_reaching, shape_id
from tests.model.quant import writers

pytestmark = pytest.mark.gpu
# the widened weights are exact, products and sums float32: the output's rounding
TOL = {torch.bfloat16: 5e-3, torch.float16: 1e-3}
# 2 rows a lane at the default, then 4 (256 columns), 2 warps, 8 warps (1 tile each) and a 64-wide
# K step; split K summed by `_sum_splits` at the default, in the kernel's tail at the others
SHAPES = [None, dict(block_n=256, block_k=128, num_warps=4, split_k=2),
          dict(block_n=64, block_k=128, num_warps=2, split_k=3), dict(block_n=128, block_k=64, num_warps=8, split_k=2)]


def _fp8(block, n=200, k=512, seed=8):
    t, ref = writers.fp8(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)), block)
    return t["weight"].cuda(), t["weight_scale_inv"].cuda(), ref.cuda()


def _tiles(**fp8_mma):
    """The kernel from one row up (the defaults give one row to the CUDA-core GEMV)."""
    from pipespec.kernels.quant_matmul import DEFAULT_TILES
    return replace(DEFAULT_TILES, fp8_mma=replace(DEFAULT_TILES.fp8_mma, min_m=1, **fp8_mma))


@pytest.fixture
def mma_calls(monkeypatch):
    """Row counts that reached the tensor-core kernel."""
    from pipespec.kernels import fp8_mma
    return rows_reaching(monkeypatch, fp8_mma, "fp8_mma_matmul")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("block", [(128, 128), (32, 64)])
def test_fp8_mma_equals_the_dequantized_product(block, rows, shape, dtype, mma_calls):
    """200 output rows: a partial last tile for every shape and a partial last scale row; 32 x 64
    blocks: several scale rows a tile, a step as wide as a block."""
    from pipespec.kernels.quant_matmul import fp8_block_matmul
    weight, scales, ref = _fp8(block)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(10)).to("cuda", dtype)
    with torch.inference_mode():
        got = fp8_block_matmul(x, weight, scales, block, _tiles(**(shape or {})))
    assert mma_calls == [rows]
    assert got.shape == (rows, 200) and got.dtype == dtype
    assert rel(got, x.float() @ ref.t()) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [2, 9, 16, 17, 32])
def test_fp8_mma_takes_2_to_32_rows_by_default(rows, dtype, mma_calls):
    """16 or 32 columns of x^T past 8 rows (more B fragments, 64-wide K steps at 32), rows past M
    repeating the last."""
    from pipespec.kernels.quant_matmul import fp8_block_matmul
    weight, scales, ref = _fp8((128, 128))
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(14)).to("cuda", dtype)
    with torch.inference_mode():
        got = fp8_block_matmul(x, weight, scales, (128, 128))
    assert mma_calls == [rows]
    assert got.shape == (rows, 200) and rel(got, x.float() @ ref.t()) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_e4m3_value_widens_exactly(dtype):
    """All 254 finite e4m3 bytes (subnormals, both zeros, +-448), one a weight row, against one-hot
    rows of x: every output is that weight times its block scale, rounded once. bf16 rows take the
    weights as w * 2**-112 and scale the sums back (by a large scale too: no float32 overflow)."""
    from pipespec.kernels.quant_matmul import fp8_block_matmul
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)     # not NaN
    w = torch.zeros(256, 128, dtype=torch.uint8)
    w[:codes.numel()] = codes[:, None]
    weight = w.view(torch.float8_e4m3fn).cuda()
    scales = torch.tensor([[2.0 ** -10], [3.0e4]], device="cuda")                   # two 128-row blocks
    x = torch.eye(128, device="cuda", dtype=dtype)[:8]
    with torch.inference_mode():
        got = fp8_block_matmul(x, weight, scales, (128, 128))
    exact = weight.float() * scales.repeat_interleave(128, 0)                         # [256, 128]: one per row
    assert torch.equal(got, exact[:, :8].t().to(dtype))


def test_small_products_are_summed_to_the_outputs_rounding():
    """bf16 rows of tiny activations (2**-20 .. 2**-12: most products of e4m3 weights below 2**-14,
    subnormal in float32 once scaled by 2**-112), of every size (2**-20 .. 2**4), and of normal ones:
    each row's products are summed to within bf16 rounding of the exact sum."""
    from pipespec.kernels.quant_matmul import fp8_block_matmul
    g = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 256, (256, 1024), generator=g, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0
    weight = codes.view(torch.float8_e4m3fn).cuda()
    sign = torch.randn(4, 1024, generator=g).sign()
    exps = torch.stack([torch.randint(-20, -11, (1024,), generator=g), torch.randint(-20, 5, (1024,), generator=g),
                        torch.zeros(1024, dtype=torch.int64), torch.zeros(1024, dtype=torch.int64)])
    x = (sign * torch.rand(4, 1024, generator=g).add(1) * 2.0 ** exps).cuda().bfloat16()
    with torch.inference_mode():
        got = fp8_block_matmul(x, weight, torch.ones(2, 8, device="cuda"), (128, 128))
    exact = x.double() @ weight.double().t()
    for row in range(4):
        assert rel(got[row], exact[row]) < 4e-3, row


def test_fp8_mma_matches_the_cuda_core_gemv_at_a_real_shape():
    """An 8B-like o projection (4,096 x 4,096, 128 x 128 blocks, split K by the heuristic) and its
    gated down projection (a gate/up row in, `silu_mul` first): both decode kernels give the
    float32 product to within bf16 rounding."""
    from pipespec.kernels.quant_matmul import DEFAULT_TILES, fp8_block_matmul
    g = torch.Generator(device="cuda").manual_seed(11)
    weight = (torch.randn(4096, 4096, device="cuda", generator=g) * 40).to(torch.float8_e4m3fn)   # |w| < 448
    scales = torch.rand(32, 32, device="cuda", generator=g) * 1e-3
    gemv = replace(DEFAULT_TILES, fp8_mma=None)
    with torch.inference_mode():
        for width, gated in ((4096, False), (8192, True)):
            x = torch.randn(2, width, device="cuda", generator=g).bfloat16()
            mma = fp8_block_matmul(x, weight, scales, (128, 128), gated=gated)
            cuda_cores = fp8_block_matmul(x, weight, scales, (128, 128), gemv, gated=gated)
            exact = fp8_block_matmul(x.float(), weight, scales, (128, 128), gated=gated)
            assert rel(mma, exact) < 3e-3 and rel(cuda_cores, exact) < 3e-3


def test_rows_the_tensor_core_kernel_does_not_take_go_elsewhere(mma_calls):
    """One row (the CUDA-core GEMV streams it faster), float32 rows, more than max_m rows and a K
    with no 64-wide step inside its blocks (K = 96) take the other kernels, with the same product;
    the kernel itself names what it refuses."""
    from pipespec.kernels.fp8_mma import fp8_mma_matmul
    from pipespec.kernels.quant_matmul import DEFAULT_TILES, fp8_block_matmul
    weight, scales, ref = _fp8((128, 128))
    with torch.inference_mode():
        for rows, dtype in ((1, torch.bfloat16), (2, torch.float32), (DEFAULT_TILES.fp8_mma.max_m + 1, torch.bfloat16)):
            x = torch.randn(rows, 512, device="cuda").to(dtype)
            assert rel(fp8_block_matmul(x, weight, scales, (128, 128)), x.float() @ ref.t()) < 2e-2
        w96, s96, ref96 = _fp8((128, 128), k=96)
        x = torch.randn(1, 96, device="cuda").bfloat16()
        assert rel(fp8_block_matmul(x, w96, s96, (128, 128)), x.float() @ ref96.t()) < 2e-2
        assert mma_calls == []
        with pytest.raises(ValueError, match="up to 32 bf16 / fp16 rows"):
            fp8_mma_matmul(torch.randn(33, 512, device="cuda").bfloat16(), weight, scales, (128, 128),
                           DEFAULT_TILES.fp8_mma)
        with pytest.raises(ValueError, match="no step of 64-wide chunks"):
            fp8_mma_matmul(x, w96, s96, (128, 128), DEFAULT_TILES.fp8_mma)
