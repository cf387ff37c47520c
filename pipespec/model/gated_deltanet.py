"""Gated DeltaNet (Qwen3-Next, Qwen3.5/3.6 linear-attention layers) over per-request state slots.

Per request and layer the state is a conv state (the last `conv_kernel - 1` inputs of the causal
depthwise conv) and a recurrent state S [value heads, key dim, value dim], kept in a slot the driver
allocated (`StepPlan.state_slots`). Per token t, with q and k L2-normalised and q scaled by 1/sqrt(dk):

    S <- S * exp(g_t)                    g_t = -exp(A_log) * softplus(a_t + dt_bias)   (decay)
    S <- S + k_t (beta_t (v_t - S^T k_t))^T                                  beta_t = sigmoid(b_t)
    o_t = S^T q_t

then o is RMS-normed per head, times silu(z), and projected out. `gated_delta_rule` is the plain
PyTorch recurrence (one token at a time, all requests of a step at once): the CPU runs it, and it
is the oracle of the GPU kernels. On a GPU decode and verify lines run one fused Triton kernel
(`kernels/delta_rule_recurrent.py`, inside CUDA graphs), and bf16 prefill chunks fla-core's chunked
kernel when it is installed (`kernels/fla_delta_rule.py`).

States, candidates for verify rows and the step's view of them: `model/linear_state.py`.

With tensor parallelism each rank keeps linear_num_key_heads / T key heads and their value heads:
its rows of the input projection (q, k, v, z, b, a of its heads; in Qwen3-Next's fused layout a
contiguous block of key-head groups), of the depthwise conv, dt_bias and A_log, and its columns of
out_proj (which all-reduces). The recurrence is per head, so its states hold only its own heads.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pipespec import kernels
from pipespec.kernels.fla_delta_rule import chunked_delta_rule, fla_available
from pipespec.model.hybrid_config import HybridConfig
from pipespec.model.linear import Linear
from pipespec.model.linear_state import LinearMeta, LinearState, StateShape
from pipespec.model.tp_layers import SINGLE, RowParallelLinear, Shard
from pipespec.parallel import TensorParallel


# Lines of fewer rows take the fused recurrence even in prefill: fla-core's chunked rule costs far
# more host time a layer (its Python and ~10 launches) than the recurrence takes to walk a few rows
# on the GPU, all requests at once (RESULTS.md).
CHUNKED_FROM_ROWS = 64


def use_chunked_kernel(x: torch.Tensor, meta: LinearMeta) -> bool:
    """fla-core's chunked kernel for bf16/fp16 prefill chunks of at least CHUNKED_FROM_ROWS rows on a
    GPU (its products run in tf32 at best, so float32 engines keep the exact recurrence); the
    recurrence for shorter lines and for decode and verify lines, whose per-row candidate states it
    keeps."""
    return (x.is_cuda and x.dtype != torch.float32 and fla_available() and not meta.flags.verify
            and meta.flags.width >= CHUNKED_FROM_ROWS)


def _fused_recurrence_serves(dk: int, dv: int) -> bool:
    from pipespec.kernels.delta_rule_recurrent import supported    # Triton: only where kernels run
    return supported(dk, dv)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def delta_rule_inputs(conv, a, b, A_log, dt_bias, key_heads: int, dk: int, dv: int):
    """The recurrence's inputs from a step's lines: conv [B, L, q | k | v] (after the conv and its
    SiLU, heads major), a, b [B, L, Hv] -> q, k [B, L, Hv, Dk] (L2-normalised, q scaled by Dk^-0.5,
    each key head serving its Hv / Hk value heads), v [B, L, Hv, Dv], g (log decay), beta [B, L, Hv]."""
    B, L, _ = conv.shape
    hv = a.shape[-1]
    q, k, v = conv.split([key_heads * dk, key_heads * dk, hv * dv], dim=-1)
    q = l2_normalize(q.float().view(B, L, key_heads, dk)) * dk ** -0.5
    k = l2_normalize(k.float().view(B, L, key_heads, dk))
    q, k = (y.repeat_interleave(hv // key_heads, dim=2) for y in (q, k))
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return q, k, v.view(B, L, hv, dv), g, b.float().sigmoid()


def gated_delta_rule(q, k, v, g, beta, state, valid, keep=None):
    """The recurrence over padded lines. q, k: [B, L, Hv, Dk] (normalised, q scaled); v: [B, L, Hv, Dv];
    g, beta: [B, L, Hv]; state: float32 [B, Hv, Dk, Dv]; valid: bool [B, L] (padding leaves the state
    as it is). Returns (o [B, L, Hv, Dv] float32, final state, states after each row [B, L, ...] when
    `keep`).

    Written to touch the state as few times per row as PyTorch allows (it is the bulk of a decode
    step's memory traffic at large batch): the reductions are batched matrix-vector products, the
    rank-1 update one fused multiply-add, and padding rows get g = 0 and beta = 0, which leave the
    state exactly as it was with no masked copy."""
    pad = ~valid[..., None]
    q, k, v = (x.float() for x in (q, k, v))
    g, beta = g.float().masked_fill(pad, 0.0), beta.float().masked_fill(pad, 0.0)
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    after = [] if keep else None
    for t in range(q.shape[1]):
        decay = g[:, t].exp()[..., None]                                       # [B, Hv, 1]
        kv = torch.einsum("bhk,bhkv->bhv", k[:, t], state) * decay             # (decayed S)^T k
        delta = (v[:, t] - kv) * beta[:, t, ..., None]
        state = torch.addcmul(state * decay[..., None], k[:, t, ..., None], delta[..., None, :])
        out[:, t] = torch.einsum("bhk,bhkv->bhv", q[:, t], state)
        if keep:
            after.append(state)
    return out, state, (torch.stack(after, 1) if keep else None)


def causal_conv_lines(qkv: torch.Tensor, meta: LinearMeta, pool: torch.Tensor, weight: torch.Tensor):
    """The depthwise causal conv and its SiLU over a step's lines: qkv [T, C] the step's rows, pool
    [slots, w, C] the layer's conv states, weight [C, 1, w + 1]. Returns (silu(conv) [B, L, C], the
    lines' inputs [B, w + L, C]: each request's past inputs (zeros when it starts here), then its
    rows, padding zero). On a GPU one kernel does this (`kernels/causal_conv.py`)."""
    lines = qkv[meta.rows] * meta.valid[..., None]                               # [B, L, C]
    past = torch.where(meta.fresh[:, None, None], torch.zeros((), dtype=qkv.dtype, device=qkv.device),
                       pool[meta.slots])
    full = torch.cat([past, lines], dim=1)                                       # [B, w + L, C]
    conv = (full.unfold(1, weight.shape[-1], 1) * weight[:, 0]).sum(-1)          # [B, L, C]
    return F.silu(conv), full


class GatedRMSNorm(nn.Module):
    """RMSNorm over each head's values (plain weight, not 1 + w), then times silu(z) in float32."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        if kernels.enabled(x):
            from pipespec.kernels.fused_ops import gated_rms_norm
            return gated_rms_norm(x, z, self.weight, self.eps)
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
        self.in_proj = Linear(hidden, self.conv_dim + self.value_size + 2 * self.hv, bias=False)
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
        qkv, z, b, a = self._split(self.in_proj(x))
        chunked = use_chunked_kernel(x, meta)
        if not chunked and kernels.enabled(x) and _fused_recurrence_serves(self.dk, self.dv):
            # two kernels (decode and verify lines): the conv, then `delta_rule_inputs` and the
            # recurrence, both reading and writing the states in place as the plan says
            # (`commit_candidates` and `store` are in them)
            from pipespec.kernels.causal_conv import causal_conv
            from pipespec.kernels.delta_rule_recurrent import fused_gated_delta_rule
            m = meta
            conv = causal_conv(qkv, m.rows, m.valid, m.lengths, state.conv, state.cand_conv, m.slots, m.fresh,
                               m.commit, m.settles, self.conv1d.weight)
            flat = fused_gated_delta_rule(conv, a, b, self.A_log, self.dt_bias, state.rec, state.cand_rec, m.slots,
                                          m.fresh, m.commit, m.settles, m.rows, m.valid, self.hk, self.dk,
                                          keep=m.flags.verify)
        else:
            meta.commit_candidates(state)
            conv, full = causal_conv_lines(qkv, meta, state.conv, self.conv1d.weight)
            rec0 = torch.where(meta.fresh[:, None, None, None], torch.zeros((), device=x.device),
                               state.rec[meta.slots])
            q, k, v, g, beta = delta_rule_inputs(conv, a[meta.rows], b[meta.rows], self.A_log, self.dt_bias, self.hk,
                                                 self.dk, self.dv)
            if chunked:
                (o, final), after = chunked_delta_rule(q.to(x.dtype), k.to(x.dtype), v, g, beta, rec0, meta.valid), None
            else:
                o, final, after = gated_delta_rule(q, k, v, g, beta, rec0, meta.valid, keep=meta.flags.verify)
            meta.store(state, full, final, after)
            flat = o[meta.line, meta.offset].to(x.dtype)                          # [T, Hv, Dv]
        out = self.norm(flat, z).reshape(x.shape[0], self.value_size)
        return self.out_proj(out)
