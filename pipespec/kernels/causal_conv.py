"""Gated DeltaNet's causal depthwise conv over a step's lines, with its SiLU and its state update, in
one Triton kernel: `model/gated_deltanet.py::causal_conv_lines` plus the conv half of
`LinearMeta.commit_candidates` and `LinearMeta.store` (the PyTorch oracle and CPU path).

In PyTorch a step's conv is eight small kernels a layer (gather the lines' rows, mask the padding,
gather each request's past inputs from its slot, zero a fresh request's, concatenate, the windowed
product, its sum, SiLU) and its state update a few more, each microseconds of launch inside a decode
graph. Here a program owns one request and a slice of the channels. It copies the past inputs (zeros
for a request starting here, else the candidate its plan commits, else its slot's) and the line's
rows into a scratch line, convolves from it, and writes the new state: a plain line's last inputs to
its slot, or for a verify line the window after each row to that row's candidate. A step of
one-row lines (plain decode) keeps each window in registers instead: no scratch line and no barrier
between its stores and loads, the kernel's longest chain of memory round trips. The products
accumulate in float32, as a bf16 `conv1d` does on the GPU.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pipespec.kernels import cdiv, next_pow2
from pipespec.kernels.launch import cached_launch
from pipespec.kernels.pdl import pdl_args, pdl_signal, pdl_wait


@triton.jit
def _window(past, x_row, r, ok, fresh, live, C: tl.constexpr, PAST: tl.constexpr):
    """Rows r (a column [R, 1]) of a one-row line's window [past inputs, the row] at channels c, in
    x's dtype: past row r < PAST (zeros for a fresh request), the row itself at r == PAST (zeros if
    padding), zeros past it."""
    ptrs = tl.where(r < PAST, past[None, :] + r * C, x_row[None, :])
    mask = ok[None, :] & tl.where(r < PAST, not fresh, (r == PAST) & live)
    return tl.load(ptrs, mask=mask, other=0.0).to(x_row.dtype.element_ty)


@cached_launch
@triton.jit
def _causal_conv_kernel(x_ptr, rows_ptr, valid_ptr, len_ptr, conv_ptr, cand_ptr, slot_ptr, fresh_ptr, commit_ptr,
                        settle_ptr, w_ptr, out_ptr, line_ptr, length, cand_rows, stride_x, C: tl.constexpr,
                        PAST: tl.constexpr, BLOCK_C: tl.constexpr, ONE_ROW: tl.constexpr, WIN: tl.constexpr,
                        PDL: tl.constexpr):
    pdl_signal(PDL)
    pdl_wait(PDL)
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = c < C
    slot = tl.load(slot_ptr + b)
    commit = tl.load(commit_ptr + b)
    fresh = tl.load(fresh_ptr + b) != 0
    state = conv_ptr + slot * PAST * C + c                     # [PAST, C] a slot
    cand = cand_ptr + slot * cand_rows * PAST * C + c          # [R, PAST, C] a slot's candidates
    past = tl.where(commit >= 0, cand + tl.maximum(commit, 0) * PAST * C, state)
    if ONE_ROW:     # decode: the window in registers, no scratch line and no barrier (a shorter chain)
        live = tl.load(valid_ptr + b) != 0
        x_row = x_ptr + tl.load(rows_ptr + b) * stride_x + c
        r = tl.arange(0, WIN)[:, None]
        win = _window(past, x_row, r, ok, fresh, live, C, PAST).to(tl.float32)
        w = tl.load(w_ptr + c[None, :] * (PAST + 1) + r, mask=ok[None, :] & (r <= PAST), other=0.0).to(tl.float32)
        acc = tl.sum(w * win, axis=0)
        tl.store(out_ptr + b * C + c, (acc * tl.sigmoid(acc)).to(out_ptr.dtype.element_ty), mask=ok)
        # a one-row line has no drafts, so it settles: the window after its row to the slot (a
        # padding line, length 0, keeps its past); loaded before the store, which may overwrite it
        new = _window(past, x_row, r + tl.load(len_ptr + b), ok, fresh, live, C, PAST)
        tl.store(state[None, :] + r * C, new, mask=ok[None, :] & (r < PAST))
    else:           # an else, not a return above: Triton compiles what follows a return in a branch too
        line = line_ptr + b * (PAST + length) * C + c
        for j in tl.static_range(PAST):
            tl.store(line + j * C, tl.load(past + j * C, mask=ok & (not fresh), other=0.0), mask=ok)
        for t in range(length):                                    # the line's rows; padding rows zero
            live = tl.load(valid_ptr + b * length + t) != 0
            row = tl.load(rows_ptr + b * length + t)
            tl.store(line + (PAST + t) * C, tl.load(x_ptr + row * stride_x + c, mask=ok & live, other=0.0), mask=ok)
        tl.debug_barrier()                                         # the line is whole before it is read back
        for t in range(length):
            acc = tl.zeros([BLOCK_C], tl.float32)
            for j in tl.static_range(PAST + 1):
                w = tl.load(w_ptr + c * (PAST + 1) + j, mask=ok, other=0.0).to(tl.float32)
                acc += w * tl.load(line + (t + j) * C, mask=ok, other=0.0).to(tl.float32)
            tl.store(out_ptr + (b * length + t) * C + c, (acc * tl.sigmoid(acc)).to(out_ptr.dtype.element_ty), mask=ok)
        if tl.load(settle_ptr + b) != 0:                           # the inputs after the line's last row
            end = tl.load(len_ptr + b)
            for j in tl.static_range(PAST):
                tl.store(state + j * C, tl.load(line + (end + j) * C, mask=ok), mask=ok)
        else:                                                      # after row t: inputs t + 1 .. t + PAST
            for t in range(tl.minimum(length, cand_rows)):
                for j in tl.static_range(PAST):
                    tl.store(cand + (t * PAST + j) * C, tl.load(line + (t + 1 + j) * C, mask=ok), mask=ok)


def causal_conv(x: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor, lengths: torch.Tensor,
                conv: torch.Tensor, cand: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor,
                commit: torch.Tensor, settles: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [T, C] the step's rows (any row stride); rows, valid [B, L], lengths [B] (`LinearMeta`);
    conv [slots, W, C] and cand [slots, R, W, C] a layer's committed and candidate conv states;
    slots, fresh, commit, settles [B] as `fused_gated_delta_rule` takes them; weight [C, 1, W + 1].
    Returns silu(conv) [B, L, C], the states updated in place."""
    bsz, length = rows.shape
    channels, past = x.shape[1], conv.shape[1]
    if x.stride(1) != 1 or not conv.is_contiguous() or not cand.is_contiguous():
        raise ValueError("causal_conv needs unit-stride channels and contiguous state pools")
    out = torch.empty(bsz, length, channels, dtype=x.dtype, device=x.device)
    one_row = length == 1
    line = torch.empty(bsz, 1 if one_row else past + length, channels, dtype=x.dtype, device=x.device)  # scratch
    block = min(1024 if not one_row else 256, next_pow2(channels))
    _causal_conv_kernel[(bsz, cdiv(channels, block))](
        x, rows.contiguous(), valid.contiguous(), lengths.contiguous(), conv, cand, slots.contiguous(),
        fresh.contiguous(), commit.contiguous(), settles.contiguous(), weight.contiguous(), out, line, length,
        cand.shape[1], x.stride(0), C=channels, PAST=past, BLOCK_C=block, ONE_ROW=one_row,
        WIN=next_pow2(past + 1), num_warps=4, **pdl_args(x.device))
    return out
