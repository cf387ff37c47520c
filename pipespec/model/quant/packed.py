"""Quantized weights as the GPU kernels read them: `Int4Weight`, one int4 layout whatever the
checkpoint's (AWQ or GPTQ, with or without act-order), repacked once at load; and `Fp8Weight`, the
block-scaled e4m3 layout as the checkpoint has it. Fused projections (q/k/v, gate/up) concatenate
their parts' along the output dim (`concat`), as dense weights do.

The layout (`kernels/quant_matmul.py` reads it):
- `qweight` int32 [K / 8, N]: eight 4-bit values per word along the input dim K, nibble i (low
  first) holding row 8k + i; the GPTQ order, so a tile of K rows reads K / 8 words per column.
- `zeros`, `scales` [K / group, N], fp16 / bf16 / float32: w[k, n] = (q[k, n] - zeros[g, n]) *
  scales[g, n] with g = k // group. Zeros are unpacked (GPTQ's stored-minus-one undone) so the kernel
  does one subtract and one multiply.
- `perm` (GPTQ act-order only): the input rows in group order. The checkpoint's g_idx assigns each
  input row a group out of order; rows sorted by group make every group `group` consecutive rows, so
  the kernel reads x[:, perm] against a weight whose rows are permuted the same way.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pipespec.model.quant.formats import awq_columns, dequant_fp8, gptq_rows, gptq_zeros


SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)     # zeros and scales as the kernels read them


def pack_int4_along_k(q: torch.Tensor) -> torch.Tensor:
    """int [K, N] values in 0..15 -> int32 [K / 8, N], nibble i of word k holding row 8k + i."""
    k, n = q.shape
    if k % 8:
        raise ValueError(f"an int4 weight needs its input size divisible by 8, got {k}")
    parts = q.to(torch.int64).view(k // 8, 8, n) << (4 * torch.arange(8, dtype=torch.int64))[None, :, None]
    words = parts.sum(1)                               # < 2**32: each nibble in its own bits
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


@dataclass
class Int4Weight:
    qweight: torch.Tensor            # int32 [K / 8, N]
    zeros: torch.Tensor              # [K / group, N], whole numbers 0..16 (AWQ: 0..15, GPTQ: stored + 1): the
                                     # tensor-core decode kernel subtracts them exactly in bf16 / fp16
    scales: torch.Tensor             # [K / group, N]
    group: int
    perm: torch.Tensor | None = None  # int64 [K]: x[:, perm] meets the rows (act-order)

    @property
    def shape(self) -> tuple[int, int]:
        """(out, in), as a dense weight's."""
        return self.qweight.shape[1], self.qweight.shape[0] * 8

    def to(self, device: torch.device) -> Int4Weight:
        """On `device` and contiguous (the kernel indexes rows by the full width; a TP shard is a view
        of some columns). Zeros and scales keep a 16-bit checkpoint dtype (AWQ and GPTQ store fp16
        scales; the kernels widen them to float32, so the products are the same): a 128-row group
        then costs 4 bytes a column against 64 of packed weights, where float32 costs 8. Other
        dtypes become float32."""
        dtype = self.scales.dtype if self.scales.dtype in SCALE_DTYPES else torch.float32
        return Int4Weight(self.qweight.to(device).contiguous(), self.zeros.to(device, dtype).contiguous(),
                          self.scales.to(device, dtype).contiguous(), self.group,
                          None if self.perm is None else self.perm.to(device))

    def rows(self, start: int, stop: int) -> Int4Weight:
        """Output rows [start, stop) (a column-parallel shard)."""
        return Int4Weight(self.qweight[:, start:stop], self.zeros[:, start:stop], self.scales[:, start:stop],
                          self.group, self.perm)

    def columns(self, start: int, stop: int) -> Int4Weight:
        """Input columns [start, stop) (a row-parallel shard): whole groups, no act-order."""
        if self.perm is not None or start % self.group or stop % self.group:
            raise ValueError(f"input columns {start}:{stop} are not whole groups of {self.group} in order")
        return Int4Weight(self.qweight[start // 8:stop // 8], self.zeros[start // self.group:stop // self.group],
                          self.scales[start // self.group:stop // self.group], self.group)

    def matmul(self, x: torch.Tensor, gated: bool = False) -> torch.Tensor:
        """gated: x is a fused gate/up row, multiplied as silu(gate) * up (fused at decode)."""
        from pipespec.kernels.quant_matmul import int4_matmul
        return int4_matmul(x, self.qweight, self.zeros, self.scales, self.group, self.perm, gated=gated)

    def dequantize(self) -> torch.Tensor:
        """Dense float32 [out, in] in the checkpoint's input order (the reference)."""
        q = gptq_rows(self.qweight)                                                 # [K, N]
        g = torch.arange(q.shape[0], device=q.device) // self.group
        w = (q.float() - self.zeros.float()[g]) * self.scales.float()[g]
        if self.perm is not None:
            w = torch.empty_like(w).index_copy_(0, self.perm, w)                   # back to input order
        return w.t().contiguous()

    @classmethod
    def from_awq(cls, qweight, qzeros, scales, group: int) -> Int4Weight:
        q, z = awq_columns(qweight), awq_columns(qzeros)          # [K, N], [K / group, N]
        _check_groups(q.shape[0], group, scales)
        return cls(pack_int4_along_k(q), z.to(scales.dtype), scales.clone(), group)

    @classmethod
    def from_gptq(cls, qweight, qzeros, scales, g_idx) -> Int4Weight:
        k = qweight.shape[0] * 8
        groups = scales.shape[0]
        if k % groups:
            raise ValueError(f"GPTQ weight with {k} input rows and {groups} groups: rows do not divide evenly")
        group = k // groups
        z = gptq_zeros(qzeros).to(scales.dtype)
        g = g_idx.long()
        if torch.equal(g, torch.arange(k) // group):
            return cls(qweight.clone(), z, scales.clone(), group)
        perm = torch.argsort(g, stable=True)
        if not torch.equal(g[perm], torch.arange(k) // group):
            raise ValueError(f"GPTQ g_idx does not give every group {group} rows; cannot repack")
        q = gptq_rows(qweight)                                              # [K, N] in input order
        return cls(pack_int4_along_k(q[perm]), z, scales.clone(), group, perm)


@dataclass
class Fp8Weight:
    weight: torch.Tensor             # float8_e4m3fn [out, in]
    scale_inv: torch.Tensor          # float32 [ceil(out / bo), ceil(in / bi)]
    block: tuple[int, int]

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.weight.shape)

    def to(self, device: torch.device) -> Fp8Weight:
        """On `device` and contiguous (a TP shard is a view of some columns)."""
        return Fp8Weight(self.weight.to(device).contiguous(), self.scale_inv.to(device, torch.float32).contiguous(),
                         self.block)

    def rows(self, start: int, stop: int) -> Fp8Weight:
        bo = self.block[0]
        if start % bo or (stop % bo and stop != self.shape[0]):
            raise ValueError(f"output rows {start}:{stop} are not whole {bo}-row scale blocks")
        return Fp8Weight(self.weight[start:stop], self.scale_inv[start // bo:-(-stop // bo)], self.block)

    def columns(self, start: int, stop: int) -> Fp8Weight:
        bi = self.block[1]
        if start % bi or (stop % bi and stop != self.shape[1]):
            raise ValueError(f"input columns {start}:{stop} are not whole {bi}-column scale blocks")
        return Fp8Weight(self.weight[:, start:stop], self.scale_inv[:, start // bi:-(-stop // bi)], self.block)

    def matmul(self, x: torch.Tensor, gated: bool = False) -> torch.Tensor:
        """gated: x is a fused gate/up row, multiplied as silu(gate) * up (fused at decode)."""
        from pipespec.kernels.quant_matmul import fp8_block_matmul
        return fp8_block_matmul(x, self.weight, self.scale_inv, self.block, gated=gated)

    def dequantize(self) -> torch.Tensor:
        return dequant_fp8(self.weight, self.scale_inv, self.block)


def concat(parts: list) -> Int4Weight | Fp8Weight:
    """One weight of the parts' outputs stacked (a fused projection). A ValueError says why parts
    cannot share one kernel call: different groups or act-order permutations, or FP8 parts whose
    output size is not a whole number of scale blocks."""
    first = parts[0]
    if len(parts) == 1:
        return first
    if isinstance(first, Int4Weight):
        if any(not isinstance(p, Int4Weight) or p.group != first.group for p in parts):
            raise ValueError("int4 parts with different group sizes")
        if any((p.perm is None) != (first.perm is None) or (p.perm is not None and not torch.equal(p.perm, first.perm))
               for p in parts):
            raise ValueError("int4 parts with different act-order permutations")
        return Int4Weight(torch.cat([p.qweight for p in parts], 1), torch.cat([p.zeros for p in parts], 1),
                          torch.cat([p.scales for p in parts], 1), first.group, first.perm)
    bo = first.block[0]
    if any(not isinstance(p, Fp8Weight) or p.block != first.block for p in parts) or \
            any(p.shape[0] % bo for p in parts[:-1]):
        raise ValueError(f"fp8 parts whose output sizes are not whole {bo}-row scale blocks")
    return Fp8Weight(torch.cat([p.weight for p in parts]), torch.cat([p.scale_inv for p in parts]), first.block)


def _check_groups(k: int, group: int, scales: torch.Tensor) -> None:
    if group <= 0 or k % group or scales.shape[0] != k // group:
        raise ValueError(f"int4 weight with {k} input rows, group size {group} and {scales.shape[0]} scale rows")
