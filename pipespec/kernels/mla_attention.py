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
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _mla_kernel(ql_ptr, qr_ptr, cache_ptr, out_ptr, block_tables_ptr, query_start_ptr, seq_lens_ptr, scale,
                stride_qlt, stride_qlh, stride_qrt, stride_qrh, stride_ot, stride_oh, stride_ct, stride_bt,
                HEADS: tl.constexpr, R: tl.constexpr, R_PAD: tl.constexpr, DR: tl.constexpr, DR_PAD: tl.constexpr,
                PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    req = tl.program_id(0)
    tile = tl.program_id(1)
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
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, R_PAD], tl.float32)
    qk_scale = scale * 1.4426950408889634              # exp2 domain
    table = block_tables_ptr + req.to(tl.int64) * stride_bt
    for start in range(0, kv_end, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < kv_end
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
    out = acc / tl.maximum(l_i, 1e-30)[:, None]
    tl.store(out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + r[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (r[None, :] < R))


def mla_paged_attention(q_lat: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                        query_start_loc: torch.Tensor, seq_lens: torch.Tensor, max_query_len: int, scale: float,
                        page_size: int) -> torch.Tensor:
    """q_lat [T, H, R], q_rope [T, H, DR] (last dim contiguous); cache [slots, 1, >= R + DR] (this
    step's entries already written); block_tables [B, W]; query_start_loc [B + 1]; seq_lens [B];
    `max_query_len` a host int (it sizes the grid). Returns the latent outputs [T, H, R]."""
    t, heads, rank = q_lat.shape
    rope_dim = q_rope.shape[-1]
    assert q_lat.stride(-1) == 1 and q_rope.stride(-1) == 1 and cache.stride(-1) == 1
    out = torch.empty(t, heads, rank, dtype=q_lat.dtype, device=q_lat.device)
    batch = seq_lens.shape[0]
    if t == 0 or batch == 0:
        return out
    block_m = 16 if max_query_len * heads <= 16 else 32
    grid = (batch, triton.cdiv(max_query_len * heads, block_m))
    _mla_kernel[grid](
        q_lat, q_rope, cache, out, block_tables, query_start_loc, seq_lens, scale,
        q_lat.stride(0), q_lat.stride(1), q_rope.stride(0), q_rope.stride(1), out.stride(0), out.stride(1),
        cache.stride(0), block_tables.stride(0), HEADS=heads, R=rank, R_PAD=max(16, triton.next_power_of_2(rank)),
        DR=rope_dim, DR_PAD=max(16, triton.next_power_of_2(rope_dim)), PAGE=page_size, BLOCK_M=block_m,
        BLOCK_N=32, PRECISION="ieee" if q_lat.dtype == torch.float32 else "tf32",
        num_warps=8, num_stages=2)
    return out
