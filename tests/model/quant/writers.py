"""Our own writers of the quantized layouts (model/quant/formats.py names them): each returns the
checkpoint tensors of one linear layer and the dense weight they stand for, computed from the
integers before packing (so a reader that unpacks wrongly cannot agree with it by construction)."""
from __future__ import annotations

import torch

from pipespec.model.quant.formats import AWQ_ORDER


def _pack(values: torch.Tensor, order=tuple(range(8))) -> torch.Tensor:
    """int64 [..., n * 8] -> int32 [..., n]: nibble i of word k holds value 8k + order[i]."""
    v = values.reshape(*values.shape[:-1], -1, 8)[..., list(order)]
    words = torch.zeros(v.shape[:-1], dtype=torch.int64)
    for i in range(8):
        words |= v[..., i] << (4 * i)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)     # the same 32 bits


def fp8(w: torch.Tensor, block: tuple[int, int]):
    out, inp = w.shape
    bo, bi = block
    scale = torch.empty(-(-out // bo), -(-inp // bi))
    q = torch.empty(out, inp, dtype=torch.float8_e4m3fn)
    for r in range(scale.shape[0]):
        for c in range(scale.shape[1]):
            blk = w[r * bo:(r + 1) * bo, c * bi:(c + 1) * bi]
            scale[r, c] = blk.abs().max().clamp_min(1e-12) / 448.0
            q[r * bo:(r + 1) * bo, c * bi:(c + 1) * bi] = (blk / scale[r, c]).to(torch.float8_e4m3fn)
    ref = q.float() * scale.repeat_interleave(bo, 0)[:out].repeat_interleave(bi, 1)[:, :inp]
    return {"weight": q, "weight_scale_inv": scale}, ref


def _int4_groups(wt: torch.Tensor, groups: torch.Tensor, num_groups: int, sym: bool):
    """wt [in, out], groups [in]: per-(group, column) scale and zero, and the 4-bit values."""
    scales, zeros = torch.empty(num_groups, wt.shape[1]), torch.empty(num_groups, wt.shape[1], dtype=torch.int64)
    for g in range(num_groups):
        rows = wt[groups == g]
        if sym:
            scales[g] = rows.abs().amax(0).clamp_min(1e-8) / 7.5
            zeros[g] = 8
        else:
            lo, hi = rows.amin(0).clamp_max(0), rows.amax(0).clamp_min(0)
            scales[g] = ((hi - lo) / 15).clamp_min(1e-8)
            zeros[g] = torch.round(-lo / scales[g]).long().clamp(0, 15)
    scales = scales.half().float()                                   # stored as fp16
    q = (torch.round(wt / scales[groups]) + zeros[groups]).clamp(0, 15).long()
    ref = ((q - zeros[groups]).float() * scales[groups]).t().contiguous()
    return q, zeros, scales, ref


def awq(w: torch.Tensor, group: int):
    wt = w.t()
    groups = torch.arange(wt.shape[0]) // group
    q, zeros, scales, ref = _int4_groups(wt, groups, wt.shape[0] // group, sym=False)
    return {"qweight": _pack(q, AWQ_ORDER), "qzeros": _pack(zeros, AWQ_ORDER), "scales": scales.half()}, ref


def gptq(w: torch.Tensor, group: int, act_order: bool, seed: int = 0):
    wt = w.t()
    n = wt.shape[0]
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)) if act_order else torch.arange(n)
    g_idx = torch.empty(n, dtype=torch.int64)
    g_idx[perm] = torch.arange(n) // group                            # groups follow the permuted order
    q, zeros, scales, ref = _int4_groups(wt, g_idx, n // group, sym=True)
    qweight = _pack(q.t().contiguous()).t().contiguous()             # rows 8k..8k+7 into word k
    return {"qweight": qweight, "qzeros": _pack(zeros - 1), "scales": scales.half(),
            "g_idx": g_idx.to(torch.int32)}, ref


def packed_int4(w: torch.Tensor, layout: str, group: int, seed: int = 0):
    """(`Int4Weight` as the loader packs it, dense reference) for layout awq, gptq or gptq_act_order."""
    from pipespec.model.quant.packed import Int4Weight
    if layout == "awq":
        t, ref = awq(w, group)
        return Int4Weight.from_awq(t["qweight"], t["qzeros"], t["scales"].float(), group), ref
    t, ref = gptq(w, group, act_order=layout == "gptq_act_order", seed=seed)
    return Int4Weight.from_gptq(t["qweight"], t["qzeros"], t["scales"].float(), t["g_idx"]), ref
