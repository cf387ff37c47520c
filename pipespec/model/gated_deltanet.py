"""Gated DeltaNet (Qwen3-Next, Qwen3.5/3.6 linear-attention layers) over per-request state slots.

Per request and layer the state is a conv state (the last `conv_kernel - 1` inputs of the causal
depthwise conv) and a recurrent state S [value heads, key dim, value dim], kept in a slot the driver
allocated (`StepPlan.state_slots`). Per token t, with q and k L2-normalised and q scaled by 1/sqrt(dk):

    S <- S * exp(g_t)                    g_t = -exp(A_log) * softplus(a_t + dt_bias)   (decay)
    S <- S + k_t (beta_t (v_t - S^T k_t))^T                                  beta_t = sigmoid(b_t)
    o_t = S^T q_t

then o is RMS-normed per head, times silu(z), and projected out. This is the plain PyTorch
reference (one token at a time, all requests of a step at once); it is also what GPU kernels are
checked against.

Speculative verification runs 1 + K rows that may be rejected, and a recurrent state cannot be
rolled back by position. So for a request that verifies drafts the committed state is left as it
was and the state after each row is kept as a candidate; the next plan names the candidate to commit
(`state_commit`: the accepted count), and every stage commits it before running the request again.

With tensor parallelism each rank keeps linear_num_key_heads / T key heads and their value heads:
its rows of the input projection (q, k, v, z, b, a of its heads; in Qwen3-Next's fused layout a
contiguous block of key-head groups), of the depthwise conv, dt_bias and A_log, and its columns of
out_proj (which all-reduces). The recurrence is per head, so its states hold only its own heads.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pipespec.model.hybrid_config import HybridConfig
from pipespec.model.tp_layers import SINGLE, RowParallelLinear, Shard
from pipespec.parallel import TensorParallel


@dataclass(frozen=True)
class StateShape:
    conv_dim: int
    conv_width: int          # conv_kernel - 1 past inputs
    heads: int
    key_dim: int
    value_dim: int


@dataclass
class LinearState:
    """One layer's states for every slot: committed, and a candidate after each verify row."""

    conv: torch.Tensor        # [slots, conv_width, conv_dim]
    rec: torch.Tensor         # float32 [slots, heads, key_dim, value_dim]
    cand_conv: torch.Tensor   # [slots, rows, conv_width, conv_dim]
    cand_rec: torch.Tensor    # float32 [slots, rows, heads, key_dim, value_dim]


def allocate_states(shapes: list[StateShape], slots: int, rows: int, dtype: torch.dtype, device) -> list[LinearState]:
    # zeros: a slot is reset by its request's first row (position 0) anyway, but zeros keep unused
    # slots finite
    out = []
    for s in shapes:
        out.append(LinearState(
            torch.zeros(slots, s.conv_width, s.conv_dim, dtype=dtype, device=device),
            torch.zeros(slots, s.heads, s.key_dim, s.value_dim, dtype=torch.float32, device=device),
            torch.zeros(slots, rows, s.conv_width, s.conv_dim, dtype=dtype, device=device),
            torch.zeros(slots, rows, s.heads, s.key_dim, s.value_dim, dtype=torch.float32, device=device)))
    return out


def state_bytes(shapes: list[StateShape], slots: int, rows: int, dtype: torch.dtype) -> int:
    """What `allocate_states` takes: committed plus `rows` candidates per slot."""
    item = torch.empty((), dtype=dtype).element_size()
    return sum(slots * (1 + rows) * (s.conv_width * s.conv_dim * item + s.heads * s.key_dim * s.value_dim * 4)
               for s in shapes)


@dataclass
class LinearMeta:
    """A step's requests as padded lines of rows, with their slots: built once per step from the plan."""

    rows: torch.Tensor        # int64 [B, L] flat row of each padded position (pad: 0)
    valid: torch.Tensor       # bool [B, L]
    lengths: torch.Tensor     # int64 [B]
    slots: torch.Tensor       # int64 [B]
    fresh: torch.Tensor       # bool [B] the request starts here (position 0): zero state
    commit: torch.Tensor      # int64 [B] candidate to commit before running (-1: none)
    candidates: torch.Tensor  # bool [B] the request verifies drafts: keep a candidate per row
    states: list[LinearState]  # per local linear-attention layer

    @classmethod
    def build(cls, query_start_loc, positions, slots, commit, num_drafts, states) -> "LinearMeta":
        starts, lengths = query_start_loc[:-1], query_start_loc[1:] - query_start_loc[:-1]
        width = int(lengths.max()) if lengths.numel() else 0
        off = torch.arange(width, device=positions.device)
        valid = off[None, :] < lengths[:, None]
        rows = torch.where(valid, starts[:, None] + off[None, :], torch.zeros_like(valid, dtype=torch.int64))
        fresh = positions[starts] == 0
        return cls(rows, valid, lengths, slots, fresh, commit, num_drafts > 0, states)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gated_delta_rule(q, k, v, g, beta, state, valid, keep=None):
    """The recurrence over padded lines. q, k: [B, L, Hv, Dk] (normalised, q scaled); v: [B, L, Hv, Dv];
    g, beta: [B, L, Hv]; state: float32 [B, Hv, Dk, Dv]; valid: bool [B, L] (padding leaves the state
    as it is). Returns (o [B, L, Hv, Dv] float32, final state, states after each row [B, L, ...] when
    `keep`)."""
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    after = [] if keep else None
    for t in range(q.shape[1]):
        s = state * g[:, t].exp()[..., None, None]
        kv = (s * k[:, t, ..., None]).sum(-2)                          # S^T k  [B, Hv, Dv]
        delta = (v[:, t] - kv) * beta[:, t, ..., None]
        s = s + k[:, t, ..., None] * delta[..., None, :]
        state = torch.where(valid[:, t, None, None, None], s, state)
        out[:, t] = (state * q[:, t, ..., None]).sum(-2)
        if keep:
            after.append(state)
    return out, state, (torch.stack(after, 1) if keep else None)


class GatedRMSNorm(nn.Module):
    """RMSNorm over each head's values (plain weight, not 1 + w), then times silu(z) in float32."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * x32.to(x.dtype)
        return (out.float() * F.silu(z.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    def __init__(self, hidden: int, cfg: HybridConfig, eps: float, tp: TensorParallel = SINGLE):
        super().__init__()
        hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        if hv % hk:
            raise ValueError(f"linear_num_value_heads={hv} is not a multiple of linear_num_key_heads={hk}")
        k0, self.hk = tp.split(hk, "linear_num_key_heads")        # this rank's key heads
        r = hv // hk
        self.hv = self.hk * r                                      # and their value heads
        self.tp, self._heads = tp, (hk, hv, k0, k0 * r)
        self.key_size, self.value_size = self.hk * self.dk, self.hv * self.dv
        self.conv_dim = 2 * self.key_size + self.value_size
        self.kernel = cfg.conv_kernel
        self.fused = cfg.fused_linear_proj
        # one matrix: Qwen3.5's in_proj_qkv, in_proj_z, in_proj_b, in_proj_a stacked, or Qwen3-Next's
        # in_proj_qkvz, in_proj_ba (interleaved per key head, split in `_split`)
        self.in_proj = nn.Linear(hidden, self.conv_dim + self.value_size + 2 * self.hv, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel, groups=self.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.hv))
        self.A_log = nn.Parameter(torch.zeros(self.hv))
        self.norm = GatedRMSNorm(self.dv, eps)
        self.out_proj = RowParallelLinear(hv * self.dv, hidden, False, tp, "linear value heads * head dim")

    def checkpoint_shards(self) -> dict[str, Shard]:
        """This rank's rows of the input projection's parts, the conv, dt_bias and A_log."""
        if self.tp.size == 1:
            return {}
        hk, hv, k0, v0 = self._heads
        nk, nv, dk, dv = self.hk, self.hv, self.dk, self.dv
        qkv = ((k0 * dk, (k0 + nk) * dk), (hk * dk + k0 * dk, hk * dk + (k0 + nk) * dk),
               (2 * hk * dk + v0 * dv, 2 * hk * dk + (v0 + nv) * dv))
        conv_full = 2 * hk * dk + hv * dv
        if self.fused:         # per key head: [q | k | v of its value heads | z of them], then [b | a]
            w1, w2 = 2 * dk + 2 * (hv // hk) * dv, 2 * (hv // hk)
            in_proj = Shard(0, ((k0 * w1, (k0 + nk) * w1), (k0 * w2, (k0 + nk) * w2)), (hk * w1, hk * w2))
        else:
            in_proj = Shard(0, (qkv, (v0 * dv, (v0 + nv) * dv), (v0, v0 + nv), (v0, v0 + nv)),
                            (conv_full, hv * dv, hv, hv))
        heads = Shard(0, ((v0, v0 + nv),), (hv,))
        return {"in_proj.weight": in_proj, "conv1d.weight": Shard(0, (qkv,), (conv_full,)),
                "dt_bias": heads, "A_log": heads}

    def checkpoint_parts(self) -> list[str]:
        return ["in_proj_qkvz", "in_proj_ba"] if self.fused else ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"]

    def state_shape(self) -> StateShape:
        return StateShape(self.conv_dim, self.kernel - 1, self.hv, self.dk, self.dv)

    def _split(self, p: torch.Tensor):
        """-> mixed qkv [T, conv_dim] (q, k, v, each head-major), z [T, Hv, Dv], b, a [T, Hv]."""
        t = p.shape[0]
        if not self.fused:
            qkv, z, b, a = p.split([self.conv_dim, self.value_size, self.hv, self.hv], dim=-1)
            return qkv, z.reshape(t, self.hv, self.dv), b, a
        r = self.hv // self.hk            # value heads per key head
        qkvz, ba = p.split([self.conv_dim + self.value_size, 2 * self.hv], dim=-1)
        q, k, v, z = qkvz.view(t, self.hk, -1).split([self.dk, self.dk, r * self.dv, r * self.dv], dim=-1)
        b, a = ba.view(t, self.hk, 2 * r).split([r, r], dim=-1)
        qkv = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)
        return qkv, z.reshape(t, self.hv, self.dv), b.reshape(t, self.hv), a.reshape(t, self.hv)

    def forward(self, x: torch.Tensor, meta: LinearMeta, state: LinearState) -> torch.Tensor:
        self._commit(meta, state)
        qkv, z, b, a = self._split(self.in_proj(x))
        B, L = meta.rows.shape
        lines = qkv[meta.rows] * meta.valid[..., None]                            # [B, L, C]
        past = torch.where(meta.fresh[:, None, None], torch.zeros((), dtype=qkv.dtype, device=x.device),
                           state.conv[meta.slots])
        full = torch.cat([past, lines], dim=1)                                   # [B, w + L, C]
        conv = (full.unfold(1, self.kernel, 1) * self.conv1d.weight[:, 0]).sum(-1)   # [B, L, C]
        conv = F.silu(conv)
        q, k, v = conv.split([self.key_size, self.key_size, self.value_size], dim=-1)
        r = self.hv // self.hk
        q = l2_normalize(q.float().view(B, L, self.hk, self.dk)) * self.dk ** -0.5
        k = l2_normalize(k.float().view(B, L, self.hk, self.dk))
        q, k = (y.repeat_interleave(r, dim=2) for y in (q, k))
        v = v.view(B, L, self.hv, self.dv)
        g = -self.A_log.float().exp() * F.softplus(a[meta.rows].float() + self.dt_bias.float())
        beta = b[meta.rows].float().sigmoid()
        rec0 = torch.where(meta.fresh[:, None, None, None], torch.zeros((), device=x.device), state.rec[meta.slots])
        keep = bool(meta.candidates.any())
        o, final, after = gated_delta_rule(q, k, v, g, beta, rec0, meta.valid, keep)
        self._store(meta, state, full, final, after)
        flat = torch.empty(x.shape[0], self.hv, self.dv, dtype=x.dtype, device=x.device)
        flat[meta.rows[meta.valid]] = o[meta.valid].to(x.dtype)
        out = self.norm(flat, z).reshape(x.shape[0], self.value_size)
        return self.out_proj(out)

    @staticmethod
    def _commit(meta: LinearMeta, state: LinearState) -> None:
        """Adopt each request's accepted candidate from its last verify step (named by the plan)."""
        which = meta.commit >= 0
        if not bool(which.any()):
            return
        slots, rows = meta.slots[which], meta.commit[which]
        state.conv[slots] = state.cand_conv[slots, rows]
        state.rec[slots] = state.cand_rec[slots, rows]

    def _store(self, meta, state, full, final, after) -> None:
        w = self.kernel - 1
        plain = ~meta.candidates
        if bool(plain.any()):                    # prefill chunks, plain decode: commit at once
            idx = meta.lengths[plain][:, None] + torch.arange(w, device=full.device)[None, :]
            state.conv[meta.slots[plain]] = full[plain].gather(1, idx[..., None].expand(-1, -1, full.shape[-1]))
            state.rec[meta.slots[plain]] = final[plain]
        if after is not None:                    # verify lines: the state after each row, kept aside
            c = meta.candidates
            n = min(after.shape[1], state.cand_rec.shape[1])
            windows = full[c].unfold(1, w, 1)[:, 1:n + 1].transpose(-1, -2)    # after row j: inputs j+1 .. j+w
            state.cand_conv[meta.slots[c], :n] = windows
            state.cand_rec[meta.slots[c], :n] = after[c][:, :n]
