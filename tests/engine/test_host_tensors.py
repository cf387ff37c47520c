"""The driver's list -> tensor helpers equal torch.tensor's result, and own their memory."""
from __future__ import annotations

import gc

import pytest
import torch

from pipespec.engine.host_tensors import float32_tensor, int64_tensor


@pytest.mark.parametrize("values", [[], [0], [3, -1, 7], [2**63 - 1, -2**63], list(range(1000))])
def test_int64_tensor_equals_torch_tensor(values):
    t = int64_tensor(values)
    assert t.dtype == torch.int64 and t.shape == (len(values),) and t.is_contiguous()
    assert torch.equal(t, torch.tensor(values, dtype=torch.int64))


@pytest.mark.parametrize("values", [[], [1.0], [0.1, 0.7, 1e-8, 3.4e38, -2.5], [1, 0]])
def test_float32_tensor_rounds_as_torch_tensor_does(values):
    t = float32_tensor(values)
    assert t.dtype == torch.float32 and t.shape == (len(values),)
    assert torch.equal(t, torch.tensor(values, dtype=torch.float32))


def test_a_value_outside_int64_is_refused():
    with pytest.raises(OverflowError):
        int64_tensor([2**63])


def test_the_tensor_keeps_its_memory_after_the_list_is_gone():
    t = int64_tensor(list(range(100, 164)))
    gc.collect()
    junk = [int64_tensor([-1] * 64) for _ in range(100)]      # reuse any freed memory
    assert t.tolist() == list(range(100, 164)) and len(junk) == 100
    t += 1                                                     # writable, like any tensor
    assert int(t[0]) == 101
