"""Repacking AWQ and GPTQ (with and without act-order) into the one int4 layout the GPU kernels read
(`Int4Weight`): it dequantizes to exactly the weight the checkpoint stands for (our writers compute
that weight from the integers before packing), and layouts it cannot hold are refused by name."""
from __future__ import annotations

import pytest
import torch

from pipespec.model.quant.packed import Int4Weight, pack_int4_along_k
from tests.model.quant import writers


def _weight(out=48, inp=256, seed=0):
    return torch.randn(out, inp, generator=torch.Generator().manual_seed(seed))


def test_pack_along_k_puts_row_8k_plus_i_in_nibble_i():
    q = torch.randint(0, 16, (16, 3), generator=torch.Generator().manual_seed(1))
    words = pack_int4_along_k(q).to(torch.int64) & 0xFFFFFFFF
    for i in range(8):
        assert torch.equal((words >> (4 * i)) & 0xF, q[i::8])


def test_awq_repacked_dequantizes_to_the_checkpoint_weight():
    tensors, ref = writers.awq(_weight(), group=64)
    w = Int4Weight.from_awq(tensors["qweight"], tensors["qzeros"], tensors["scales"].float(), 64)
    assert w.shape == (48, 256) and w.perm is None
    torch.testing.assert_close(w.dequantize(), ref, rtol=0, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_zeros_and_scales_keep_a_16_bit_checkpoint_dtype_on_the_device(dtype):
    """AWQ / GPTQ checkpoints store fp16 scales: `to` keeps them (half the bytes of float32 for the
    kernels to read) and turns other dtypes into float32; the weight it stands for is the same."""
    tensors, _ = writers.awq(_weight(), group=64)
    w = Int4Weight.from_awq(tensors["qweight"], tensors["qzeros"], tensors["scales"].to(dtype), 64)
    moved = w.to(torch.device("cpu"))
    want = dtype if dtype != torch.float64 else torch.float32
    assert moved.zeros.dtype == moved.scales.dtype == want
    torch.testing.assert_close(moved.dequantize(), w.dequantize().float(), rtol=0, atol=0)


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_repacked_dequantizes_to_the_checkpoint_weight(act_order):
    tensors, ref = writers.gptq(_weight(seed=2), group=32, act_order=act_order, seed=3)
    w = Int4Weight.from_gptq(tensors["qweight"], tensors["qzeros"], tensors["scales"].float(), tensors["g_idx"])
    assert (w.perm is not None) == act_order and w.group == 32
    torch.testing.assert_close(w.dequantize(), ref, rtol=0, atol=1e-6)


def test_gptq_groups_of_unequal_size_are_refused():
    tensors, _ = writers.gptq(_weight(seed=4), group=32, act_order=False)
    g_idx = tensors["g_idx"].clone()
    g_idx[0] = 1                                   # group 0 one row short, group 1 one row over
    with pytest.raises(ValueError, match="does not give every group 32 rows"):
        Int4Weight.from_gptq(tensors["qweight"], tensors["qzeros"], tensors["scales"], g_idx)
