"""Causal attention of variable-length query runs against a paged KV cache, in one Triton kernel.

One kernel serves every step shape: prefill (long query runs), chunked prefill (a run whose earlier
tokens sit in cache blocks), decode (one row per request) and verify (1 + K rows per request). Each
request's query rows are its last `q_len` positions, so row t of a request with KV length L sits at
position L - q_len + t and sees keys 0..that position.

Programs are laid out (request, KV head, tile of query rows). The rows of a tile are (token, head)
pairs of one KV head's query-head group, so a GQA group shares every K/V load and even a one-token
decode fills a tensor-core tile. Softmax is the online (running max) form, in float32.

Split KV (flash-decoding): a few requests over long contexts give too few programs to keep the GPU's
memory busy (batch 1, 8 KV heads: 8 programs on 132 SMs). Then each (request, head, tile) is also
split into `num_splits` ranges of its KV, each writing its partial (max, sum, weighted values) to a
scratch buffer, and `_combine_kernel` merges them. The number of splits depends only on host shapes
(batch, heads, the block table's width: `kv_splits`, `kernels/kv_split.py`), so a captured graph
fixes it; each split finds its own range from the device's sequence lengths, and a split with
nothing to read contributes nothing.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pipespec.kernels import cdiv, next_pow2, sm_count, sm_limits
from pipespec.kernels.kv_split import FIXED_TILES, MAX_SPLITS, resident_programs, wave_splits
from pipespec.kernels.launch import cached_launch
from pipespec.kernels.pdl import pdl_args, pdl_signal, pdl_wait


@triton.jit
def store_partial(part_m_ptr, part_l_ptr, part_acc_ptr, part, m_i, l_i, acc, d, row_ok, read_any, DIM: tl.constexpr):
    """A split's partials at index `part` [rows] (values [rows, d]); a split that read no keys
    stores its max alone, which `_combine_kernel` reads as empty."""
    tl.store(part_m_ptr + part, m_i, mask=row_ok)
    if read_any:
        tl.store(part_l_ptr + part, l_i, mask=row_ok)
        tl.store(part_acc_ptr + part[:, None] * DIM + d[None, :], acc, mask=row_ok[:, None] & (d[None, :] < DIM))


@cached_launch
@triton.jit
def _paged_attention_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, query_start_ptr, seq_lens_ptr,
        part_m_ptr, part_l_ptr, part_acc_ptr, num_heads, scale, stride_qt, stride_qh, stride_ot, stride_oh, stride_ct, stride_ch, stride_bt,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, NUM_SPLITS: tl.constexpr,
        PDL: tl.constexpr):
    pdl_signal(PDL)
    pdl_wait(PDL)
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    tile = tl.program_id(2)
    split = 0
    if NUM_SPLITS > 1:
        split = tile % NUM_SPLITS
        tile = tile // NUM_SPLITS
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
    lo = 0
    hi = kv_end
    if NUM_SPLITS > 1:     # this split's share of the keys, whole BLOCK_N tiles
        chunk = ((kv_end + NUM_SPLITS - 1) // NUM_SPLITS + BLOCK_N - 1) // BLOCK_N * BLOCK_N
        lo = split * chunk
        hi = tl.minimum(lo + chunk, kv_end)
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)     # finite: a fully masked row stays NaN-free
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    qk_scale = scale * 1.4426950408889634              # exp2 domain
    table = block_tables_ptr + req.to(tl.int64) * stride_bt
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < hi
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
    if NUM_SPLITS > 1:     # partials of (row, head, split); _combine_kernel merges a row's splits
        store_partial(part_m_ptr, part_l_ptr, part_acc_ptr, (q_rows * num_heads + head) * NUM_SPLITS + split,
                      m_i, l_i, acc, d, row_ok, lo < hi, HEAD_DIM)
    else:
        out = acc / tl.maximum(l_i, 1e-30)[:, None]
        tl.store(out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


@cached_launch
@triton.jit
def _combine_kernel(part_m_ptr, part_l_ptr, part_acc_ptr, out_ptr, num_heads, stride_ot, stride_oh,
                    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS: tl.constexpr,
                    PDL: tl.constexpr):
    """out[row, head] from its splits' partials. A split that read no keys stored only its max
    (-1e30): it weighs 0 and its sum and values are not read, so the splits a short context leaves
    empty cost one float each (MLA's partial is 512 values a head)."""
    pdl_signal(PDL)
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS)
    s_ok = s < NUM_SPLITS
    part = (row * num_heads + head) * NUM_SPLITS + s
    m = tl.load(part_m_ptr + part, mask=s_ok, other=float("-inf"))
    used = m > -1.0e29
    w = tl.where(used, tl.exp2(m - tl.max(m, axis=0)), 0.0)
    l_sum = tl.sum(w * tl.load(part_l_ptr + part, mask=used, other=0.0), axis=0)
    d = tl.arange(0, DIM_PAD)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :], mask=used[:, None] & (d[None, :] < HEAD_DIM),
                  other=0.0)
    out = tl.sum(w[:, None] * acc, axis=0) / tl.maximum(l_sum, 1e-30)
    tl.store(out_ptr + row * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def split_partials(out: torch.Tensor, num_splits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Float32 scratch for a split-KV launch writing out [T, H, D]: (max, sum) [T * H * splits] and
    values [T * H * splits, D]; unsplit launches pass `out` itself in their place (never read)."""
    if num_splits == 1:
        return out, out, out
    t, heads, dim = out.shape
    part_m = torch.empty(t * heads * num_splits, dtype=torch.float32, device=out.device)
    return part_m, torch.empty_like(part_m), torch.empty(t * heads * num_splits, dim, dtype=torch.float32,
                                                          device=out.device)


def combine_splits(part_m: torch.Tensor, part_l: torch.Tensor, part_acc: torch.Tensor, out: torch.Tensor,
                   num_splits: int) -> torch.Tensor:
    """Merge the float32 partials [T * H * splits (, D)] of a split-KV launch into out [T, H, D]."""
    t, heads, dim = out.shape
    _combine_kernel[(t, heads)](part_m, part_l, part_acc, out, heads, out.stride(0), out.stride(1), HEAD_DIM=dim,
                                DIM_PAD=next_pow2(dim), NUM_SPLITS=num_splits,
                                SPLITS=next_pow2(num_splits), num_warps=4, **pdl_args(out.device))
    return out


def _block_m(rows_per_request: int) -> int:
    return 16 if rows_per_request <= 16 else 32 if rows_per_request <= 32 else 64


@dataclass(frozen=True)
class Launch:
    """The kernel's launch shape: the defaults, or a benchmark's candidates (`attention_kernel.py
    --sweep`). 0 picks by the query tile: for tiles of <= 32 rows (decode, verify) 128 keys a step,
    3 stages, 4 warps, the best of a sweep (RESULTS.md); for prefill tiles 64 keys, 2 stages,
    8 warps (their K and V tiles would not fit three stages in shared memory at 128 keys).
    fixed_tiles, max_splits: the split rule's cost of a program beyond its key tiles and its cap
    (`wave_splits`)."""
    block_n: int = 0
    num_stages: int = 0
    num_warps: int = 0
    fixed_tiles: int = FIXED_TILES
    max_splits: int = MAX_SPLITS

    def resolved(self, block_m: int) -> tuple[int, int, int]:
        """(block_n, num_stages, num_warps) for a query tile of `block_m` rows."""
        small = block_m <= 32
        return (self.block_n or (128 if small else 64), self.num_stages or (3 if small else 2),
                self.num_warps or (4 if small else 8))


DEFAULT_LAUNCH = Launch()


def _tile(q: torch.Tensor, key_cache: torch.Tensor, max_query_len: int, launch: Launch) -> tuple[int, ...]:
    """(query tiles a request and KV head, block_m, block_n, num_stages, num_warps) of a launch."""
    rows = max_query_len * (q.shape[1] // key_cache.shape[1])
    block_m = _block_m(rows)
    return (cdiv(rows, block_m), block_m, *launch.resolved(block_m))


def _launch_args(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, out: torch.Tensor,
                 block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                 parts: tuple, max_query_len: int, scale: float, page_size: int, launch: Launch):
    """The kernel's arguments, its constexprs and launch options but NUM_SPLITS, and its query tiles."""
    heads, dim = q.shape[1:]
    tiles, block_m, block_n, num_stages, num_warps = _tile(q, key_cache, max_query_len, launch)
    args = (q, key_cache, value_cache, out, block_tables, query_start_loc, seq_lens, *parts, heads, scale,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), key_cache.stride(0), key_cache.stride(1),
            block_tables.stride(0))
    meta = dict(GROUP=heads // key_cache.shape[1], HEAD_DIM=dim, PAGE=page_size, BLOCK_M=block_m, BLOCK_N=block_n,
                PRECISION="ieee" if q.dtype == torch.float32 else "tf32",        # float32 stays exact
                num_warps=num_warps, num_stages=num_stages, **pdl_args(q.device))
    return args, meta, tiles


_RESIDENT: dict[tuple, int] = {}      # programs an SM runs at once, per device and compiled variant


def kv_splits(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor,
              query_start_loc: torch.Tensor, seq_lens: torch.Tensor, max_query_len: int, page_size: int,
              launch: Launch = DEFAULT_LAUNCH) -> int:
    """The KV splits `paged_attention` takes by default for these inputs: `wave_splits` for the
    block table's width over the GPU's slots for this kernel, SMs x the programs of its split
    variant one SM runs at once (from the compiled registers and shared memory; 1 under the
    interpreter)."""
    heads, dim = q.shape[1:]
    tiles, block_m, block_n, num_stages, num_warps = _tile(q, key_cache, max_query_len, launch)
    key = (q.device, q.dtype, key_cache.dtype, heads, key_cache.shape[1], dim, page_size, block_m, block_n,
           num_stages, num_warps)
    resident = _RESIDENT.get(key)
    if resident is None:
        resident = 1
        if _paged_attention_kernel.jit:
            f32 = torch.empty(1, dtype=torch.float32, device=q.device)
            args, meta, _ = _launch_args(q, key_cache, value_cache, q, block_tables, query_start_loc, seq_lens,
                                         (f32, f32, f32), max_query_len, 1.0, page_size, launch)
            compiled = _paged_attention_kernel.fn.warmup(*args, grid=(1, 1, 1), NUM_SPLITS=2, **meta)
            _ = compiled.run        # loads the binary: its register count is known from then on
            resident = resident_programs(compiled.n_regs, compiled.metadata.shared, num_warps, sm_limits(q.device))
        _RESIDENT[key] = resident
    return wave_splits(seq_lens.shape[0] * key_cache.shape[1] * tiles, block_tables.shape[1] * page_size,
                       sm_count(q.device) * resident, block_n, launch.max_splits, fixed_tiles=launch.fixed_tiles)


def paged_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                    max_query_len: int, scale: float, page_size: int,
                    out: torch.Tensor | None = None, num_splits: int | None = None,
                    launch: Launch = DEFAULT_LAUNCH) -> torch.Tensor:
    """q [T, H, D] (any row/head strides); caches [slots, KVH, D]; block_tables [B, W];
    query_start_loc [B + 1]; seq_lens [B] (KV length after this step, new rows included, already
    written). `max_query_len` is a host int bounding every request's query run (it sizes the grid, so
    a captured graph fixes it). `num_splits`: KV splits per program (None: `kv_splits`'s).
    Returns out [T, H, D]."""
    t, heads, dim = q.shape
    assert q.stride(2) == 1 and key_cache.stride(2) == 1 and dim & (dim - 1) == 0
    if out is None:
        out = torch.empty(t, heads, dim, dtype=q.dtype, device=q.device)
    batch = seq_lens.shape[0]
    if t == 0 or batch == 0:
        return out
    if num_splits is None:
        num_splits = kv_splits(q, key_cache, value_cache, block_tables, query_start_loc, seq_lens, max_query_len,
                               page_size, launch)
    split = num_splits > 1
    part_m, part_l, part_acc = split_partials(out, num_splits)
    args, meta, tiles = _launch_args(q, key_cache, value_cache, out, block_tables, query_start_loc, seq_lens,
                                     (part_m, part_l, part_acc), max_query_len, scale, page_size, launch)
    _paged_attention_kernel[(batch, key_cache.shape[1], tiles * num_splits)](*args, NUM_SPLITS=num_splits, **meta)
    if split:
        combine_splits(part_m, part_l, part_acc, out, num_splits)
    return out
