"""The product of a dense linear layer, y = x @ W.T (+ b), on the path that serves it fastest.

Decode rows on the GPU (at most `gemv.dense_gemv_rows(weight)` of them: 2, or 4 for a small weight;
weight and input of one dtype) take the CUDA-core GEMV kernel (`kernels/gemv.py`), which streams a
small projection's weight closer to the memory bandwidth than cuBLAS does at one row; fewer than
`CPU_PRODUCT_ROWS` rows on the CPU take `weight_times_rows`; everything else (prefill, training) is
`F.linear`. With `gated`, x is a fused gate/up row cat[gate, up]
and the product is of silu(gate) * up: the decode kernel fuses the activation, the other paths
apply it first.
`Linear` is an `nn.Linear` whose product takes this path (a replicated projection: MLA's latent
projections, Gated DeltaNet's input projection, an MTP layer's input projection).
"""
from __future__ import annotations

import torch
from torch import nn

from pipespec import kernels


def _decode_gemv(x: torch.Tensor, weight: torch.Tensor, widen: bool) -> bool:
    if not (kernels.enabled(x) and (x.dtype == weight.dtype or widen) and weight.is_contiguous()):
        return False
    from pipespec.kernels.gemv import dense_gemv_rows
    return x.numel() <= dense_gemv_rows(weight) * x.shape[-1]


def _cpu_rows_product(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a CPU product takes `weight_times_rows`: a row-major weight of x's dtype and fewer
    than CPU_PRODUCT_ROWS rows, but not one row on one thread, where F.linear's matrix-vector path
    is the faster one (RESULTS.md)."""
    rows = x.numel() // max(x.shape[-1], 1)
    return (rows < CPU_PRODUCT_ROWS and weight.dim() == 2 and weight.stride(1) == 1 and x.dtype == weight.dtype
            and (rows > 1 or torch.get_num_threads() > 1))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           gated: bool = False) -> torch.Tensor:
    """x [..., K] (gated: [..., 2K]) @ weight [N, K].T + bias -> [..., N]. A float32 weight with a
    narrower x (a router kept float32) multiplies in float32 and returns float32: the decode kernel
    widens x as it loads it, so no converted copy of x is made (a launch a layer)."""
    widen = weight.dtype == torch.float32 and x.dtype != torch.float32 and not gated
    if x.numel() and _decode_gemv(x, weight, widen):
        from pipespec.kernels.gemv import rowmajor_gemv
        lead = x.shape[:-1]
        y = rowmajor_gemv(x.reshape(-1, x.shape[-1]), weight, gated=gated,
                          out_dtype=weight.dtype).view(*lead, weight.shape[0])
        return y if bias is None else y + bias
    if gated:
        x = silu_mul(x)
    if x.device.type == "cpu" and _cpu_rows_product(x, weight):
        lead = x.shape[:-1]                  # (contiguous: the next op reads rows)
        y = weight_times_rows(x.reshape(-1, x.shape[-1]), weight).contiguous().view(*lead, weight.shape[0])
        return y if bias is None else y + bias
    return nn.functional.linear(x.float() if widen else x, weight, bias)


CPU_PRODUCT_ROWS = 64      # from here on (prefill) F.linear is as fast and its output needs no copy


def weight_times_rows(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T on CPU for a row-major weight, computed as weight @ x.T, a
    transposed [M, N] view: MKL runs that form faster than F.linear's for a few rows (a batch, or a
    verify step's 1 + K rows); one row is padded to two, since one row alone takes a slower
    matrix-vector path on several threads (RESULTS.md has the figures)."""
    if not x.shape[0]:
        return x.new_empty(0, weight.shape[0])
    rows = x if x.shape[0] > 1 else x.expand(2, -1).contiguous()   # a real second row: BLAS needs it
    return (weight @ rows.t()).t()[:x.shape[0]]


class Linear(nn.Linear):
    """`nn.Linear` (same parameters, same checkpoint names) through `linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = cat[gate, up] along the last dim (the fused kernel on the GPU)."""
    if kernels.enabled(gate_up):
        from pipespec.kernels.fused_ops import silu_mul as fused
        return fused(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return nn.functional.silu(gate) * up
