"""The MTP proposer: drafts K tokens per request on the last stage, right after verification.

Step 0 runs the MTP module over the same rows as the step just verified (same positions, slots,
block tables and attention metadata), with token ids shifted left by one: row t takes the target's
final hidden h_t and the token at t+1, which for the row of the last accepted token is the token just
sampled. Its output at that row gives draft 1. Steps 1..K-1 run one row per request at the next
position, feeding back the module's own output hidden; step i uses MTP layer i % n. Drafts are the
module's argmax, so the verifier treats the draft distribution as one-hot (DESIGN.md I1: nothing the
stage computes reaches its next step except the draft ids, through the driver).

The module's KV cache shares the target's block ids and slots. Rows past the accepted prefix and the
chained rows write MTP KV at positions the next step's step 0 rewrites before anything reads them.
"""
from __future__ import annotations

from typing import Callable

import torch

from pipespec.model.attention import AttentionBackend, ForwardContext, KVCache


class MTPProposer:
    def __init__(self, layers: list[torch.nn.Module], num_spec_tokens: int, block_size: int,
                 embed_weight: Callable[[], torch.Tensor], head_weight: Callable[[], torch.Tensor]):
        if not layers:
            raise ValueError("the MTP proposer needs at least one MTP layer")
        self.layers = layers
        self.k = num_spec_tokens
        self.block_size = block_size
        self._embed_weight = embed_weight      # resolved at call time through the owner (I5)
        self._head_weight = head_weight
        self.kv_caches: list[KVCache] = []


    @torch.inference_mode()
    def propose(self, backend: AttentionBackend, target_ctx: ForwardContext, input_ids: torch.Tensor,
                hidden: torch.Tensor, block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                next_token_ids: torch.Tensor, last_rows: torch.Tensor, last_tokens: torch.Tensor,
                sample_rows: torch.Tensor) -> torch.Tensor:
        """Drafts [S, K] for the S requests that sampled this step.

        input_ids: [T] the step's query ids; hidden: [T, H] target final hidden; next_token_ids: [B]
        the known token after each request's last row (-1: sampled now); last_rows: [S] flat row of
        each sampling request's last accepted token; last_tokens: [S] the token sampled after it.
        """
        shifted = torch.roll(input_ids, -1)
        ends = query_start_loc[1:] - 1
        shifted[ends] = torch.where(next_token_ids >= 0, next_token_ids, shifted[ends])
        shifted[last_rows] = last_tokens
        ctx = ForwardContext(target_ctx.positions, target_ctx.slot_mapping, backend, target_ctx.attn,
                             [self.kv_caches[0]])
        out = self.layers[0](ctx, shifted, hidden, embed_weight=self._embed_weight(), cache=self.kv_caches[0])
        h = out[last_rows]
        drafts = [self._argmax(self.layers[0], h)]
        pos = target_ctx.positions[last_rows]
        tables = block_tables[sample_rows]
        s = last_rows.shape[0]
        qsl = torch.arange(s + 1, device=hidden.device)
        bs = self.block_size
        for i in range(1, self.k):
            layer_idx = i % len(self.layers)
            p = pos + i
            slots = tables.gather(1, (p // bs)[:, None]).squeeze(1) * bs + p % bs
            attn = backend.prepare(qsl, p + 1, p, tables, bs)
            step_ctx = ForwardContext(p, slots, backend, attn, [self.kv_caches[layer_idx]])
            h = self.layers[layer_idx](step_ctx, drafts[-1], h, embed_weight=self._embed_weight(),
                                       cache=self.kv_caches[layer_idx])
            drafts.append(self._argmax(self.layers[layer_idx], h))
        return torch.stack(drafts, dim=1)

    def _argmax(self, layer, h: torch.Tensor) -> torch.Tensor:
        return layer.compute_logits(h, self._head_weight()).argmax(dim=-1)
