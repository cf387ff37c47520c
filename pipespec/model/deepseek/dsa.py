"""DeepSeek sparse attention (DeepSeek-V3.2): a light indexer scores every cached token for each
query row, and MLA attends only to the `index_topk` best (among the tokens causality allows).

    q_i   = wq_b(q_resid)  per indexer head, rotate-half rope on its first qk_rope_head_dim dims
    k_i   = LayerNorm(wk(x)), rope the same way; cached per token next to the MLA latent
    w     = weights_proj(x) / sqrt(n_heads)
    score = sum_h w_h * relu(q_h . k / sqrt(head_dim))

GLM-5 rotates the indexer's rope dims interleaved, and its "shared" layers have no indexer: they
reuse the selection of the latest full layer before them in the same forward pass. That selection
lives in a `Selection` made by the model's forward for that one call and passed down explicitly;
nothing holds it afterwards, so no layer (nor the MTP layer, which always runs its own indexer) can
read a selection from another step.
"""
from __future__ import annotations

import torch
from torch import nn


class Selection:
    """One forward call's latest top-k selection: a bool [G, Q, K] per request group of the step."""

    def __init__(self):
        self.masks: list[torch.Tensor] | None = None


class Indexer(nn.Module):
    def __init__(self, hidden: int, q_lora_rank: int, n_heads: int, head_dim: int, rope_dim: int, topk: int,
                 interleaved: bool = False):
        super().__init__()
        self.n_heads, self.head_dim, self.rope_dim, self.topk = n_heads, head_dim, rope_dim, topk
        self.interleaved = interleaved
        self.wq_b = nn.Linear(q_lora_rank, n_heads * head_dim, bias=False)
        self.wk = nn.Linear(hidden, head_dim, bias=False)
        self.k_norm = nn.LayerNorm(head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(hidden, n_heads, bias=False)

    def _rope(self, x: torch.Tensor, rope, positions: torch.Tensor) -> torch.Tensor:
        r = self.rope_dim
        return torch.cat((rope.rotate(x[..., :r], positions, interleaved=self.interleaved), x[..., r:]), dim=-1)

    def key(self, x: torch.Tensor, rope, positions: torch.Tensor) -> torch.Tensor:
        """The per-token key to cache: [T, head_dim]."""
        return self._rope(self.k_norm(self.wk(x))[:, None, :], rope, positions)[:, 0]

    def queries(self, x: torch.Tensor, q_resid: torch.Tensor, rope, positions: torch.Tensor):
        """(q [T, n_heads, head_dim], head weights [T, n_heads])."""
        q = self.wq_b(q_resid).view(x.shape[0], self.n_heads, self.head_dim)
        return self._rope(q, rope, positions), self.weights_proj(x).float() * self.n_heads ** -0.5


def index_scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """q [G, Q, Hi, D], w [G, Q, Hi], keys [G, K, D] -> scores [G, Q, K] (float32)."""
    s = torch.einsum("gqhd,gkd->gqhk", q.float(), keys.float()) * q.shape[-1] ** -0.5
    return torch.einsum("gqh,gqhk->gqk", w, s.relu())


def select_topk(scores: torch.Tensor, allowed: torch.Tensor, k: int) -> torch.Tensor:
    """Bool [G, Q, K]: the k best-scoring allowed keys of each row (all of them when fewer).

    Ties go to the earlier position (a stable sort), so a row selects the same keys whether it runs
    in a prefill, a chunk, a verify pass or a decode step, whatever the padded key count: the relu
    makes exact ties (score 0) common, and torch.topk breaks them arbitrarily.
    """
    if k >= scores.shape[-1]:
        return allowed
    masked = scores.masked_fill(~allowed, float("-inf"))
    best = masked.sort(dim=-1, descending=True, stable=True).indices[..., :k]
    picked = torch.zeros_like(allowed).scatter_(-1, best, True)
    return picked & allowed
