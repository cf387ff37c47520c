"""The gated delta rule for decode and verify lines in one Triton kernel, its inputs prepared in it:
`model/gated_deltanet.py`'s `delta_rule_inputs` followed by `gated_delta_rule` (those PyTorch
functions stay the oracle and the CPU path).

A decode or verify step of a Gated DeltaNet layer walks a few rows (1 + K) per request (prefill
lines run it too where fla-core's chunked kernel does not serve: float32, or fla not installed). In
PyTorch, preparing a row's inputs (q and k L2-normalised and spread over the value heads, the decay
g from A_log, dt_bias and a, beta = sigmoid(b)) is a dozen small kernels and the recurrence some
eight more over the whole float32 state [B, Hv, Dk, Dv]; at decode each is microseconds of launch
inside the step's graph. Here a program holds one (request, value head, Dv slice) of the state in
registers for all the rows and reads the conv output, a and b directly: the state is read once, in
place from the request's slot, written back there once (lines that commit at once: prefill chunks,
plain decode), or once per row as candidates (verify lines, whose committed state stays as it was). Padding rows get g = beta = 0, which leave the state exactly as it was.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _softplus(x):
    """torch's softplus (threshold 20), without losing exp(x) to 1 + exp(x) for very negative x."""
    return tl.where(x > 20.0, x, tl.where(x < -15.0, tl.exp(x), tl.log(1.0 + tl.exp(x))))


@triton.jit
def _recurrent_kernel(conv_ptr, a_ptr, b_ptr, alog_ptr, dtb_ptr, valid_ptr, pool_ptr, slot_ptr, fresh_ptr,
                      commit_ptr, o_ptr, after_ptr, length, q_scale, C: tl.constexpr, HK: tl.constexpr,
                      HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, KEEP: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    kh = h // (HV // HK)                                             # the key head serving value head h
    dk = tl.arange(0, DK)
    dv = tl.program_id(2) * BV + tl.arange(0, BV)
    head = (h * DK + dk[:, None]) * DV + dv[None, :]
    # read in place from the request's slot of the layer's state pool; a request that starts here
    # (position 0) starts from zeros, whatever its slot holds
    pool_off = tl.load(slot_ptr + b) * HV * DK * DV + head
    fresh = tl.load(fresh_ptr + b) != 0
    s = tl.where(fresh, 0.0, tl.load(pool_ptr + pool_off))           # [DK, BV] float32
    neg_a = -tl.exp(tl.load(alog_ptr + h).to(tl.float32))
    dt_bias = tl.load(dtb_ptr + h).to(tl.float32)
    for t in range(length):                 # a loop, not unrolled: prefill lines run it too
        line = b * length + t
        live = tl.load(valid_ptr + line) != 0
        q = tl.load(conv_ptr + line * C + kh * DK + dk).to(tl.float32)
        k = tl.load(conv_ptr + line * C + (HK + kh) * DK + dk).to(tl.float32)
        v = tl.load(conv_ptr + line * C + 2 * HK * DK + h * DV + dv).to(tl.float32)
        q = q * tl.rsqrt(tl.sum(q * q, 0) + 1e-6) * q_scale          # l2_normalize, eps 1e-6
        k = k * tl.rsqrt(tl.sum(k * k, 0) + 1e-6)
        g = neg_a * _softplus(tl.load(a_ptr + line * HV + h).to(tl.float32) + dt_bias)
        beta = tl.sigmoid(tl.load(b_ptr + line * HV + h).to(tl.float32))
        g = tl.where(live, g, 0.0)
        beta = tl.where(live, beta, 0.0)
        s = s * tl.exp(g)                                            # decay
        delta = (v - tl.sum(k[:, None] * s, axis=0)) * beta          # beta (v - S^T k)
        s = s + k[:, None] * delta[None, :]                          # rank-1 write
        row = line * HV + h
        tl.store(o_ptr + row * DV + dv, tl.sum(q[:, None] * s, axis=0))
        if KEEP:
            tl.store(after_ptr + (row * DK + dk[:, None]) * DV + dv[None, :], s)
    if tl.load(commit_ptr + b) != 0:        # a plain line's final state goes straight back to its slot
        tl.store(pool_ptr + pool_off, s)


def supported(dk: int, dv: int) -> bool:
    """Head sizes the kernel takes: powers of two (the published models' 128; tests' 8)."""
    return dk & (dk - 1) == 0 and dv & (dv - 1) == 0


def fused_gated_delta_rule(conv, a, b, A_log, dt_bias, pool, slots, fresh, valid, commit, key_heads: int,
                           dk: int, keep: bool = False):
    """`delta_rule_inputs(conv, a, b, A_log, dt_bias, key_heads, dk, dv)` then `gated_delta_rule` on
    them, from the states `where(fresh, 0, pool[slots])`: conv [B, L, Hk Dk | Hk Dk | Hv Dv] (after the
    conv's SiLU); a, b [B, L, Hv]; pool float32 [slots, Hv, Dk, Dv] (a layer's recurrent states, read
    in place); slots int64 [B]; fresh, valid bool [B], [B, L]; commit bool [B]: the requests whose
    final state is written back to their slot (the others' slots are only read). Returns (o float32
    [B, L, Hv, Dv], states after each row [B, L, Hv, Dk, Dv] when `keep`, else None)."""
    bsz, length, channels = conv.shape
    hv, dv = pool.shape[1], pool.shape[3]
    if pool.dtype != torch.float32 or not pool.is_contiguous():
        raise ValueError("the recurrent state pool must be contiguous float32")
    conv, a, b, valid = conv.contiguous(), a.contiguous(), b.contiguous(), valid.contiguous()
    o = torch.empty(bsz, length, hv, dv, dtype=torch.float32, device=conv.device)
    after = torch.empty(bsz, length, hv, dk, dv, dtype=torch.float32, device=conv.device) if keep else o
    bv = min(dv, 32)
    _recurrent_kernel[(bsz, hv, dv // bv)](conv, a, b, A_log, dt_bias, valid, pool, slots.contiguous(),
                                           fresh.contiguous(), commit.contiguous(), o, after, length, dk ** -0.5,
                                           C=channels, HK=key_heads, HV=hv, DK=dk, DV=dv, BV=bv, KEEP=keep,
                                           num_warps=4)
    return o, (after if keep else None)
