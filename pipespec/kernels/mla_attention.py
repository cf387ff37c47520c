"""Absorbed multi-head latent attention (DeepSeek-V2/V3, GLM MLA) against the paged latent cache, in
one Triton kernel.

Each cache slot holds [latent c (R values) | rope key (DR values) | anything after]. With q_nope
already folded through W_uk into latent space, row i of head h scores
    s = q_lat[i, h] . c + q_rope[i, h] . k_rope
and its output is the softmax-weighted sum of the latents c (W_uv is applied by the caller). Every
head shares the one cached "head", so a program takes a tile of (token, head) rows of one request
and streams that request's slots once for all of them: the latents are the keys and the values.

The causal rule and the online softmax follow `paged_attention`: a request's query rows are its
last q_len positions and row t sees keys 0 .. seq_len - q_len + t.

Split KV, as `paged_attention` does it: at batch 1 a request's 16-32 head rows are one or two
programs, which read the whole context one key tile after another, leaving most of the GPU idle
(the longer the context, the worse). So each tile's keys are also split over
`num_splits` programs (a host number: a captured graph fixes it), each taking at least MIN_CHUNK
keys from the device's sequence length, and `paged_attention.combine_splits` merges the partials;
splits past a short context store one float each and are skipped by the merge.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pipespec.kernels import cdiv, next_pow2, sm_count
from pipespec.kernels.launch import cached_launch
from pipespec.kernels.kv_split import num_kv_splits
from pipespec.kernels.paged_attention import combine_splits, split_partials, store_partial
from pipespec.kernels.pdl import pdl_args, pdl_signal, pdl_wait

MIN_CHUNK = 64        # keys a split takes at least: its 512-value partial a head costs what ~14 keys do


@dataclass(frozen=True)
class MLALaunch:
    """The kernel's launch shape (`benchmarks/mla_kernel.py --sweep` times others). block_m 0: 16
    rows a tile when a request's rows fit, else 32. 64 keys a step with 8 warps: the best swept at
    GLM-4.7-Flash's heads, batch 1 (RESULTS.md)."""
    block_m: int = 0
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 2


DEFAULT_MLA_LAUNCH = MLALaunch()


@cached_launch
@triton.jit
def _mla_kernel(ql_ptr, qr_ptr, cache_ptr, out_ptr, block_tables_ptr, query_start_ptr, seq_lens_ptr,
                part_m_ptr, part_l_ptr, part_acc_ptr, scale,
                stride_qlt, stride_qlh, stride_qrt, stride_qrh, stride_ot, stride_oh, stride_ct, stride_bt,
                HEADS: tl.constexpr, R: tl.constexpr, R_PAD: tl.constexpr, DR: tl.constexpr, DR_PAD: tl.constexpr,
                PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
                NUM_SPLITS: tl.constexpr, MIN_KEYS: tl.constexpr, PDL: tl.constexpr):
    pdl_signal(PDL)
    pdl_wait(PDL)
    req = tl.program_id(0)
    tile = tl.program_id(1)
    split = tl.program_id(2)
    q_start = tl.load(query_start_ptr + req)
    q_len = tl.load(query_start_ptr + req + 1) - q_start
    if tile * BLOCK_M >= q_len * HEADS:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    first_pos = seq_len - q_len

    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    tok = rows // HEADS
    head = rows % HEADS
    row_ok = tok < q_len
    q_rows = (q_start + tok).to(tl.int64)
    r = tl.arange(0, R_PAD)
    dr = tl.arange(0, DR_PAD)
    ql = tl.load(ql_ptr + q_rows[:, None] * stride_qlt + head[:, None] * stride_qlh + r[None, :],
                 mask=row_ok[:, None] & (r[None, :] < R), other=0.0)
    qr = tl.load(qr_ptr + q_rows[:, None] * stride_qrt + head[:, None] * stride_qrh + dr[None, :],
                 mask=row_ok[:, None] & (dr[None, :] < DR), other=0.0)
    q_pos = first_pos + tok

    last_tok = tl.minimum(tile * BLOCK_M + BLOCK_M - 1, q_len * HEADS - 1) // HEADS
    kv_end = first_pos + last_tok + 1
    lo = 0
    hi = kv_end
    if NUM_SPLITS > 1:     # this split's share of the keys: whole BLOCK_N tiles, at least MIN_KEYS
        chunk = tl.maximum((kv_end + NUM_SPLITS - 1) // NUM_SPLITS, MIN_KEYS)
        chunk = (chunk + BLOCK_N - 1) // BLOCK_N * BLOCK_N
        lo = split * chunk
        hi = tl.minimum(lo + chunk, kv_end)
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, R_PAD], tl.float32)
    qk_scale = scale * 1.4426950408889634              # exp2 domain
    table = block_tables_ptr + req.to(tl.int64) * stride_bt
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < hi
        page = tl.load(table + n // PAGE, mask=n_ok, other=0).to(tl.int64)
        slot = page * PAGE + n % PAGE
        lat = tl.load(cache_ptr + slot[:, None] * stride_ct + r[None, :],
                      mask=n_ok[:, None] & (r[None, :] < R), other=0.0)                        # [N, R]
        rope = tl.load(cache_ptr + slot[None, :] * stride_ct + R + dr[:, None],
                       mask=n_ok[None, :] & (dr[:, None] < DR), other=0.0)                     # [DR, N]
        s = tl.dot(ql, tl.trans(lat), input_precision=PRECISION)
        s = (s + tl.dot(qr, rope, input_precision=PRECISION)) * qk_scale
        allowed = (n[None, :] <= q_pos[:, None]) & n_ok[None, :]
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(lat.dtype), lat, input_precision=PRECISION)
        m_i = m_new
    if NUM_SPLITS > 1:
        store_partial(part_m_ptr, part_l_ptr, part_acc_ptr, (q_rows * HEADS + head) * NUM_SPLITS + split,
                      m_i, l_i, acc, r, row_ok, lo < hi, R)
    else:
        out = acc / tl.maximum(l_i, 1e-30)[:, None]
        tl.store(out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + r[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (r[None, :] < R))


def mla_paged_attention(q_lat: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                        query_start_loc: torch.Tensor, seq_lens: torch.Tensor, max_query_len: int, scale: float,
                        page_size: int, num_splits: int | None = None,
                        launch: MLALaunch = DEFAULT_MLA_LAUNCH) -> torch.Tensor:
    """q_lat [T, H, R], q_rope [T, H, DR] (last dim contiguous); cache [slots, 1, >= R + DR] (this
    step's entries already written); block_tables [B, W]; query_start_loc [B + 1]; seq_lens [B];
    `max_query_len` a host int (it sizes the grid). `num_splits`: KV splits a tile (None: from the
    host shapes, as `paged_attention` picks them); `launch`: the launch shape. Returns the latent
    outputs [T, H, R]."""
    t, heads, rank = q_lat.shape
    rope_dim = q_rope.shape[-1]
    assert q_lat.stride(-1) == 1 and q_rope.stride(-1) == 1 and cache.stride(-1) == 1
    out = torch.empty(t, heads, rank, dtype=q_lat.dtype, device=q_lat.device)
    batch = seq_lens.shape[0]
    if t == 0 or batch == 0:
        return out
    block_m = launch.block_m or (16 if max_query_len * heads <= 16 else 32)
    tiles = cdiv(max_query_len * heads, block_m)
    if num_splits is None:
        num_splits = num_kv_splits(batch * tiles, block_tables.shape[1] * page_size, sm_count(q_lat.device),
                                   min_kv=2 * MIN_CHUNK, keys_per_split=MIN_CHUNK)
    part_m, part_l, part_acc = split_partials(out, num_splits)
    _mla_kernel[(batch, tiles, num_splits)](
        q_lat, q_rope, cache, out, block_tables, query_start_loc, seq_lens, part_m, part_l, part_acc, scale,
        q_lat.stride(0), q_lat.stride(1), q_rope.stride(0), q_rope.stride(1), out.stride(0), out.stride(1),
        cache.stride(0), block_tables.stride(0), HEADS=heads, R=rank, R_PAD=max(16, next_pow2(rank)),
        DR=rope_dim, DR_PAD=max(16, next_pow2(rope_dim)), PAGE=page_size, BLOCK_M=block_m,
        BLOCK_N=launch.block_n if q_lat.element_size() <= 2 else min(launch.block_n, 32),   # float32: smem
        PRECISION="ieee" if q_lat.dtype == torch.float32 else "tf32", NUM_SPLITS=num_splits,
        MIN_KEYS=MIN_CHUNK, num_warps=launch.num_warps, num_stages=launch.num_stages, **pdl_args(q_lat.device))
    if num_splits > 1:
        combine_splits(part_m, part_l, part_acc, out, num_splits)
    return out
