"""The greedy token of each row: argmax over the vocabulary, in two passes over chunks of it.

torch's reduction gives each row one thread block, so at batch 1 one SM reads a whole row of
logits, slowly for a large vocabulary (RESULTS.md), and a K = 3 speculative step takes four of
them. Here every (row, chunk of 4,096 logits) is a
program that keeps its maximum and the first index holding it; a second pass takes, per row, the
first chunk holding the row's maximum. So the index is the first one of the maximum, as torch's
argmax returns it, and the result does not depend on the chunking. (A NaN logit is not the
maximum here, where torch would return it; logits are never NaN in a working model.)
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pipespec.kernels import cdiv, next_pow2
from pipespec.kernels.launch import cached_launch
from pipespec.kernels.pdl import pdl_args, pdl_signal, pdl_wait

CHUNK = 4096


@cached_launch
@triton.jit
def _chunk_argmax_kernel(x_ptr, val_ptr, idx_ptr, V, stride_row, CHUNKS: tl.constexpr, BLOCK: tl.constexpr,
                         PDL: tl.constexpr):
    pdl_signal(PDL)
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * stride_row + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
    best, at = tl.max(x, 0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(val_ptr + row * CHUNKS + chunk, best)
    tl.store(idx_ptr + row * CHUNKS + chunk, chunk * BLOCK + at)


@cached_launch
@triton.jit
def _row_argmax_kernel(val_ptr, idx_ptr, out_ptr, CHUNKS: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr):
    pdl_signal(PDL)
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    vals = tl.load(val_ptr + row * CHUNKS + c, mask=c < CHUNKS, other=float("-inf"))
    _, first = tl.max(vals, 0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(out_ptr + row, tl.load(idx_ptr + row * CHUNKS + first).to(tl.int64))


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits [..., V] (the last dim contiguous) -> int64 [...], the first index of each row's
    maximum: `logits.argmax(dim=-1)`."""
    lead, vocab = logits.shape[:-1], logits.shape[-1]
    x = logits.reshape(-1, vocab)
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows = x.shape[0]
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    if rows == 0:
        return out.view(lead)
    chunks = cdiv(vocab, CHUNK)
    vals = torch.empty(rows, chunks, dtype=torch.float32, device=x.device)
    idx = torch.empty(rows, chunks, dtype=torch.int32, device=x.device)
    _chunk_argmax_kernel[(rows, chunks)](x, vals, idx, vocab, x.stride(0), CHUNKS=chunks, BLOCK=CHUNK, num_warps=4,
                                         **pdl_args(x.device))
    _row_argmax_kernel[(rows,)](vals, idx, out, CHUNKS=chunks, BLOCK_C=next_pow2(chunks), num_warps=1,
                                **pdl_args(x.device))
    return out.view(lead)
