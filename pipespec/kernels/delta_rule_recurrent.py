"""The gated delta rule for decode and verify lines in one Triton kernel (`gated_delta_rule`'s GPU
form; that PyTorch recurrence stays the oracle).

A decode or verify step of a Gated DeltaNet layer walks a few rows (1 + K) per request (prefill
lines run it too where fla-core's chunked kernel does not serve: float32, or fla not installed). In PyTorch
each row is some eight kernels over the whole float32 state [B, Hv, Dk, Dv]; here a program holds one
(request, value head, Dv slice) of the state in registers for all the rows: the state is read once,
written once, plus once per row when verify rows keep a candidate state after each row. Padding
rows arrive with g = beta = 0, which leave the state exactly as it was.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _recurrent_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, s_ptr, o_ptr, final_ptr, after_ptr,
                      length, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
                      KEEP: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    dk = tl.arange(0, DK)
    dv = tl.program_id(2) * BV + tl.arange(0, BV)
    state_off = ((b * HV + h) * DK + dk[:, None]) * DV + dv[None, :]
    s = tl.load(s_ptr + state_off)                                   # [DK, BV] float32
    for t in range(length):                 # a loop, not unrolled: prefill lines run it too
        row = (b * length + t) * HV + h
        k = tl.load(k_ptr + row * DK + dk).to(tl.float32)
        q = tl.load(q_ptr + row * DK + dk).to(tl.float32)
        v = tl.load(v_ptr + row * DV + dv).to(tl.float32)
        g = tl.load(g_ptr + row)
        beta = tl.load(beta_ptr + row)
        s = s * tl.exp(g)                                            # decay
        delta = (v - tl.sum(k[:, None] * s, axis=0)) * beta          # beta (v - S^T k)
        s = s + k[:, None] * delta[None, :]                          # rank-1 write
        tl.store(o_ptr + row * DV + dv, tl.sum(q[:, None] * s, axis=0))
        if KEEP:
            tl.store(after_ptr + (row * DK + dk[:, None]) * DV + dv[None, :], s)
    tl.store(final_ptr + state_off, s)


def supported(dk: int, dv: int) -> bool:
    """Head sizes the kernel takes: powers of two (the published models' 128; tests' 8)."""
    return dk & (dk - 1) == 0 and dv & (dv - 1) == 0


def recurrent_delta_rule(q, k, v, g, beta, state, valid, keep: bool = False):
    """Same arguments and results as `model/gated_deltanet.py::gated_delta_rule`: q, k [B, L, Hv, Dk]
    (normalised, q scaled); v [B, L, Hv, Dv]; g, beta [B, L, Hv]; state float32 [B, Hv, Dk, Dv];
    valid bool [B, L]. Returns (o float32 [B, L, Hv, Dv], final state, states after each row
    [B, L, Hv, Dk, Dv] when `keep`, else None)."""
    bsz, length, hv, dk = q.shape
    dv = v.shape[-1]
    pad = ~valid[..., None]
    g = g.float().masked_fill(pad, 0.0).contiguous()
    beta = beta.float().masked_fill(pad, 0.0).contiguous()
    q, k, v, state = q.contiguous(), k.contiguous(), v.contiguous(), state.float().contiguous()
    o = torch.empty(bsz, length, hv, dv, dtype=torch.float32, device=v.device)
    final = torch.empty_like(state)
    after = torch.empty(bsz, length, hv, dk, dv, dtype=torch.float32, device=v.device) if keep else final
    bv = min(dv, 32)
    _recurrent_kernel[(bsz, hv, dv // bv)](q, k, v, g, beta, state, o, final, after, length, HV=hv, DK=dk, DV=dv,
                                           BV=bv, KEEP=keep, num_warps=4)
    return o, final, (after if keep else None)
