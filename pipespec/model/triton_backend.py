"""The GPU attention backend: paged KV written and read by Triton kernels, CUDA-graph safe.

`prepare` only wraps the plan's device tensors (no host reads when the caller passes
`max_query_len`), so the same code runs eagerly and inside a captured graph.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pipespec.model.attention import AttentionBackend


@dataclass
class PagedMeta:
    query_start_loc: torch.Tensor   # [B + 1]
    seq_lens: torch.Tensor          # [B]
    block_tables: torch.Tensor      # [B, W]
    max_query_len: int
    block_size: int


class TritonPagedBackend(AttentionBackend):
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
