"""Dequantizing one linear layer's tensors to a dense [out, in] weight, per checkpoint layout.

Layouts (facts of the published formats):
- fp8: `weight` float8_e4m3fn [out, in]; `weight_scale_inv` float32 [ceil(out / bo), ceil(in / bi)],
  one factor per (bo x bi) block, multiplied in.
- awq (GEMM): `qweight` int32 [in, out / 8] and `qzeros` int32 [in / group, out / 8], eight 4-bit
  values per word along the output dim in the interleaved order 0 2 4 6 1 3 5 7 (nibble i holds
  column ORDER[i]); `scales` [in / group, out]. w = (q - z) * s.
- gptq: `qweight` int32 [in / 8, out], eight 4-bit values per word along the input dim (nibble i is
  row 8k + i); `qzeros` int32 [groups, out / 8] along the output dim, stored minus one; `scales`
  [groups, out]; `g_idx` int32 [in], each input row's group (act-order permutes it). w = (q - (z + 1)) * s.
"""
from __future__ import annotations

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)          # nibble i of a word holds column AWQ_ORDER[i]
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


def _nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 [..., n] -> int64 [..., n, 8]: the eight 4-bit values of each word, low nibble first."""
    return ((words[..., None] >> _SHIFTS) & 0xF).to(torch.int64)


def dequant_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    out, inp = weight.shape
    bo, bi = block
    want = (-(-out // bo), -(-inp // bi))
    if tuple(scale_inv.shape) != want:
        raise ValueError(f"weight_scale_inv of shape {tuple(scale_inv.shape)} for a {out}x{inp} weight with "
                         f"{bo}x{bi} blocks; expected {want}")
    scale = scale_inv.float().repeat_interleave(bo, 0)[:out].repeat_interleave(bi, 1)[:, :inp]
    return weight.float() * scale


def awq_columns(words: torch.Tensor) -> torch.Tensor:
    """int32 [rows, out / 8] -> int64 [rows, out] in column order."""
    nib = _nibbles(words)                                         # [rows, out/8, 8] by nibble
    cols = torch.empty_like(nib)
    cols[..., list(AWQ_ORDER)] = nib                              # nibble i -> column ORDER[i]
    return cols.reshape(words.shape[0], -1)


def gptq_rows(qweight: torch.Tensor) -> torch.Tensor:
    """GPTQ's int32 [in / 8, out] -> int64 [in, out]: row 8k + i from nibble i of word k."""
    return _nibbles(qweight.t()).reshape(qweight.shape[1], -1).t()


def gptq_zeros(qzeros: torch.Tensor) -> torch.Tensor:
    """GPTQ's int32 [groups, out / 8] -> int64 [groups, out], the stored-minus-one undone."""
    return _nibbles(qzeros).reshape(qzeros.shape[0], -1) + 1


def dequant_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    q, z = awq_columns(qweight), awq_columns(qzeros)             # [in, out], [in/group, out]
    rows = torch.arange(q.shape[0]) // group
    w = (q - z[rows]).float() * scales.float()[rows]              # [in, out]
    return w.t().contiguous()


def dequant_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                 g_idx: torch.Tensor) -> torch.Tensor:
    q, z = gptq_rows(qweight), gptq_zeros(qzeros)                # [in, out], [groups, out]
    g = g_idx.long()
    w = (q - z[g]).float() * scales.float()[g]
    return w.t().contiguous()
