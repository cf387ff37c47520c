"""Teacher-forced passes for MTP training and evaluation: the frozen target over whole sequences,
then K chained MTP steps that see exactly what inference's paged cache would show them.

Layout: B sequences of N tokens x_0..x_{N-1}. The target gives h_t and logits z_t (which predict
x_{t+1}). MTP step k (1-based) has one row per t in [0, N-1), at position t + k - 1:

- step 1 takes (h_t, x_{t+1}); step k > 1 takes (its previous output at row t, x_{t+k});
- row t of step k predicts x_{t+k+1}; the target's distribution for it is softmax(z_{t+k});
- attention: step-1 rows at positions 0..t (in inference those slots hold step-1 KV written from
  accepted tokens and the target's hidden), then the row's own chain at positions t+1..t+k-1.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pipespec.model.attention import AttentionBackend, DenseCausalBackend, ForwardContext


@dataclass
class ChainMeta:
    batch: int
    seq_len: int
    step: int                     # 1-based MTP step


@dataclass
class ChainKV:
    """Keys and values of every step so far, each [B, KVH, L, D] (kept with their autograd graph)."""

    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)


class ChainedMTPBackend(AttentionBackend):
    """Dense, differentiable attention for chained MTP steps over equal-length rows.

    Step 1 is causal over its own rows. Row t of step k attends step-1 rows 0..t and its own rows
    of steps 2..k (one key each), which is what a paged cache holds at positions <= t + k - 1 when
    step k runs in inference.
    """

    def prepare(self, query_start_loc, seq_lens, positions, block_tables, block_size, max_query_len=None):
        raise NotImplementedError("ChainedMTPBackend is driven by chained_mtp(), not by a StepPlan")

    def forward(self, q, k, v, cache: ChainKV, ctx, scale):
        meta: ChainMeta = ctx.attn
        b, n = meta.batch, meta.seq_len
        qb = q.reshape(b, n, *q.shape[1:]).transpose(1, 2)      # [B, H, L, D]
        kb = k.reshape(b, n, *k.shape[1:]).transpose(1, 2)      # [B, KVH, L, D]
        vb = v.reshape(b, n, *v.shape[1:]).transpose(1, 2)
        if len(cache.keys) != meta.step - 1:
            raise RuntimeError(f"chained step {meta.step} needs the keys of the {meta.step - 1} steps before it")
        cache.keys.append(kb)
        cache.values.append(vb)
        gqa = kb.shape[1] != qb.shape[1]
        if meta.step == 1:
            out = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            keys = torch.cat(cache.keys, dim=2)                 # [B, KVH, step * L, D]
            values = torch.cat(cache.values, dim=2)
            mask = _chain_mask(n, meta.step, q.device)
            out = F.scaled_dot_product_attention(qb, keys, values, attn_mask=mask, scale=scale, enable_gqa=gqa)
        return out.transpose(1, 2).reshape(q.shape)


def _chain_mask(n: int, step: int, device) -> torch.Tensor:
    """[L, step * L]: step-1 keys j <= t, then the diagonal of every later step up to this one."""
    causal = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    eye = torch.eye(n, dtype=torch.bool, device=device)
    return torch.cat([causal] + [eye] * (step - 1), dim=1)


def dense_context(batch: int, seq_len: int, positions: torch.Tensor, backend: AttentionBackend, meta,
                  num_layers: int, cache=None) -> ForwardContext:
    return ForwardContext(positions=positions, slot_mapping=None, backend=backend, attn=meta,
                          kv_caches=[cache] * num_layers)


@torch.no_grad()
def target_pass(target, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [B, N] -> (final-normed hidden [B, N, H], logits [B, N, V]) of the frozen target."""
    b, n = ids.shape
    positions = torch.arange(n, device=ids.device).repeat(b)
    ctx = dense_context(b, n, positions, DenseCausalBackend(), DenseCausalBackend.metadata(b, n),
                        target.num_local_layers)
    hidden, _ = target(ctx, input_ids=ids.reshape(-1))
    logits = target.compute_logits(hidden)
    return hidden.reshape(b, n, -1), logits.reshape(b, n, -1)


def shifted(x: torch.Tensor, k: int, length: int, fill=0) -> torch.Tensor:
    """x[:, k:k+length] along dim 1, padded with `fill` past the end."""
    part = x[:, k:k + length]
    if part.shape[1] < length:
        pad_shape = (x.shape[0], length - part.shape[1], *x.shape[2:])
        part = torch.cat([part, torch.full(pad_shape, fill, dtype=x.dtype, device=x.device)], dim=1)
    return part


def chained_mtp(mtp, target, ids: torch.Tensor, hidden: torch.Tensor, num_steps: int) -> list[torch.Tensor]:
    """The MTP module's outputs (what each next step takes as hidden) at steps 1..K, each [B, N-1, H].

    The target's embedding is resolved here, at call time, through its owner (I5).
    """
    b, n = ids.shape
    length = n - 1
    backend, chain = ChainedMTPBackend(), ChainKV()
    embed = target.model.embed_tokens.weight
    h = hidden[:, :length].reshape(b * length, -1)
    outs = []
    for k in range(1, num_steps + 1):
        tokens = shifted(ids, k, length).reshape(-1)
        positions = (torch.arange(length, device=ids.device) + (k - 1)).repeat(b)
        ctx = dense_context(b, length, positions, backend, ChainMeta(b, length, k), 1, chain)
        h = mtp(ctx, tokens, h, embed_weight=embed)
        outs.append(h.reshape(b, length, -1))
    return outs


def step_mask(lens: torch.Tensor, starts: torch.Tensor | None, seq_len: int, k: int) -> torch.Tensor:
    """bool [B, N-1]: rows t of step k whose predicted token x_{t+k+1} exists (index < len) and,
    when `starts` is given, whose input token x_{t+1} lies in the answer (t + 1 >= start), as in
    inference, where the MTP module starts from a token the target sampled."""
    t = torch.arange(seq_len - 1, device=lens.device)[None, :]
    mask = t + k + 1 < lens[:, None]
    if starts is not None:
        mask &= t + 1 >= starts[:, None]
    return mask
