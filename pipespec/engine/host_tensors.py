"""Host tensors from Python lists, built the cheap way.

`torch.tensor(list)` inspects every element in Python; an `array` of one C type converts the list
in C, and `torch.frombuffer` shares its memory (the tensor holds a reference to the array). The
driver builds ~17 such tensors a step, the block table of thousands of ids among them, so at large
batches the Python path was a large share of the scheduler's time (RESULTS.md).
"""
from __future__ import annotations

from array import array

import torch


def int64_tensor(values) -> torch.Tensor:
    """int64 [len(values)]; OverflowError for a value outside int64."""
    buf = array("q", values)
    return torch.frombuffer(buf, dtype=torch.int64) if buf else torch.empty(0, dtype=torch.int64)


def float32_tensor(values) -> torch.Tensor:
    """float32 [len(values)], each value rounded to float32 as torch.tensor rounds it."""
    buf = array("f", values)
    return torch.frombuffer(buf, dtype=torch.float32) if buf else torch.empty(0, dtype=torch.float32)

