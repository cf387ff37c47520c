"""The two-pass argmax (`kernels/argmax.py`) against torch's argmax, ties included. On a GPU; on CPU
only under the Triton interpreter."""
from __future__ import annotations


import pytest
import torch
from tests.kernels import DEVICE, ON_KERNELS

pytestmark = ON_KERNELS
DTYPES = [torch.float32, torch.bfloat16] if torch.cuda.is_available() else [torch.float32]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [100, 4096, 49152, 10000])
def test_argmax_equals_torch(vocab, dtype):
    from pipespec.kernels.argmax import argmax_rows
    x = torch.randn(5, vocab, generator=torch.Generator().manual_seed(vocab)).to(DEVICE, dtype)
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))


@pytest.mark.parametrize("dtype", DTYPES)
def test_ties_give_the_first_index_whatever_the_chunk(dtype):
    from pipespec.kernels.argmax import CHUNK, argmax_rows
    vocab = 3 * CHUNK + 17
    x = torch.zeros(4, vocab, dtype=dtype, device=DEVICE)
    x[0, [5, 9]] = 3.0                        # a tie inside one chunk
    x[1, [CHUNK + 1, 2 * CHUNK + 3]] = 3.0    # a tie across chunks
    x[2, [vocab - 1, CHUNK - 1]] = 3.0        # the first one in an earlier chunk, the other in the partial last
    x[3] = float("-inf")                      # nothing above -inf: index 0, as torch
    got = argmax_rows(x)
    assert got.tolist() == [5, CHUNK + 1, CHUNK - 1, 0]
    assert torch.equal(got, x.argmax(dim=-1))


def test_leading_dims_and_row_strides_are_kept():
    """[B, 1 + K, V] verify logits, and rows that are a slice of a wider buffer."""
    from pipespec.kernels.argmax import argmax_rows
    x = torch.randn(3, 4, 5000, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
    wide = torch.randn(6, 9000, generator=torch.Generator().manual_seed(2)).to(DEVICE)[:, :7000]
    assert torch.equal(argmax_rows(wide), wide.argmax(dim=-1))
    assert argmax_rows(wide[:0]).shape == (0,)
