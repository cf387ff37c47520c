"""The quantized matrix products (int4 from AWQ and GPTQ with act-order, block-scaled FP8) against
x @ W.T with the dequantized weight. On a GPU; on CPU only under the Triton interpreter
(TRITON_INTERPRET=1 with triton installed), which is how the kernels were first checked."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from pipespec.model.quant.packed import Fp8Weight, Int4Weight
from tests.model.quant import writers
from tests.kernels import DEVICE, ON_KERNELS, rel, shape_id

pytestmark = ON_KERNELS
# float32: exact products up to summation order; bf16: the activations' rounding (GPU only: the
# interpreter multiplies bf16 tiles as their bit patterns)
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
DTYPES = [torch.float32, torch.bfloat16] if torch.cuda.is_available() else [torch.float32]


def _x(m, k, dtype, seed=0):
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 5, 40])
@pytest.mark.parametrize("layout", ["awq", "gptq", "gptq_act_order"])
def test_int4_matmul_equals_the_dequantized_product(layout, m, dtype):
    w = torch.randn(96, 256, generator=torch.Generator().manual_seed(1))
    packed, ref = writers.packed_int4(w, layout, group=64 if layout == "awq" else 32, seed=2)
    x = _x(m, 256, dtype)
    got = packed.to(torch.device(DEVICE)).matmul(x)
    assert got.shape == (m, 96) and got.dtype == dtype
    assert rel(got, x.float() @ ref.to(DEVICE).t()) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 3, 16, 40])
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.bfloat16])
def test_int4_zeros_and_scales_in_16_bits_give_the_float32_product(scale_dtype, m, dtype):
    """Zeros and scales as a checkpoint stores them (fp16; bf16 for some exports) are widened in the
    kernels: every path (the CUDA-core GEMV, the tensor-core decode kernel on a GPU, the tl.dot
    kernel at 40 rows) gives exactly what float32 copies of the same values give."""
    w = torch.randn(96, 256, generator=torch.Generator().manual_seed(1))
    packed, _ = writers.packed_int4(w, "gptq", group=64, seed=2)
    narrow = Int4Weight(packed.qweight, packed.zeros.to(scale_dtype), packed.scales.to(scale_dtype), 64)
    wide = Int4Weight(packed.qweight, narrow.zeros.float(), narrow.scales.float(), 64)
    x = _x(m, 256, dtype)
    dev = torch.device(DEVICE)
    assert torch.equal(narrow.to(dev).matmul(x), wide.to(dev).matmul(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 33])
def test_fp8_block_matmul_equals_the_dequantized_product(m, dtype):
    from pipespec.kernels.quant_matmul import fp8_block_matmul
    w = torch.randn(200, 320, generator=torch.Generator().manual_seed(3))   # partial blocks on both sides
    t, ref = writers.fp8(w, (128, 128))
    x = _x(m, 320, dtype, seed=4)
    got = fp8_block_matmul(x, t["weight"].to(DEVICE), t["weight_scale_inv"].to(DEVICE), (128, 128))
    assert got.shape == (m, 200) and got.dtype == dtype
    assert rel(got, x.float() @ ref.to(DEVICE).t()) < TOL[dtype]


def test_tensor_parallel_shards_multiply_like_their_slice_of_the_weight():
    """A column-parallel shard is a view of some output columns of the packed tensors, a row-parallel
    one of some input rows: on the device each multiplies like that slice of the dense weight."""
    w = torch.randn(128, 256, generator=torch.Generator().manual_seed(5))
    t, ref = writers.awq(w, group=64)
    int4 = Int4Weight.from_awq(t["qweight"], t["qzeros"], t["scales"].float(), 64)
    t, ref8 = writers.fp8(w, (32, 64))
    fp8 = Fp8Weight(t["weight"], t["weight_scale_inv"], (32, 64))
    x = _x(3, 256, torch.float32)
    for packed, dense in ((int4, ref), (fp8, ref8)):
        got = packed.rows(32, 96).to(torch.device(DEVICE)).matmul(x)
        assert rel(got, x.float() @ dense[32:96].to(DEVICE).t()) < 1e-5
        got = packed.columns(64, 192).to(torch.device(DEVICE)).matmul(x[:, 64:192])
        assert rel(got, x[:, 64:192].float() @ dense[:, 64:192].to(DEVICE).t()) < 1e-5


@pytest.mark.parametrize("split_k", [2, 3, 5])
def test_split_k_sums_the_same_product(split_k):
    """The tl.dot kernels' split of K over programs (uneven splits included) changes only the
    summation order."""
    from pipespec.kernels.quant_matmul import DEFAULT_TILES, Tiles, fp8_block_matmul, int4_matmul
    w = torch.randn(64, 512, generator=torch.Generator().manual_seed(6))
    t, ref = writers.awq(w, group=64)
    int4 = Int4Weight.from_awq(t["qweight"], t["qzeros"], t["scales"].float(), 64).to(torch.device(DEVICE))
    t8, ref8 = writers.fp8(w, (32, 64))
    x = _x(2, 512, torch.float32, seed=7)
    tiles = Tiles(block_n=32, split_k=split_k, int4_gemv=replace(DEFAULT_TILES.int4_gemv, max_m=0),
                  fp8_gemv=replace(DEFAULT_TILES.fp8_gemv, max_m=0))          # 2 rows, yet not the decode path
    got = int4_matmul(x, int4.qweight, int4.zeros, int4.scales, 64, tiles=tiles)
    assert rel(got, x @ ref.to(DEVICE).t()) < 1e-5
    got = fp8_block_matmul(x, t8["weight"].to(DEVICE), t8["weight_scale_inv"].to(DEVICE), (32, 64), tiles)
    assert rel(got, x @ ref8.to(DEVICE).t()) < 1e-5


def test_split_k_fills_the_gpu_only_when_the_grid_does_not():
    from pipespec.kernels.quant_matmul import split_k_for
    assert split_k_for(64, 64, 132) == 5            # a 4,096-wide projection at batch 1: 320 programs
    assert split_k_for(448, 64, 132) == 1           # gate_up: 448 tiles already fill 132 SMs
    assert split_k_for(8, 8, 132) == 2              # short K: each split keeps >= 4 tiles


def test_decode_split_k_fills_the_gpu_while_partials_stay_small():
    from pipespec.kernels.gemv import gemv_split_k
    int4_o, fp8_o = 4096 * 4096 // 2, 4096 * 4096
    assert gemv_split_k(16, 128, 132, 4096, int4_o, 4096) == 64      # int4 o_proj at batch 1: partials cap it
    assert gemv_split_k(16, 32, 132, 4096, int4_o, 4096) == 32       # no more splits than K steps
    assert gemv_split_k(16, 128, 132, 16384, int4_o, 4096) == 17     # bigger steps: fewer programs needed
    assert gemv_split_k(256, 8, 132, 8192, fp8_o, 4096) == 3         # fp8 o_proj: ~30 KB in flight an SM
    assert gemv_split_k(1792, 8, 132, 8192, 28672 * 4096, 28672) == 1  # fp8 gate_up fills the GPU alone


# Decode kernels (M <= max_m rows, no tl.dot): the default shapes (max_m 8; int4's splits K itself,
# its one 160-column tile being too few programs) and others (max_m 4) with split-K forced above 1;
# at 1 row, a middle count, max_m and max_m + 1 (the tl.dot path); partial N tiles and, for FP8,
# partial K steps and scale blocks narrower than a step.
INT4_GEMV = [None, dict(block_n=128, block_k=64, num_warps=1, split_k=3),
             dict(block_n=512, block_k=128, num_warps=4, split_k=2)]
FP8_GEMV = [None, dict(block_n=32, block_k=128, num_warps=4, split_k=2),
            dict(block_n=8, block_k=64, num_warps=2, split_k=3)]


def _tiles(kind, shape, max_m=None):
    from pipespec.kernels.quant_matmul import DEFAULT_TILES
    field = f"{kind}_gemv"
    gemv = getattr(DEFAULT_TILES, field)
    gemv = replace(gemv, **(shape or {}), **({} if max_m is None else {"max_m": max_m}))
    # the CUDA-core kernel, not the tensor-core one that serves 16-bit rows first (test_int4_mma.py,
    # test_fp8_mma.py)
    return replace(DEFAULT_TILES, **{field: gemv, f"{kind}_mma": None}), gemv.max_m


@pytest.fixture
def gemv_calls(monkeypatch):
    """The row counts that reached the decode kernels' launcher (which path served a call)."""
    from pipespec.kernels import gemv, quant_matmul
    calls, launch = [], gemv._launch_gemv
    for module in (gemv, quant_matmul):     # the fp8 path launches from gemv.py, int4's from quant_matmul.py
        monkeypatch.setattr(module, "_launch_gemv", lambda kernel, x, *a, **k: calls.append(x.shape[0]) or
                            launch(kernel, x, *a, **k))
    return calls


def _int4(layout):
    w = torch.randn(160, 512, generator=torch.Generator().manual_seed(8))
    return writers.packed_int4(w, layout, group=64 if layout == "awq" else 32, seed=9)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", INT4_GEMV, ids=shape_id)
@pytest.mark.parametrize("m", ["one", "middle", "max", "past_max"])
@pytest.mark.parametrize("layout", ["awq", "gptq", "gptq_act_order"])
def test_int4_decode_kernel_equals_the_dequantized_product(layout, m, shape, dtype, gemv_calls):
    from pipespec.kernels.quant_matmul import int4_matmul
    tiles, max_m = _tiles("int4", shape, max_m=4 if shape else None)
    rows = {"one": 1, "middle": max_m // 2 + 1, "max": max_m, "past_max": max_m + 1}[m]
    packed, ref = _int4(layout)
    packed = packed.to(torch.device(DEVICE))
    x = _x(rows, 512, dtype, seed=10)
    got = int4_matmul(x, packed.qweight, packed.zeros, packed.scales, packed.group, packed.perm, tiles)
    assert gemv_calls == ([] if rows > max_m else [rows])
    assert got.shape == (rows, 160) and got.dtype == dtype
    assert rel(got, x.float() @ ref.to(DEVICE).t()) < TOL[dtype]


@pytest.mark.parametrize("rows", [1, 2, 3])
def test_int4_decode_kernel_on_16_bit_rows_is_within_their_rounding(rows):
    """Up to 2 fp16 / bf16 rows take the conversion that multiplies 2**23 + q * 2**lo by x * 2**-lo
    and takes the 2**(23 - lo) * x terms off once a step (float32 rows and more rows the exact one): its sums
    stay within ~2**-13 of the rows' scale, so the fp16 result is the exact product's to within
    fp16 rounding (~3e-4 relative here). fp16 because the interpreter rounds bf16 loads its own way."""
    from pipespec.kernels.quant_matmul import int4_matmul
    packed, ref = _int4("awq")
    packed = packed.to(torch.device(DEVICE))
    x = _x(rows, 512, torch.float16, seed=17) * 8
    with torch.inference_mode():
        got = int4_matmul(x, packed.qweight, packed.zeros, packed.scales, packed.group, tiles=_tiles("int4", None)[0])
        exact = int4_matmul(x.float(), packed.qweight, packed.zeros, packed.scales, packed.group)
    assert got.dtype == torch.float16
    assert rel(got, x.float() @ ref.to(DEVICE).t()) < 1e-3
    assert rel(got, exact) < 1e-3


def test_int4_decode_split_tiles_sum_in_their_last_program_as_the_sum_kernel_does():
    from pipespec.kernels.quant_matmul import int4_matmul
    packed, _ = _int4("awq")
    packed = packed.to(torch.device(DEVICE))
    x = _x(2, 512, torch.float32, seed=16)
    tiles, _ = _tiles("int4", INT4_GEMV[1])
    separate, _ = _tiles("int4", dict(INT4_GEMV[1], tail_sum=False))
    want = int4_matmul(x, packed.qweight, packed.zeros, packed.scales, packed.group, tiles=separate)
    for _ in range(2):
        assert torch.equal(int4_matmul(x, packed.qweight, packed.zeros, packed.scales, packed.group, tiles=tiles), want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", FP8_GEMV, ids=shape_id)
@pytest.mark.parametrize("m", ["one", "middle", "max", "past_max"])
@pytest.mark.parametrize("block", [(128, 128), (32, 64)])
def test_fp8_decode_kernel_equals_the_dequantized_product(block, m, shape, dtype, gemv_calls):
    from pipespec.kernels.quant_matmul import fp8_block_matmul
    tiles, max_m = _tiles("fp8", shape, max_m=4 if shape else None)
    rows = {"one": 1, "middle": max_m // 2 + 1, "max": max_m, "past_max": max_m + 1}[m]
    w = torch.randn(200, 320, generator=torch.Generator().manual_seed(11))    # partial blocks on both sides
    t, ref = writers.fp8(w, block)
    x = _x(rows, 320, dtype, seed=12)
    got = fp8_block_matmul(x, t["weight"].to(DEVICE), t["weight_scale_inv"].to(DEVICE), block, tiles)
    assert gemv_calls == ([] if rows > max_m else [rows])
    assert got.shape == (rows, 200) and got.dtype == dtype
    assert rel(got, x.float() @ ref.to(DEVICE).t()) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 5, 9])
def test_fp8_gated_input_is_silu_mul_then_the_product(m, dtype):
    """A down projection's gate/up row: read by the CUDA-core decode kernel itself, activated first
    by `silu_mul` on the others (the MMA kernels, tl.dot); either way the product of silu(gate) * up."""
    from pipespec.kernels.fused_ops import silu_mul
    from pipespec.kernels.quant_matmul import fp8_block_matmul
    w = torch.randn(200, 320, generator=torch.Generator().manual_seed(13))
    t, ref = writers.fp8(w, (128, 128))
    weight, scales = t["weight"].to(DEVICE), t["weight_scale_inv"].to(DEVICE)
    gate_up = _x(m, 640, dtype, seed=14)
    with torch.inference_mode():
        h = silu_mul(gate_up)
    got = fp8_block_matmul(gate_up, weight, scales, (128, 128), gated=True)
    assert got.shape == (m, 200)
    assert rel(got, fp8_block_matmul(h, weight, scales, (128, 128))) < (1e-6 if dtype == torch.float32 else 4e-3)
    assert rel(got, h.float() @ ref.to(DEVICE).t()) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 5, 9])
@pytest.mark.parametrize("layout", ["awq", "gptq_act_order"])
def test_int4_gated_input_is_silu_mul_then_the_product(layout, m, dtype):
    """Activated by `silu_mul` first at every row count (the decode kernel's lanes would each redo
    it): the same bits as the product of silu(gate) * up."""
    from pipespec.kernels.fused_ops import silu_mul
    packed, ref = _int4(layout)
    packed = packed.to(torch.device(DEVICE))
    gate_up = _x(m, 1024, dtype, seed=15)
    with torch.inference_mode():
        h = silu_mul(gate_up)
    got = packed.matmul(gate_up, gated=True)
    assert got.shape == (m, 160)
    assert torch.equal(got, packed.matmul(h))
    assert rel(got, h.float() @ ref.to(DEVICE).t()) < TOL[dtype]
