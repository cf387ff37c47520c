"""Attention over a paged KV cache, behind a small backend interface.

A backend turns the step's plan into its own metadata once per step (`prepare`), then serves every
layer's `forward`. Model code only sees `AttentionBackend`; a GPU kernel backend slots in beside the
reference one without touching it. The per-step metadata travels in `ForwardContext`, an explicit
argument, never a module global.
"""
from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pipespec import kernels


logger = logging.getLogger(__name__)


@dataclass
class KVCache:
    """One layer's paged cache: key and value, each [num_blocks * block_size, num_kv_heads, head_dim]."""

    key: torch.Tensor
    value: torch.Tensor


@dataclass(frozen=True)
class CacheShape:
    """What one layer's paged cache holds per token: key [kv_heads, key_dim] and value
    [kv_heads, value_dim]. Families declare theirs (`cache_shapes()` of a target slice), so the stage
    sizes and allocates caches of any shape: a value_dim of 0 stores one tensor per token (an MLA
    latent, say), a layer with no KV (linear attention) declares none."""

    kv_heads: int
    key_dim: int
    value_dim: int

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        return self.kv_heads * (self.key_dim + self.value_dim) * torch.empty((), dtype=dtype).element_size()


def allocate_caches(shapes: list[CacheShape], num_blocks: int, block_size: int, dtype: torch.dtype,
                    device) -> list[KVCache]:
    # torch.empty: pages are only touched as slots are written, and every read is masked to
    # slots written earlier, so the cache needs no zeroing.
    slots = num_blocks * block_size
    return [KVCache(torch.empty((slots, s.kv_heads, s.key_dim), dtype=dtype, device=device),
                    torch.empty((slots, s.kv_heads, s.value_dim), dtype=dtype, device=device)) for s in shapes]


def cache_bytes_per_block(shapes: list[CacheShape], block_size: int, dtype: torch.dtype) -> int:
    return block_size * sum(s.bytes_per_token(dtype) for s in shapes)


def allocate_kv_caches(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                       head_dim: int, dtype: torch.dtype, device) -> list[KVCache]:
    """`num_layers` caches of standard attention layers (keys and values of `head_dim`)."""
    return allocate_caches([CacheShape(num_kv_heads, head_dim, head_dim)] * num_layers, num_blocks, block_size,
                           dtype, device)


@dataclass
class ForwardContext:
    """Everything a forward pass needs beyond the hidden states, for one step."""

    positions: torch.Tensor       # int64 [T]
    slot_mapping: torch.Tensor    # int64 [T]
    backend: "AttentionBackend"
    attn: object                  # the backend's metadata for this step
    kv_caches: list[KVCache]      # indexed by the stage-local layer index
    linear: object = None         # linear-attention metadata and states (gated_deltanet.LinearMeta)


class AttentionBackend(ABC):
    """Computes causal attention of the step's query rows against each request's cached KV.

    A backend whose `prepare` reads no device tensor when given `max_query_len` may say
    `supports_cuda_graphs`; graph capture then builds its metadata over the graph's static buffers
    with `capture_metadata`, and calls `before_replay` before each replay.
    """

    supports_cuda_graphs = False

    @abstractmethod
    def prepare(self, query_start_loc: torch.Tensor, seq_lens: torch.Tensor, positions: torch.Tensor,
                block_tables: torch.Tensor, block_size: int, max_query_len: int | None = None):
        """Build per-step metadata from the plan's tensors (called once per step).

        `max_query_len`, when the caller knows it on the host, spares a device-to-host read; a
        backend that may run inside a CUDA graph capture must not read device tensors here.
        """

    def capture_metadata(self, query_start_loc: torch.Tensor, seq_lens: torch.Tensor, positions: torch.Tensor,
                         block_tables: torch.Tensor, block_size: int, max_query_len: int):
        """Metadata over a CUDA graph's static input buffers, built once per captured batch size;
        each replay reads whatever those buffers hold then."""
        if not self.supports_cuda_graphs:
            raise NotImplementedError(f"{type(self).__name__} does not run inside CUDA graphs")
        return self.prepare(query_start_loc, seq_lens, positions, block_tables, block_size, max_query_len)

    def before_replay(self, meta) -> None:
        """Refresh whatever of `meta` a replay cannot read from the static buffers (default: nothing)."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache,
                ctx: ForwardContext, scale: float) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, KVH, D] for this step's rows; returns [T, H, D]."""


def write_kv(cache: KVCache, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    cache.key.index_copy_(0, slot_mapping, k)
    cache.value.index_copy_(0, slot_mapping, v)


# a group's fixed cost (a gather and an attention call a layer) in padded key positions: merging
# groups smaller than this costs less than attending them apart
_GROUP_COST = 256


def length_groups(members: list[int], lens: list[int]) -> list[list[int]]:
    """`members` (requests) split into groups of similar context length: longest first, a group
    takes requests down to half its longest, so padding at most doubles a group's keys where one
    group of all would pad every request to the longest; a group of fewer than `_GROUP_COST` keys
    joins the group before it."""
    groups: list[list[int]] = []
    for i in sorted(members, key=lambda i: -lens[i]):
        if groups and (2 * lens[i] > lens[groups[-1][0]]
                       or len(groups[-1]) * lens[groups[-1][0]] < _GROUP_COST):
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


@dataclass
class _Group:
    """Requests attended together with padded tensors: rows [G, Q] of the flat query, KV slots [G, K]."""

    rows: torch.Tensor        # int64 [G, Q] flat query row of each padded query (pad: 0)
    valid: torch.Tensor       # bool [G, Q]
    kv_slots: torch.Tensor    # int64 [G, K] cache slot of each key position (pad: 0)
    mask: torch.Tensor        # bool [G, 1, Q, K] True where attention is allowed


class TorchReferenceBackend(AttentionBackend):
    """Plain PyTorch ops (scaled_dot_product_attention); runs on CPU and GPU.

    Requests with few query rows (decode, verify) are padded into groups of similar context length
    (`length_groups`) and each group attended in one call; each longer prefill chunk is its own group,
    so padding never multiplies prefill work.
    """

    def __init__(self, short_query: int = 16):
        self.short_query = short_query

    def prepare(self, query_start_loc, seq_lens, positions, block_tables, block_size, max_query_len=None):
        qsl = query_start_loc.tolist()
        lens = seq_lens.tolist()
        q_lens = [qsl[i + 1] - qsl[i] for i in range(len(lens))]
        short = [i for i, n in enumerate(q_lens) if n <= self.short_query]
        long = [i for i, n in enumerate(q_lens) if n > self.short_query]
        groups = [self._group(members, qsl, q_lens, lens, positions, block_tables, block_size)
                  for members in length_groups(short, lens) + [[i] for i in long]]
        return groups

    @staticmethod
    def _group(members, qsl, q_lens, lens, positions, block_tables, block_size) -> _Group:
        device = positions.device
        q_max = max(q_lens[i] for i in members)
        k_max = max(lens[i] for i in members)
        idx = torch.tensor(members, device=device)
        q_off = torch.arange(q_max, device=device)
        starts = torch.tensor([qsl[i] for i in members], device=device)
        counts = torch.tensor([q_lens[i] for i in members], device=device)
        valid = q_off[None, :] < counts[:, None]
        rows = torch.where(valid, starts[:, None] + q_off[None, :], torch.zeros_like(valid, dtype=torch.int64))
        k_pos = torch.arange(k_max, device=device)
        kv_slots = block_tables[idx][:, k_pos // block_size] * block_size + (k_pos % block_size)[None, :]
        kv_lens = torch.tensor([lens[i] for i in members], device=device)
        kv_slots = torch.where(k_pos[None, :] < kv_lens[:, None], kv_slots, torch.zeros_like(kv_slots))
        q_pos = positions[rows]
        mask = (k_pos[None, None, :] <= q_pos[:, :, None]) & (k_pos[None, None, :] < kv_lens[:, None, None])
        mask |= ~valid[:, :, None] & (k_pos[None, None, :] == 0)   # padded rows see one key: no NaN
        return _Group(rows, valid, kv_slots, mask[:, None])

    def forward(self, q, k, v, cache, ctx, scale):
        write_kv(cache, k, v, ctx.slot_mapping)
        out = torch.empty_like(q)
        for g in ctx.attn:
            qg = q[g.rows].transpose(1, 2)                 # [G, H, Q, D]
            kg, vg = (self._gather(c, g.kv_slots) for c in (cache.key, cache.value))   # [G, KVH, K, D]
            og = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=g.mask, scale=scale,
                                                enable_gqa=kg.shape[1] != qg.shape[1])
            og = og.transpose(1, 2)                        # [G, Q, H, D]
            out[g.rows[g.valid]] = og[g.valid]
        return out

    @staticmethod
    def _gather(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        # index_select: much faster on CPU than advanced indexing for the same rows
        rows = cache.index_select(0, slots.reshape(-1))
        return rows.view(*slots.shape, *cache.shape[1:]).transpose(1, 2)


@dataclass
class DenseMeta:
    """Layout of a dense step: `batch` sequences of `seq_len` rows each, flat as [batch * seq_len]."""

    batch: int
    seq_len: int


class DenseCausalBackend(AttentionBackend):
    """Cache-free causal attention over equal-length sequences laid out flat; differentiable.

    For teacher-forced passes (training, evaluation): no KV cache is read or written (`cache` is
    ignored), each sequence attends causally to itself. Right padding is harmless: no valid row sees
    a later one.
    """

    def prepare(self, query_start_loc, seq_lens, positions, block_tables, block_size, max_query_len=None):
        q_lens = query_start_loc[1:] - query_start_loc[:-1]
        if q_lens.numel() == 0 or bool((q_lens != q_lens[0]).any()) or bool((seq_lens != q_lens).any()):
            raise ValueError("DenseCausalBackend needs equal-length sequences with no cached prefix")
        return self.metadata(int(q_lens.numel()), int(q_lens[0]))

    @staticmethod
    def metadata(batch: int, seq_len: int) -> DenseMeta:
        return DenseMeta(batch, seq_len)

    def forward(self, q, k, v, cache, ctx, scale):
        b, n = ctx.attn.batch, ctx.attn.seq_len
        qb = q.reshape(b, n, *q.shape[1:]).transpose(1, 2)      # [B, H, L, D]
        kb = k.reshape(b, n, *k.shape[1:]).transpose(1, 2)
        vb = v.reshape(b, n, *v.shape[1:]).transpose(1, 2)
        out = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale,
                                             enable_gqa=kb.shape[1] != qb.shape[1])
        return out.transpose(1, 2).reshape(q.shape)


@dataclass
class PagedMeta:
    query_start_loc: torch.Tensor   # [B + 1]
    seq_lens: torch.Tensor          # [B]
    block_tables: torch.Tensor      # [B, W]
    max_query_len: int
    block_size: int


class TritonPagedBackend(AttentionBackend):
    """The GPU attention backend: paged KV written and read by Triton kernels. `prepare` only wraps
    the step's device tensors (no host read when the caller passes `max_query_len`), so the same code
    runs eagerly and inside a captured CUDA graph."""

    supports_cuda_graphs = True     # its metadata are views of the plan's tensors

    def prepare(self, query_start_loc, seq_lens, positions, block_tables, block_size, max_query_len=None):
        if max_query_len is None:       # off the hot path (callers that know it pass it)
            max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max()) if seq_lens.numel() else 0
        return PagedMeta(query_start_loc, seq_lens, block_tables, max_query_len, block_size)

    def forward(self, q, k, v, cache, ctx, scale):
        from pipespec.kernels.fused_ops import write_kv
        from pipespec.kernels.paged_attention import paged_attention

        meta: PagedMeta = ctx.attn
        write_kv(cache.key, cache.value, k, v, ctx.slot_mapping)
        return paged_attention(q, cache.key, cache.value, meta.block_tables, meta.query_start_loc,
                               meta.seq_lens, meta.max_query_len, scale, meta.block_size)


def choose_backend(choice: str, device: torch.device, model=None) -> AttentionBackend:
    """The attention backend for `choice` ("auto", "torch", "triton") on `device`, for `model` (a
    family may run on the torch backend only: `reference_attention_only`)."""
    if model is not None and model.reference_attention_only:
        if choice == "triton":
            raise ValueError(f"attention_backend='triton' does not serve {model.arch.model_type} (DeepSeek sparse "
                             "attention runs on the torch backend); use attention_backend='auto' or 'torch'")
        if device.type == "cuda":
            logger.info("%s: sparse attention runs on the torch attention backend (eager, no CUDA graphs)",
                        model.arch.model_type)
        return TorchReferenceBackend()
    can_triton = device.type == "cuda" and kernels.HAVE_TRITON
    if choice == "triton" and not can_triton:
        raise ValueError(f"attention_backend='triton' needs a CUDA device and the triton package; "
                         f"this stage runs on {device} (triton installed: {kernels.HAVE_TRITON})")
    if choice == "triton" or (choice == "auto" and can_triton):
        return TritonPagedBackend()
    return TorchReferenceBackend()
