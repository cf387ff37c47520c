"""`stage.carry.carry_in` as one kernel: async scheduling's fill-in of carried lines runs in every steady
step's CUDA graph, where its ~30 small PyTorch ops cost more than a small model's layer.

One program per block of rows. A row writes only what changes (the ids it takes from the carry, its
moved position and slot, its drafter id), so a row whose id stays is never written and any program
may read it; the first row of a carried line also moves its request's sequence length and sets its
linear-attention commit. Same results as the PyTorch version, bit for bit (integers only).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pipespec.kernels import cdiv
from pipespec.kernels.launch import cached_launch


@cached_launch
@triton.jit
def _carry_in_kernel(ids_ptr, pos_ptr, slot_ptr, mtp_ptr, seq_ptr, commit_ptr, line_ptr, qsl_ptr, carried_ptr,
                     real_ptr, tok_ptr, drafts_ptr, shift_ptr, cand_ptr, tables_ptr, num_rows, table_stride, width,
                     block_size,
                     K: tl.constexpr, BLOCK: tl.constexpr):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = rows < num_rows
    req = tl.load(line_ptr + rows, mask=live, other=0)
    src = tl.load(carried_ptr + req, mask=live, other=-1)
    has = live & (src >= 0)
    src = tl.maximum(src, 0)
    off = rows - tl.load(qsl_ptr + req, mask=live, other=0)
    end = tl.load(qsl_ptr + req + 1, mask=live, other=0)
    # ids: the line's first row takes the token sampled, its real draft rows the drafts proposed
    first = has & (off == 0)
    tl.store(ids_ptr + rows, tl.load(tok_ptr + src, mask=first, other=0), mask=first)
    nxt = tl.load(ids_ptr + rows + 1, mask=has & (rows + 1 < end), other=0)     # never rewritten: see below
    if K > 0:
        real = tl.load(real_ptr + req, mask=has, other=0)
        draft = has & (off >= 1) & (off <= real)
        tl.store(ids_ptr + rows, tl.load(drafts_ptr + src * K + off - 1, mask=draft, other=0), mask=draft)
        nxt_draft = has & (rows + 1 < end) & (off + 1 <= real)
        nxt = tl.where(nxt_draft, tl.load(drafts_ptr + src * K + off, mask=nxt_draft, other=0), nxt)
    # the drafter's id of a row is the next row's (the line's last row keeps its placeholder)
    tl.store(mtp_ptr + rows, nxt, mask=has & (rows + 1 < end))
    # the line moves on by the drafts its previous step accepted
    shift = tl.load(shift_ptr + src, mask=has, other=0)
    moved = has & (shift > 0)
    pos = tl.load(pos_ptr + rows, mask=moved, other=0) + shift
    tl.store(pos_ptr + rows, pos, mask=moved)
    block = tl.load(tables_ptr + req * table_stride + tl.minimum(pos // block_size, width - 1), mask=moved, other=0)
    tl.store(slot_ptr + rows, block * block_size + pos % block_size, mask=moved)
    tl.store(seq_ptr + req, tl.load(seq_ptr + req, mask=first, other=0) + shift, mask=first)
    tl.store(commit_ptr + req, tl.load(cand_ptr + src, mask=first, other=-1), mask=first)


def carry_in_rows(input_ids, positions, slot_mapping, mtp_input_ids, seq_lens, state_commit, row_reqs,
                  query_start_loc, carried, num_drafts, block_tables, tokens, drafts, shift, commit,
                  block_size: int) -> None:
    """`pipespec.stage.carry.carry_in`, in place, in one launch (no host read: graph-capturable).
    Per row [T]: ids, positions, slots, drafter ids, request; per request [B]: sequence lengths,
    commits, carried result row, real drafts; block_tables [B, W]; the carry's per-result-row
    tokens, drafts [N, K], shift and commit candidate."""
    n = row_reqs.shape[0]
    if n == 0:
        return
    block = 128
    _carry_in_kernel[(cdiv(n, block),)](
        input_ids, positions, slot_mapping, mtp_input_ids, seq_lens, state_commit, row_reqs, query_start_loc,
        carried, num_drafts, tokens, drafts, shift, commit, block_tables, n, block_tables.stride(0),
        block_tables.shape[1], block_size, K=drafts.shape[1], BLOCK=block)
