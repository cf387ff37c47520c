"""Gated DeltaNet's causal depthwise conv over a step's lines, with its SiLU, in one Triton kernel:
`model/gated_deltanet.py::causal_conv_lines` (the PyTorch oracle and CPU path) for decode and verify.

In PyTorch a step's conv is eight small kernels a layer (gather the lines' rows, mask the padding,
gather each request's past inputs from its slot, zero a fresh request's, concatenate, the windowed
product, its sum, SiLU), each microseconds of launch inside a decode graph. Here a program owns one
request and a slice of the channels: it copies the past inputs (from the slot, zeros for a request
starting here) and the line's rows into the line's input buffer, which the state update reads
(`LinearMeta.store`), then convolves from it. The products accumulate in float32, as a bf16
`conv1d` does on the GPU.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _causal_conv_kernel(x_ptr, rows_ptr, valid_ptr, pool_ptr, slot_ptr, fresh_ptr, w_ptr, out_ptr, full_ptr,
                        length, stride_x, C: tl.constexpr, PAST: tl.constexpr, BLOCK_C: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = c < C
    slot = tl.load(slot_ptr + b)
    fresh = tl.load(fresh_ptr + b) != 0
    full = full_ptr + b * (PAST + length) * C
    for j in tl.static_range(PAST):                  # past inputs: the slot's, or zeros
        past = tl.load(pool_ptr + (slot * PAST + j) * C + c, mask=ok & (not fresh), other=0.0)
        tl.store(full + j * C + c, past, mask=ok)
    for t in range(length):                          # the line's rows; padding rows zero
        live = tl.load(valid_ptr + b * length + t) != 0
        row = tl.load(rows_ptr + b * length + t)
        tl.store(full + (PAST + t) * C + c, tl.load(x_ptr + row * stride_x + c, mask=ok & live, other=0.0),
                 mask=ok)
    tl.debug_barrier()                               # the buffer is whole before any thread reads it back
    for t in range(length):
        acc = tl.zeros([BLOCK_C], tl.float32)
        for j in tl.static_range(PAST + 1):
            w = tl.load(w_ptr + c * (PAST + 1) + j, mask=ok, other=0.0).to(tl.float32)
            acc += w * tl.load(full + (t + j) * C + c, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + (b * length + t) * C + c, (acc * tl.sigmoid(acc)).to(out_ptr.dtype.element_ty), mask=ok)


def causal_conv(x: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor,
                fresh: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, C] the step's rows (any row stride); rows, valid [B, L] (`LinearMeta`); pool [slots, W, C]
    a layer's conv states (read only); slots, fresh [B]; weight [C, 1, W + 1]. Returns (silu(conv)
    [B, L, C], the lines' inputs [B, W + L, C]: past inputs, then each row's)."""
    bsz, length = rows.shape
    channels, past = x.shape[1], pool.shape[1]
    if x.stride(1) != 1 or not pool.is_contiguous():
        raise ValueError("causal_conv needs unit-stride channels and a contiguous state pool")
    out = torch.empty(bsz, length, channels, dtype=x.dtype, device=x.device)
    full = torch.empty(bsz, past + length, channels, dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(channels))
    _causal_conv_kernel[(bsz, triton.cdiv(channels, block))](
        x, rows.contiguous(), valid.contiguous(), pool, slots.contiguous(), fresh.contiguous(),
        weight.contiguous(), out, full, length, x.stride(0), C=channels, PAST=past, BLOCK_C=block, num_warps=4)
    return out, full
