"""Multi-head latent attention (DeepSeek-V2/V3) over a paged cache of compressed latents.

Per token the cache holds kv_lora_rank + qk_rope_head_dim values (`CacheShape(1, R + dr, 0)`): the
normed latent c = kv_a_layernorm(kv_a) and the rotated shared rope key. Keys and values per head
are kv_b_proj(c) = [k_nope | v]; nothing else is stored.

Two equal ways to attend (plain PyTorch reference, CPU; `TorchReferenceBackend`'s request groups):
- expanded, for long prefill chunks: kv_b_proj on the gathered latents, then ordinary attention;
- absorbed, for decode and verify rows: q_nope is folded through W_uk into latent space, so each row
  scores against the cached [c | k_rope] directly (one shared "head" of width R + dr) and the
  weighted sum of latents goes through W_uv afterwards: the cache is never expanded.
On a GPU (the Triton backend) every row takes the absorbed form in one kernel over the paged cache
(`kernels/mla_attention.py`), which reads no device tensor on the host and so runs in CUDA graphs.

With DeepSeek sparse attention (V3.2) each cache entry also holds the indexer's key (index_head_dim
values), and each row attends only to the keys its indexer selects (model/deepseek/dsa.py).

With tensor parallelism each rank keeps num_heads / T heads: its rows of q_proj / q_b_proj and
kv_b_proj, its columns of o_proj (which all-reduces). The latent projections, their norms and the
indexer are replicated, so every rank caches the same full latent per token.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pipespec import kernels
from pipespec.model.attention import CacheShape, ForwardContext, KVCache, TorchReferenceBackend
from pipespec.model.deepseek.config import DeepSeekConfig
from pipespec.model.deepseek.dsa import Indexer, Selection, index_scores, select_topk
from pipespec.model.deepseek.rope import SliceRope
from pipespec.model.layers import RMSNorm
from pipespec.model.linear import Linear
from pipespec.model.tp_layers import SINGLE, ColumnParallelLinear, RowParallelLinear
from pipespec.parallel import TensorParallel


class MLAttention(nn.Module):
    def __init__(self, hidden: int, num_heads: int, cfg: DeepSeekConfig, eps: float, absorb_up_to: int = 16,
                 reuses_selection: bool = False, tp: TensorParallel = SINGLE):
        super().__init__()
        h0, nh = tp.split(num_heads, "num_attention_heads")
        self.cfg, self.num_heads = cfg, nh
        self.absorb_up_to = absorb_up_to        # requests with at most this many query rows: absorbed form
        bias = cfg.attention_bias

        def heads(inp: int, width: int) -> ColumnParallelLinear:     # this rank's heads of `width` rows each
            return ColumnParallelLinear(inp, [(h0 * width, nh * width)], False, [num_heads * width])

        self.kv_width = cfg.kv_lora_rank + cfg.qk_rope_head_dim
        if cfg.q_lora_rank is None:
            self.q_proj = heads(hidden, cfg.qk_head_dim)
            self.kv_a_proj_with_mqa = Linear(hidden, self.kv_width, bias=bias)
        else:
            # q_a_proj and kv_a_proj_with_mqa in one matrix (both read x): one decode GEMV, not two
            self.fused_qkv_a_proj = Linear(hidden, cfg.q_lora_rank + self.kv_width, bias=bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, eps)
            self.q_b_proj = heads(cfg.q_lora_rank, cfg.qk_head_dim)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, eps)
        self.kv_b_proj = heads(cfg.kv_lora_rank, cfg.qk_nope_head_dim + cfg.v_head_dim)
        self.o_proj = RowParallelLinear(num_heads * cfg.v_head_dim, hidden, bias, tp,
                                        "num_attention_heads * v_head_dim")
        self.scale = cfg.softmax_scale
        self.indexer = None
        self.reuses_selection = reuses_selection      # GLM-5 "shared" layer: no indexer of its own
        if cfg.index is not None and not reuses_selection:
            if cfg.q_lora_rank is None:
                raise ValueError("DeepSeek sparse attention needs q_lora_rank (its indexer reads the q latent)")
            i = cfg.index
            self.indexer = Indexer(hidden, cfg.q_lora_rank, i.n_heads, i.head_dim, cfg.qk_rope_head_dim, i.topk,
                                   i.interleaved)

    def cache_shape(self) -> CacheShape:
        """Per token: the latent, the rope key and, with sparse attention, the indexer's key."""
        c = self.cfg
        return CacheShape(1, c.kv_lora_rank + c.qk_rope_head_dim + (c.index.head_dim if self.indexer else 0), 0)

    def forward(self, x: torch.Tensor, rope: SliceRope, cache: KVCache, ctx: ForwardContext,
                selection: Selection | None = None) -> torch.Tensor:
        c, t, nh = self.cfg, x.shape[0], self.num_heads
        if c.q_lora_rank is None:
            q, kv_a = self.q_proj(x), self.kv_a_proj_with_mqa(x)
        else:
            q_a, kv_a = self.fused_qkv_a_proj(x).split([c.q_lora_rank, self.kv_width], dim=-1)
            q_resid = self.q_a_layernorm(q_a)
            q = self.q_b_proj(q_resid)
        q = q.view(t, nh, c.qk_head_dim)
        q_nope, q_rope = q.split([c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
        q_rope = rope.rotate(q_rope, ctx.positions)
        index_q = None
        if self.indexer is None and kernels.enabled(kv_a) and rope.fused_serves(c.qk_rope_head_dim):
            # the latent's norm, the rope key's rotation and the cache write: one kernel
            from pipespec.kernels.fused_ops import mla_cache_entry
            mla_cache_entry(kv_a, self.kv_a_layernorm.weight, self.kv_a_layernorm.eps, rope.cos, rope.sin,
                            ctx.positions, rope.interleaved, cache.key, ctx.slot_mapping)
        else:
            latent, k_rope = kv_a.split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
            parts = [self.kv_a_layernorm(latent)[:, None, :], rope.rotate(k_rope[:, None, :], ctx.positions)]
            if self.indexer is not None:
                parts.append(self.indexer.key(x, rope, ctx.positions)[:, None, :])
                index_q = self.indexer.queries(x, q_resid, rope, ctx.positions)
            entry = torch.cat(parts, dim=-1)                                    # [T, 1, cache width]
            cache.key.index_copy_(0, ctx.slot_mapping, entry.to(cache.key.dtype))
        if self.reuses_selection and (selection is None or selection.masks is None):
            raise RuntimeError("a layer reusing the indexer selection ran without a full layer before it")
        out = self._attend(q_nope, q_rope, cache.key, ctx, index_q, selection)
        return self.o_proj(out.reshape(t, nh * c.v_head_dim))

    def _attend_paged(self, q_nope, q_rope, latents, ctx: ForwardContext) -> torch.Tensor:
        from pipespec.kernels import mla_absorb
        from pipespec.kernels.mla_attention import mla_paged_attention
        c, w = self.cfg, self.kv_b_proj.weight
        # a batch-1 decode row: per-head products read kv_b's weight in place (no batched GEMMs)
        few = q_nope.shape[0] <= mla_absorb.FAST_ROWS and w.is_contiguous()
        dn, dv = c.qk_nope_head_dim, c.v_head_dim
        w_uk, w_uv = self._weights()
        q_lat = (mla_absorb.absorb_query(q_nope, w, dn, dv) if few else torch.einsum("thd,hdr->thr", q_nope, w_uk))
        meta = ctx.attn
        o_lat = mla_paged_attention(q_lat, q_rope.contiguous(), latents, meta.block_tables, meta.query_start_loc,
                                    meta.seq_lens, meta.max_query_len, self.scale, meta.block_size)
        return mla_absorb.absorb_output(o_lat, w, dn, dv) if few else torch.einsum("thr,hvr->thv", o_lat, w_uv)

    def _weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj split per head: W_uk [H, dn, R], W_uv [H, dv, R]."""
        c = self.cfg
        w = self.kv_b_proj.weight.view(self.num_heads, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
        return w[:, :c.qk_nope_head_dim], w[:, c.qk_nope_head_dim:]

    def _attend(self, q_nope, q_rope, latents, ctx: ForwardContext, index_q=None,
                selection: Selection | None = None) -> torch.Tensor:
        if not isinstance(ctx.backend, TorchReferenceBackend):
            if index_q is not None or self.reuses_selection:
                raise NotImplementedError("DeepSeek sparse attention runs on the torch attention backend only")
            return self._attend_paged(q_nope, q_rope, latents, ctx)
        c, nh = self.cfg, self.num_heads
        out = q_nope.new_empty(q_nope.shape[0], nh, c.v_head_dim)
        w_uk, w_uv = self._weights()
        chosen = []
        for n, g in enumerate(ctx.attn):
            entries = latents.index_select(0, g.kv_slots.reshape(-1)).view(*g.kv_slots.shape, -1)
            width = c.kv_lora_rank + c.qk_rope_head_dim
            kv = entries[..., :width]                                                          # [G, K, R + dr]
            qn, qr = q_nope[g.rows], q_rope[g.rows]                                            # [G, Q, H, *]
            mask = g.mask
            if index_q is not None:     # sparse: only the keys this row's indexer picks
                scores = index_scores(index_q[0][g.rows], index_q[1][g.rows], entries[..., width:])
                mask = select_topk(scores, g.mask[:, 0], self.indexer.topk)[:, None]
                chosen.append(mask)
            elif self.reuses_selection:
                mask = selection.masks[n]
            if g.rows.shape[1] <= self.absorb_up_to:
                q_lat = torch.einsum("gqhd,hdr->gqhr", qn, w_uk)
                qa = torch.cat((q_lat, qr), dim=-1).transpose(1, 2)                            # [G, H, Q, R + dr]
                o_lat = F.scaled_dot_product_attention(qa, kv[:, None], kv[:, None, :, :c.kv_lora_rank],
                                                       attn_mask=mask, scale=self.scale, enable_gqa=True)
                og = torch.einsum("ghqr,hvr->gqhv", o_lat, w_uv)
            else:
                kv_b = self.kv_b_proj(kv[..., :c.kv_lora_rank]).view(*kv.shape[:2], nh, -1)
                k_nope, v = kv_b.split([c.qk_nope_head_dim, c.v_head_dim], dim=-1)
                k = torch.cat((k_nope, kv[..., None, c.kv_lora_rank:].expand(-1, -1, nh, -1)), dim=-1)
                qg = torch.cat((qn, qr), dim=-1)
                og = F.scaled_dot_product_attention(qg.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                    attn_mask=mask, scale=self.scale).transpose(1, 2)
            out[g.rows[g.valid]] = og[g.valid]
        if index_q is not None and selection is not None:
            selection.masks = chosen           # for the shared layers after this one, this call only
        return out
