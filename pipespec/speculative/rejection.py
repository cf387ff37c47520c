"""Verify drafts against the target: lossless rejection sampling, greedy included, with no host sync.

Deterministic drafts (pipespec's MTP drafter: the head's argmax) take a shortcut that is the same in
distribution and more: each row draws the token plain decoding draws at that position (keyed by
seed and position), and a draft is accepted exactly when it equals it, so a seeded request's output
is identical with and without speculation, at every PP size. Drafts drawn from a distribution
(`draft_probs`) go through rejection sampling, as follows.

For draft j of a request (distribution q_j, token d_j) and the target's processed distribution p_j at
the same row: accept while u_j * q_j(d_j) <= p_j(d_j); at the first rejection draw from
normalize(max(p_j - q_j, 0)); if every draft is accepted draw a bonus token from p at the row after
the last draft. The output then follows p exactly, whatever q is.

Greedy needs no special case: `processed_probs` makes greedy rows one-hot, so a draft is accepted iff
it is the argmax and the correction is the argmax. Uniforms and draws are keyed by (seed, position),
and with no drafts the result equals `pipespec.sampling.sample`.
"""
from __future__ import annotations

import torch

from pipespec import kernels
from pipespec.sampling import SamplingTensors, draw, processed_probs, uniform_keyed

_ACCEPT_STREAM = 1   # the plain draw uses stream 0, so a step without drafts samples like `sample`


def rejection_sample(target_logits: torch.Tensor, draft_ids: torch.Tensor, num_drafts: torch.Tensor,
                     st: SamplingTensors, first_position: torch.Tensor,
                     draft_probs: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Accepted tokens per request.

    target_logits: [B, K+1, V], row j scores the token at position first_position + j
    draft_ids:     [B, K] int64, draft j proposed for position first_position + j + 1 (pad: any id)
    num_drafts:    [B] int64 in [0, K]; rows past a request's drafts are ignored
    draft_probs:   [B, K, V] the distributions the drafts were drawn from; None means the drafts were
                   chosen deterministically (q is one-hot on the draft), as pipespec's MTP drafter does
    Returns tokens [B, K+1] (-1 past the end) and num_sampled [B] in [1, num_drafts + 1].
    """
    b, rows, vocab = target_logits.shape
    k = rows - 1
    device = target_logits.device
    if st.all_greedy and draft_probs is None:
        return verify_greedy(target_logits, draft_ids, num_drafts)
    pos = first_position[:, None] + torch.arange(rows, device=device)[None, :]          # [B, K+1]
    flat = _repeat_rows(st, rows)
    p = processed_probs(target_logits.reshape(b * rows, vocab), flat).reshape(b, rows, vocab)
    if draft_probs is None:
        # deterministic drafts: every row draws the token plain decoding would draw at its position
        # (same keyed noise, `sample`), and a draft is accepted exactly when it is that token. A draft
        # then passes with probability p(draft), as rejection sampling with a one-hot q accepts it,
        # and a seeded request's output is the same with and without speculation
        drawn = draw(p.reshape(b * rows, vocab), flat.seed, pos.reshape(-1)).reshape(b, rows)
        return _accept_matching(drawn, draft_ids, num_drafts)

    drafts = draft_ids.clamp(0, vocab - 1)
    if draft_probs is None:
        q = torch.zeros(b, k, vocab, device=device, dtype=p.dtype).scatter_(-1, drafts[..., None], 1.0)
    else:
        q = draft_probs.to(p.dtype)
    p_d = p[:, :k].gather(-1, drafts[..., None]).squeeze(-1)                               # [B, K]
    q_d = q.gather(-1, drafts[..., None]).squeeze(-1)
    u = uniform_keyed(st.seed.repeat_interleave(k), pos[:, :k].reshape(-1), 1, _ACCEPT_STREAM).reshape(b, k)
    has_draft = torch.arange(k, device=device)[None, :] < num_drafts[:, None]
    accept = (u * q_d <= p_d) & has_draft
    n_acc = accept.int().cumprod(dim=-1).sum(dim=-1)                                         # [B]

    # the distribution each row draws from if the chain stops there: residual after a draft, else p
    residual = (p[:, :k] - q).clamp_min(0)
    mass = residual.sum(-1, keepdim=True)
    residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p[:, :k])
    final = torch.cat((torch.where(has_draft[..., None], residual, p[:, :k]), p[:, k:]), dim=1)
    drawn = draw(final.reshape(b * rows, vocab), flat.seed, pos.reshape(-1)).reshape(b, rows)

    col = torch.arange(rows, device=device)[None, :]
    padded_drafts = torch.cat((drafts, torch.zeros(b, 1, dtype=drafts.dtype, device=device)), dim=1)
    tokens = torch.where(col < n_acc[:, None], padded_drafts, drawn.gather(1, n_acc[:, None]).expand(b, rows))
    tokens = torch.where(col <= n_acc[:, None], tokens, torch.full_like(tokens, -1))
    return tokens, n_acc.long() + 1


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(dim=-1); on the GPU the two-pass kernel (`kernels/argmax.py`), which spreads a
    row over many programs where torch's reduction reads it in one thread block."""
    if kernels.enabled(logits):
        from pipespec.kernels.argmax import argmax_rows
        return argmax_rows(logits)
    return logits.argmax(dim=-1)


def verify_greedy(target_logits, draft_ids, num_drafts):
    """Greedy rows with deterministic drafts: accept while the draft is the argmax (the general path
    computes the same thing with one-hot distributions; this one skips the softmax). No host read:
    a CUDA graph's forward runs it for every step (`stage/cuda_graphs.py`)."""
    return _accept_matching(greedy_tokens(target_logits), draft_ids, num_drafts)


def _accept_matching(best, draft_ids, num_drafts):
    """Accept each line's drafts while each equals the token its row chose (best [B, K+1]); the
    tokens up to and including the first row whose draft differs (or the row after the last)."""
    k = best.shape[1] - 1
    col = torch.arange(k, device=best.device)[None, :]
    accept = (best[:, :k] == draft_ids) & (col < num_drafts[:, None])
    n_acc = accept.int().cumprod(dim=-1).sum(dim=-1)
    keep = torch.arange(k + 1, device=best.device)[None, :] <= n_acc[:, None]
    return torch.where(keep, best, torch.full_like(best, -1)), n_acc.long() + 1


def _repeat_rows(st: SamplingTensors, rows: int) -> SamplingTensors:
    """Per-request sampling parameters repeated for each of the request's `rows` rows."""
    rep = lambda t: t.repeat_interleave(rows)          # noqa: E731
    return SamplingTensors(rep(st.temperature), rep(st.top_k), rep(st.top_p), rep(st.min_p), rep(st.seed),
                           st.needs_sort, st.all_greedy)
