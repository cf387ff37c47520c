"""The gated delta rule for decode and verify lines in one Triton kernel, its inputs prepared in it:
`model/gated_deltanet.py`'s `delta_rule_inputs` followed by `gated_delta_rule` (those PyTorch
functions stay the oracle and the CPU path).

A decode or verify step of a Gated DeltaNet layer walks a few rows (1 + K) per request (prefill
lines run it too where fla-core's chunked kernel does not serve: float32, or fla not installed). In
PyTorch, preparing a row's inputs (q and k L2-normalised and spread over the value heads, the decay
g from A_log, dt_bias and a, beta = sigmoid(b)) is a dozen small kernels and the recurrence some
eight more over the whole float32 state [B, Hv, Dk, Dv]; at decode each is microseconds of launch
inside the step's graph. Here a program holds one (request, value head, Dv slice) of the state in
registers for all the rows, reads the conv output, a and b directly (a, b from the step's rows) and
writes its output rows in the step's row order, in the model's dtype. The states stay in their
pools: the committed state is read once, from the request's slot or from the candidate its plan
commits (so no step copies a candidate over the slot first), and written back once (lines that
commit at once: prefill chunks, plain decode) or once per row as candidates (verify lines). Padding
rows get g = beta = 0, which leave the state exactly as it was.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pipespec.kernels.launch import cached_launch
from pipespec.kernels.pdl import pdl_args, pdl_signal, pdl_wait


@triton.jit
def _softplus(x):
    """torch's softplus (threshold 20), without losing exp(x) to 1 + exp(x) for very negative x."""
    return tl.where(x > 20.0, x, tl.where(x < -15.0, tl.exp(x), tl.log(1.0 + tl.exp(x))))


@cached_launch
@triton.jit
def _recurrent_kernel(conv_ptr, a_ptr, b_ptr, alog_ptr, dtb_ptr, rows_ptr, valid_ptr, rec_ptr, cand_ptr, slot_ptr,
                      fresh_ptr, commit_ptr, settle_ptr, o_ptr, length, cand_rows, stride_a, stride_b, q_scale,
                      C: tl.constexpr, HK: tl.constexpr,
                      HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, KEEP: tl.constexpr,
                      PDL: tl.constexpr):
    pdl_signal(PDL)
    pdl_wait(PDL)
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    kh = h // (HV // HK)                                             # the key head serving value head h
    dk = tl.arange(0, DK)
    dv = tl.program_id(2) * BV + tl.arange(0, BV)
    head = (h * DK + dk[:, None]) * DV + dv[None, :]
    size = HV * DK * DV
    slot = tl.load(slot_ptr + b)
    commit = tl.load(commit_ptr + b)
    # the request's committed state, read in place: zeros when it starts here, else the candidate its
    # last verify step left and this plan names, else its slot's
    rec = rec_ptr + slot * size + head
    cand = cand_ptr + slot * cand_rows * size + head
    if tl.load(fresh_ptr + b) != 0:
        s = tl.zeros([DK, BV], tl.float32)
    elif commit >= 0:
        s = tl.load(cand + commit * size)
    else:
        s = tl.load(rec)
    tl.debug_barrier()                      # read whole before this program overwrites candidates
    neg_a = -tl.exp(tl.load(alog_ptr + h).to(tl.float32))
    dt_bias = tl.load(dtb_ptr + h).to(tl.float32)
    settle = tl.load(settle_ptr + b)
    settles, verifies = settle != 0, settle == 0
    for t in range(length):                 # a loop, not unrolled: prefill lines run it too
        line = b * length + t
        live = tl.load(valid_ptr + line) != 0
        row = tl.load(rows_ptr + line)                               # the step's flat row (padding: 0)
        q = tl.load(conv_ptr + line * C + kh * DK + dk).to(tl.float32)
        k = tl.load(conv_ptr + line * C + (HK + kh) * DK + dk).to(tl.float32)
        v = tl.load(conv_ptr + line * C + 2 * HK * DK + h * DV + dv).to(tl.float32)
        q = q * tl.rsqrt(tl.sum(q * q, 0) + 1e-6) * q_scale          # l2_normalize, eps 1e-6
        k = k * tl.rsqrt(tl.sum(k * k, 0) + 1e-6)
        g = neg_a * _softplus(tl.load(a_ptr + row * stride_a + h).to(tl.float32) + dt_bias)
        beta = tl.sigmoid(tl.load(b_ptr + row * stride_b + h).to(tl.float32))
        g = tl.where(live, g, 0.0)
        beta = tl.where(live, beta, 0.0)
        s = s * tl.exp(g)                                            # decay
        delta = (v - tl.sum(k[:, None] * s, axis=0)) * beta          # beta (v - S^T k)
        s = s + k[:, None] * delta[None, :]                          # rank-1 write
        o = tl.sum(q[:, None] * s, axis=0).to(o_ptr.dtype.element_ty)
        tl.store(o_ptr + (row * HV + h) * DV + dv, o, mask=live & (dv < DV))
        if KEEP:                            # a verify line: the state after each row is a candidate
            if verifies & (t < cand_rows):
                tl.store(cand + t * size, s)
    if settles:                             # a plain line commits its final state at once
        tl.store(rec, s)


def supported(dk: int, dv: int) -> bool:
    """Head sizes the kernel takes: powers of two (the published models' 128; tests' 8)."""
    return dk & (dk - 1) == 0 and dv & (dv - 1) == 0


def fused_gated_delta_rule(conv, a, b, A_log, dt_bias, rec, cand, slots, fresh, commit, settles, rows, valid,
                           key_heads: int, dk: int, keep: bool = False) -> torch.Tensor:
    """`delta_rule_inputs(conv, a, b, A_log, dt_bias, key_heads, dk, dv)` then `gated_delta_rule` on
    them, with the states kept in place as `LinearMeta.commit_candidates` and `LinearMeta.store` keep
    them: conv [B, L, Hk Dk | Hk Dk | Hv Dv] (after the conv's SiLU); a, b [T, Hv] the step's rows (any
    row stride); rows, valid [B, L] each line position's flat row and whether it is real; rec float32
    [slots, Hv, Dk, Dv] and cand float32 [slots, R, Hv, Dk, Dv] a layer's committed and candidate
    states; slots int64 [B]; fresh bool [B] (start from zeros); commit int64 [B] (start from that
    candidate; -1: from the committed state); settles bool [B] (write the final state to the slot;
    otherwise, with `keep`, the state after row t to candidate t < R).
    Returns o [T, Hv, Dv] in conv's dtype, in the step's row order."""
    bsz, length, channels = conv.shape
    hv, dv = rec.shape[1], rec.shape[3]
    if rec.dtype != torch.float32 or not rec.is_contiguous() or not cand.is_contiguous():
        raise ValueError("the recurrent state pools must be contiguous float32")
    if a.stride(1) != 1 or b.stride(1) != 1:
        raise ValueError("a and b need unit-stride heads")
    o = torch.empty(a.shape[0], hv, dv, dtype=conv.dtype, device=conv.device)
    bv = min(dv, 32)
    _recurrent_kernel[(bsz, hv, dv // bv)](conv.contiguous(), a, b, A_log, dt_bias, rows.contiguous(),
                                           valid.contiguous(), rec, cand, slots.contiguous(), fresh.contiguous(),
                                           commit.contiguous(), settles.contiguous(), o, length, cand.shape[1],
                                           a.stride(0), b.stride(0), dk ** -0.5, C=channels, HK=key_heads, HV=hv,
                                           DK=dk, DV=dv, BV=bv, KEEP=keep, num_warps=4, **pdl_args(a.device))
    return o
