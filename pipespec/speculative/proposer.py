"""The MTP proposer: drafts K tokens per request on the last stage, right after verification.

Step 0 runs the MTP module over the same rows as the step just verified (same positions, slots,
block tables and attention metadata), with token ids shifted left by one (the step input's `mtp_input_ids`):
row t takes the target's final hidden h_t and the token at t+1, which for the row of the last
accepted token is the token just sampled. Its output at that row gives draft 1. Steps 1..K-1 run one
row per request at the next position, feeding back the module's own output hidden; step i uses MTP
layer i % n. Drafts are the module's argmax, so the verifier treats the draft distribution as one-hot
(docs/architecture.md, I1: nothing the stage computes reaches its next step except the draft ids, through the
driver).

The proposer is a module owning every weight it drafts with: the MTP layers and, on a last stage
that does not hold the target's embedding (PP > 1, untied head), its own copy of that embedding.
The target's tensors it uses are resolved at call time through their owner (I5).

The module's KV cache shares the target's block ids and slots. Rows past the accepted prefix and the
chained rows write MTP KV at positions the next step's step 0 rewrites before anything reads them.
Each MTP layer has its own cache, so with n > 1 layers every step also runs, over its rows and on
its input, each other layer that a later step uses (only for the KV it writes): a chained step then
attends to KV at every earlier position, as in training (train/mtp_forward.py), never to a slot
nobody wrote.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from pipespec.model.attention import ForwardContext, KVCache
from pipespec.speculative.draft_vocab import DraftVocab
from pipespec.speculative.rejection import greedy_tokens


class MTPProposer(nn.Module):
    def __init__(self, layers: list[nn.Module], num_spec_tokens: int, block_size: int,
                 embed_weight: Callable[[], torch.Tensor] | None, head_weight: Callable[[], torch.Tensor],
                 embedding: nn.Module | None = None, draft_vocab: DraftVocab | None = None):
        """`embed_weight`: the target's embedding, through its owner; None with `embedding` (a
        copy this proposer owns) or when every layer holds its own. `draft_vocab`: draft over its
        tokens only (`draft_vocab.py`)."""
        super().__init__()
        if not layers:
            raise ValueError("the MTP proposer needs at least one MTP layer")
        self.layers = nn.ModuleList(layers)
        self.embedding = embedding
        self.num_spec_tokens = num_spec_tokens
        self.block_size = block_size
        self._target_embed = embed_weight      # resolved at call time through the owner (I5)
        self._head_weight = head_weight
        self.draft_vocab = draft_vocab
        self.kv_caches: list[KVCache] = []

    def _embed_weight(self) -> torch.Tensor | None:
        if self.embedding is not None:
            return self.embedding.weight
        return None if self._target_embed is None else self._target_embed()

    def _step0_context(self, target_ctx: ForwardContext) -> ForwardContext:
        return ForwardContext(target_ctx.positions, target_ctx.slot_mapping, target_ctx.backend,
                              target_ctx.attn, [self.kv_caches[0]])

    @torch.inference_mode()
    def propose(self, target_ctx: ForwardContext, mtp_input_ids: torch.Tensor, line_tables: torch.Tensor,
                hidden: torch.Tensor, last_rows: torch.Tensor, last_tokens: torch.Tensor,
                num_spec_tokens: int | None = None) -> torch.Tensor:
        """Drafts [S, k] for the S requests that sampled this step (k = num_spec_tokens: the step's K, at
        most the config's; None: the config's).

        mtp_input_ids: [T] each row's next token (a line's last row: a placeholder); line_tables:
        [S, W] the block table of each sampling request; hidden: [T, H] the target's final hidden;
        last_rows: [S] flat row of each sampling request's last accepted token; last_tokens: [S] the
        token sampled after it.

        k = 0 (adaptive K chose plain decoding) still runs step 0 over every row, for its KV alone: a
        later step's drafts attend to the MTP KV of every earlier position, and only this step has the
        target's hidden states for these rows. The LM head and the chained steps are what it skips.
        """
        k = self.num_spec_tokens if num_spec_tokens is None else num_spec_tokens
        shifted = mtp_input_ids.clone()
        shifted[last_rows] = last_tokens
        embed = self._embed_weight()
        h = self._step(0, self._step0_context(target_ctx), shifted, hidden, embed)
        if k == 0:
            return torch.empty(last_rows.shape[0], 0, dtype=torch.int64, device=hidden.device)
        h = h[last_rows]
        drafts = [self._argmax(self.layers[0], h)]
        pos = target_ctx.positions[last_rows]
        tables = line_tables
        qsl = torch.arange(last_rows.shape[0] + 1, device=hidden.device)
        bs, backend = self.block_size, target_ctx.backend
        for i in range(1, k):
            p = pos + i
            slots = tables.gather(1, (p // bs)[:, None]).squeeze(1) * bs + p % bs
            attn = backend.prepare(qsl, p + 1, p, tables, bs, max_query_len=1)
            step_ctx = ForwardContext(p, slots, backend, attn, [self.kv_caches[i % len(self.layers)]])
            h = self._step(i, step_ctx, drafts[-1], h, embed)
            drafts.append(self._argmax(self.layers[i % len(self.layers)], h))
        return torch.stack(drafts, dim=1)

    @torch.inference_mode()
    def write_kv(self, target_ctx: ForwardContext, mtp_input_ids: torch.Tensor, hidden: torch.Tensor) -> None:
        """A step where no request samples (middle prefill chunks): run step 0 over its rows for the
        MTP KV alone, so later steps attend to written slots there too."""
        self._step(0, self._step0_context(target_ctx), mtp_input_ids, hidden, self._embed_weight())

    def _step(self, i: int, ctx: ForwardContext, tokens: torch.Tensor, hidden: torch.Tensor,
              embed: torch.Tensor | None) -> torch.Tensor:
        """Step i's output, from layer i % n. Every other layer that a later step uses writes its KV
        at these rows from the same input, so no layer ever attends to a slot nobody wrote."""
        n = len(self.layers)
        for j in sorted({later % n for later in range(i + 1, self.num_spec_tokens)} - {i % n}):
            self.layers[j](ctx, tokens, hidden, embed_weight=embed, cache=self.kv_caches[j])
        return self.layers[i % n](ctx, tokens, hidden, embed_weight=embed, cache=self.kv_caches[i % n])

    def _argmax(self, layer, h: torch.Tensor) -> torch.Tensor:
        best = greedy_tokens(layer.compute_logits(h, self._head_weight(), vocab=self.draft_vocab))
        return best if self.draft_vocab is None else self.draft_vocab.tokens(best)
