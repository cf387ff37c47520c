"""The int4 tensor-core decode kernel (`kernels/int4_mma.py`) against x @ W.T with the dequantized
weight, and which rows `int4_matmul` gives it. Gluon kernels do not run under the Triton
interpreter: GPU only (the CUDA-core GEMV it stands in for is checked on CPU too)."""
from __future__ import annotations

import pytest
import torch

from tests.kernels import rel, rows_reaching, shape_id
from tests.model.quant import writers

pytestmark = pytest.mark.gpu
# products and sums are exact in float32 ((q - z) is an integer, x a 16-bit float): the output's rounding
TOL = {torch.bfloat16: 5e-3, torch.float16: 1e-3}
# a lane's adjacent columns (`_column`): 2 at the default, 4, 2 and 1; split K summed by `_sum_splits`
# at the default, in the kernel's tail at the others
SHAPES = [None, dict(block_n=256, block_k=128, num_warps=4, split_k=2),
          dict(block_n=64, block_k=32, num_warps=2, split_k=3), dict(block_n=64, block_k=64, num_warps=4, split_k=2)]


def _packed(layout, n=160, k=512):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(8))
    packed, ref = writers.packed_int4(w, layout, group=128 if layout == "awq" else 64, seed=9)
    return packed.to(torch.device("cuda")), ref.cuda()


@pytest.fixture
def mma_calls(monkeypatch):
    """Row counts that reached the tensor-core kernel."""
    from pipespec.kernels import int4_mma
    return rows_reaching(monkeypatch, int4_mma, "int4_mma_matmul")


def _tiles(shape):
    from dataclasses import replace
    from pipespec.kernels.gemv import Gemv
    from pipespec.kernels.quant_matmul import DEFAULT_TILES
    return DEFAULT_TILES if shape is None else replace(DEFAULT_TILES, int4_mma=Gemv(**shape))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("layout", ["awq", "gptq", "gptq_act_order"])
def test_int4_mma_equals_the_dequantized_product(layout, rows, shape, dtype, mma_calls):
    """160 columns: a partial last tile for every shape; GPTQ's zeros are 1..16, AWQ's 0..15."""
    from pipespec.kernels.quant_matmul import int4_matmul
    packed, ref = _packed(layout)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(10)).to("cuda", dtype)
    with torch.inference_mode():
        got = int4_matmul(x, packed.qweight, packed.zeros, packed.scales, packed.group, packed.perm, _tiles(shape))
    assert mma_calls == [rows]
    assert got.shape == (rows, 160) and got.dtype == dtype
    assert rel(got, x.float() @ ref.t()) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [9, 16, 17, 32, 33, 64])
@pytest.mark.parametrize("layout", ["awq", "gptq_act_order"])
def test_int4_mma_takes_more_rows_when_its_shape_allows(layout, rows, dtype, mma_calls):
    """max_m up to 64: 16, 32 or 64 columns of x^T (more B fragments, shorter K steps), rows past M
    repeating the last."""
    from dataclasses import replace
    from pipespec.kernels.quant_matmul import DEFAULT_TILES, int4_matmul
    packed, ref = _packed(layout)
    tiles = replace(DEFAULT_TILES, int4_mma=replace(DEFAULT_TILES.int4_mma, max_m=64))
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(14)).to("cuda", dtype)
    with torch.inference_mode():
        got = int4_matmul(x, packed.qweight, packed.zeros, packed.scales, packed.group, packed.perm, tiles)
    assert mma_calls == [rows]
    assert got.shape == (rows, 160) and rel(got, x.float() @ ref.t()) < TOL[dtype]


def test_int4_mma_matches_the_cuda_core_gemv_at_a_real_shape():
    """An 8B-like o projection (4,096 x 4,096, group 128, split K chosen by the heuristic): both
    decode kernels give the exact product to within bf16 rounding."""
    from dataclasses import replace
    from pipespec.kernels.quant_matmul import DEFAULT_TILES, int4_matmul
    g = torch.Generator(device="cuda").manual_seed(11)
    q = torch.randint(-2**31, 2**31 - 1, (512, 4096), device="cuda", dtype=torch.int32, generator=g)
    z = torch.randint(0, 16, (32, 4096), device="cuda", generator=g).float()
    s = torch.rand(32, 4096, device="cuda", generator=g) * 0.01
    x = torch.randn(2, 4096, device="cuda", generator=g).bfloat16()
    with torch.inference_mode():
        mma = int4_matmul(x, q, z, s, 128)
        gemv = int4_matmul(x, q, z, s, 128, tiles=replace(DEFAULT_TILES, int4_mma=None))
        exact = int4_matmul(x.float(), q, z, s, 128)
    assert rel(mma, exact) < 3e-3 and rel(gemv, exact) < 3e-3


def test_rows_the_tensor_core_kernel_does_not_take_go_elsewhere(mma_calls):
    """float32 rows, more than max_m rows and groups of 16 (no 32-wide K step fits) take the other
    kernels, with the same product; the kernel itself names what it refuses."""
    from pipespec.kernels.int4_mma import int4_mma_matmul
    from pipespec.kernels.quant_matmul import DEFAULT_TILES, int4_matmul
    packed, ref = _packed("awq")
    with torch.inference_mode():
        for rows, dtype in ((2, torch.float32), (DEFAULT_TILES.int4_mma.max_m + 1, torch.bfloat16)):
            x = torch.randn(rows, 512, device="cuda").to(dtype)
            got = int4_matmul(x, packed.qweight, packed.zeros, packed.scales, packed.group)
            assert rel(got, x.float() @ ref.t()) < 2e-2
        packed16, ref16 = writers.packed_int4(torch.randn(160, 512, generator=torch.Generator().manual_seed(12)),
                                              "awq", group=16)
        packed16 = packed16.to(torch.device("cuda"))
        x = torch.randn(1, 512, device="cuda").bfloat16()
        got = int4_matmul(x, packed16.qweight, packed16.zeros, packed16.scales, 16)
        assert rel(got, x.float() @ ref16.cuda().t()) < 2e-2
        assert mma_calls == []
        with pytest.raises(ValueError, match="up to 64 bf16 / fp16 rows"):
            int4_mma_matmul(torch.randn(65, 512, device="cuda").bfloat16(), packed.qweight, packed.zeros,
                            packed.scales, 128, DEFAULT_TILES.int4_mma)
        with pytest.raises(ValueError, match="group size 16"):
            int4_mma_matmul(x, packed.qweight, packed.zeros, packed.scales, 16, DEFAULT_TILES.int4_mma)


@pytest.mark.gpu(capability=9)
def test_a_pdl_chain_of_int4_products_replayed_from_a_graph_equals_the_plain_one(monkeypatch, mma_calls):
    """Each product's input is the one before's output (split K, so a sum kernel between): with PDL
    on, a kernel that read x before its wait would see the last replay's rows."""
    from pipespec.kernels import pdl_scope
    from pipespec.kernels.pdl import pdl_on
    from pipespec.kernels.quant_matmul import int4_matmul
    from pipespec.stage.cuda_graphs import capture_graph
    g = torch.Generator(device="cuda").manual_seed(13)
    weights = []
    for k, n in [(1024, 2048), (2048, 1024)] * 4:
        q = torch.randint(-2**31, 2**31 - 1, (k // 8, n), device="cuda", dtype=torch.int32, generator=g)
        zeros = torch.full((k // 128, n), 8.0, device="cuda")
        scales = torch.full((k // 128, n), 0.22 / k**0.5, device="cuda")        # keeps each output ~N(0, 1)
        weights.append((q, zeros, scales))
    x = torch.zeros(1, 1024, device="cuda", dtype=torch.bfloat16)

    def chain():
        h = x
        for q, z, s in weights:
            h = int4_matmul(h, q, z, s, 128)
        return h

    outs = {}
    for pdl in ("0", "1"):
        monkeypatch.setenv("PIPESPEC_PDL", pdl)
        with pdl_scope():
            assert pdl_on(x.device) == (pdl == "1")
        with torch.inference_mode():
            graph, out = capture_graph(None, chain)
            results = []
            for seed in range(10):
                x.copy_(torch.randn(1, 1024, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed)))
                graph.replay()
                results.append(out.clone())
        outs[pdl] = torch.stack(results)
    assert mma_calls and outs["0"].abs().sum() > 0 and torch.isfinite(outs["0"]).all()
    assert torch.equal(outs["0"], outs["1"])
