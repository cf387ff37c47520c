"""Causal attention of variable-length query runs against a paged KV cache, in one Triton kernel.

One kernel serves every step shape: prefill (long query runs), chunked prefill (a run whose earlier
tokens sit in cache blocks), decode (one row per request) and verify (1 + K rows per request). Each
request's query rows are its last `q_len` positions, so row t of a request with KV length L sits at
position L - q_len + t and sees keys 0..that position.

Programs are laid out (request, KV head, tile of query rows). The rows of a tile are (token, head)
pairs of one KV head's query-head group, so a GQA group shares every K/V load and even a one-token
decode fills a tensor-core tile. Softmax is the online (running max) form, in float32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_attention_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, query_start_ptr, seq_lens_ptr,
        scale, stride_qt, stride_qh, stride_ot, stride_oh, stride_ct, stride_ch, stride_bt,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    tile = tl.program_id(2)
    q_start = tl.load(query_start_ptr + req)
    q_len = tl.load(query_start_ptr + req + 1) - q_start
    if tile * BLOCK_M >= q_len * GROUP:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    first_pos = seq_len - q_len

    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    tok = rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = tok < q_len
    d = tl.arange(0, HEAD_DIM)
    q_rows = (q_start + tok).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None], other=0.0)
    q_pos = first_pos + tok

    # keys past the tile's last query position are masked for every row: stop there
    last_tok = tl.minimum(tile * BLOCK_M + BLOCK_M - 1, q_len * GROUP - 1) // GROUP
    kv_end = first_pos + last_tok + 1
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)     # finite: a fully masked row stays NaN-free
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    qk_scale = scale * 1.4426950408889634              # exp2 domain
    table = block_tables_ptr + req.to(tl.int64) * stride_bt
    for start in range(0, kv_end, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < kv_end
        page = tl.load(table + n // PAGE, mask=n_ok, other=0).to(tl.int64)
        slot = page * PAGE + n % PAGE
        kv_off = slot[None, :] * stride_ct + kv_head * stride_ch + d[:, None]
        k = tl.load(k_cache_ptr + kv_off, mask=n_ok[None, :], other=0.0)          # [D, N]
        s = tl.dot(q, k, input_precision=PRECISION) * qk_scale
        allowed = (n[None, :] <= q_pos[:, None]) & n_ok[None, :]
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_cache_ptr + slot[:, None] * stride_ct + kv_head * stride_ch + d[None, :],
                    mask=n_ok[:, None], other=0.0)                                  # [N, D]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    out = acc / tl.maximum(l_i, 1e-30)[:, None]
    tl.store(out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def _block_m(rows_per_request: int) -> int:
    return 16 if rows_per_request <= 16 else 32 if rows_per_request <= 32 else 64


def paged_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                    max_query_len: int, scale: float, page_size: int,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, H, D] (any row/head strides); caches [slots, KVH, D]; block_tables [B, W];
    query_start_loc [B + 1]; seq_lens [B] (KV length after this step, new rows included, already
    written). `max_query_len` is a host int bounding every request's query run (it sizes the grid, so
    a captured graph fixes it). Returns out [T, H, D]."""
    t, heads, dim = q.shape
    kv_heads = key_cache.shape[1]
    group = heads // kv_heads
    assert q.stride(2) == 1 and key_cache.stride(2) == 1 and dim & (dim - 1) == 0
    if out is None:
        out = torch.empty(t, heads, dim, dtype=q.dtype, device=q.device)
    batch = seq_lens.shape[0]
    if t == 0 or batch == 0:
        return out
    rows = max_query_len * group
    block_m = _block_m(rows)
    grid = (batch, kv_heads, triton.cdiv(rows, block_m))
    _paged_attention_kernel[grid](
        q, key_cache, value_cache, out, block_tables, query_start_loc, seq_lens, scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), key_cache.stride(0), key_cache.stride(1),
        block_tables.stride(0), GROUP=group, HEAD_DIM=dim, PAGE=page_size, BLOCK_M=block_m,
        BLOCK_N=64, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # float32 stays exact
        num_warps=4 if block_m <= 32 else 8, num_stages=2)
    return out
