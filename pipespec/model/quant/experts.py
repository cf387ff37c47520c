"""Routed MoE experts that stay quantized on the GPU: FP8 (DeepSeek-V3 / GLM-5 FP8 releases) and
int4 (Qwen3.5 AWQ / GPTQ releases).

A model's routed experts are two stacked tensors per MoE layer (gate+up [E * 2I, H], down [E * H, I];
`model/deepseek/moe.py`, `model/moe.py` name them in `expert_stacks`). Loaded dense they would take
twice the FP8 checkpoint's memory, and the experts are most of it (DeepSeek-V3: ~650B of 671B
parameters), so where the kernels serve, `use_quantized_experts` replaces each stack whose checkpoint
tensors are all quantized: by an `Fp8Stack` (the per-expert e4m3 weights and block scales
concatenated, as the checkpoint has them) or an `Int4Stack` (each expert's `Int4Weight`, gate and up
side by side, stacked; act-order experts, whose rows each expert permutes its own way, stay dense).
`routed_experts` then multiplies them:
- FP8 beyond `FEW_FP8_PAIRS` (token, expert) pairs: the grouped tensor-core kernels of
  `kernels/moe_grouped.py`, which read each picked expert once (where its block geometry fits);
- otherwise up to `GEMV_PAIRS` pairs, every decode step and every CUDA graph: the few-pair GEMV
  kernels of `kernels/moe_experts.py`, dequantizing in registers;
- more (prefill chunks, eager): each present expert dequantized in turn and multiplied by its rows
  (a host sync over the expert ids, which eager steps allow).
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from pipespec import kernels
from pipespec.model.quant.packed import Fp8Weight, Int4Weight, concat

logger = logging.getLogger(__name__)

# The GEMV kernels re-read an expert for each pair that picks it (mostly from L2), which a decode
# batch of 512 tokens at top-8 still affords; the dequantizing loop syncs with the host, so it is kept
# for the larger eager steps only, never inside a graph.
GEMV_PAIRS = 4096
# FP8 pairs past which the grouped kernels win: the GEMVs' per-element scaling makes them compute
# bound well before their re-reads matter (RESULTS.md)
FEW_FP8_PAIRS = 32


class Fp8Stack(nn.Module):
    """A stack of experts' FP8 weights: weight e4m3 [E * rows, cols], scale_inv float32 with one
    value per `block` (non-persistent buffers, so they move with the model and count as its memory
    but are never asked of the dense loader)."""

    def __init__(self, packed: Fp8Weight, experts: int):
        super().__init__()
        self.register_buffer("weight", packed.weight, persistent=False)
        self.register_buffer("scale_inv", packed.scale_inv, persistent=False)
        self.block, self.experts = packed.block, experts

    @property
    def shape(self) -> tuple[int, int]:
        """The dense stack's [E * rows, cols]."""
        return tuple(self.weight.shape)

    def expert(self, e: int) -> torch.Tensor:
        """Expert e's dense [rows, cols] float32 weight (its rows need not be whole scale blocks)."""
        rows, cols = self.weight.shape[0] // self.experts, self.weight.shape[1]
        bo, bi = self.block
        first = torch.arange(e * rows, (e + 1) * rows, device=self.weight.device)
        scale = self.scale_inv[first // bo].repeat_interleave(bi, 1)[:, :cols]
        return self.weight[e * rows:(e + 1) * rows].float() * scale


class Int4Stack(nn.Module):
    """A stack of experts' int4 weights in the `Int4Weight` layout: qweight int32 [E, K / 8, N], zeros
    and scales [E, K / group, N] as `Int4Weight.to` keeps them (N: the outputs; non-persistent buffers,
    as `Fp8Stack`)."""

    def __init__(self, experts: list[Int4Weight]):
        super().__init__()
        for part in ("qweight", "zeros", "scales"):
            self.register_buffer(part, torch.stack([getattr(w, part) for w in experts]), persistent=False)
        self.group, self.experts = experts[0].group, len(experts)

    @property
    def shape(self) -> tuple[int, int]:
        """The dense stack's [E * N, K]."""
        return self.experts * self.qweight.shape[2], self.qweight.shape[1] * 8

    def expert(self, e: int) -> torch.Tensor:
        """Expert e's dense [N, K] float32 weight."""
        return Int4Weight(self.qweight[e], self.zeros[e], self.scales[e], self.group).dequantize()


STACKS = (Fp8Stack, Int4Stack)


def quantized_routed_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up, down,
                             first: int | None = None) -> torch.Tensor:
    """`routed_experts` with `Fp8Stack`s or `Int4Stack`s (same arguments otherwise, same rounding)."""
    capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
    if kernels.enabled(x) and isinstance(gate_up, Fp8Stack) and ids.numel() > FEW_FP8_PAIRS:
        from pipespec.kernels import moe_grouped
        if moe_grouped.fits(gate_up, down, x.shape[-1]):
            return moe_grouped.grouped_fp8_experts(x, ids, weights, gate_up, down, first)
    if kernels.enabled(x) and (ids.numel() <= GEMV_PAIRS or capturing):
        from pipespec.kernels.moe_experts import few_pair_experts, few_pair_int4_experts
        run = few_pair_int4_experts if isinstance(gate_up, Int4Stack) else few_pair_experts
        return run(x, ids, weights, gate_up, down, first)
    t, k = ids.shape
    flat = ids.reshape(-1) - (first or 0)
    y = torch.zeros(t * k, x.shape[-1], dtype=x.dtype, device=x.device)
    for e in flat.unique().tolist():                       # eager: the experts this step picked
        if not 0 <= e < gate_up.experts:                   # another rank's: adds nothing here
            continue
        pairs = (flat == e).nonzero().squeeze(1)
        gate, up = (x[pairs // k] @ gate_up.expert(e).to(x.dtype).t()).chunk(2, dim=-1)
        y[pairs] = (F.silu(gate) * up) @ down.expert(e).to(x.dtype).t()
    return (y.view(t, k, -1).float() * weights.reshape(t, k, 1).float()).sum(1).to(x.dtype)


def _moe_modules(model: nn.Module):
    """(name, module) of every module with routed-expert stacks still dense, listed before any is replaced."""
    return [(name, m) for name, m in model.named_modules() if getattr(m, "expert_stacks", ())
            and all(isinstance(getattr(m, s), nn.Parameter) for s in m.expert_stacks)]


def _experts(module: nn.Module) -> int:
    return getattr(module, "local", None) or module.num


def use_quantized_experts(model: nn.Module, source, device: torch.device) -> int:
    """Replace the routed-expert stacks of `model` whose checkpoint tensors are all quantized in
    `source` (a `QuantizedSource`) by `Fp8Stack`s or `Int4Stack`s on `device`, both stacks of a module
    or neither (the kernels take them together); returns how many. Call before the dense load."""
    names = model.checkpoint_names()
    count, kept = 0, []
    for mname, module in _moe_modules(model):
        parts = {s: names.get(f"{mname}.{s}", []) for s in module.expert_stacks}
        if not all(ps and all(source.is_quantized(p) for p in ps) for ps in parts.values()):
            continue
        try:
            stacks = {s: _stack([source.packed(p) for p in ps], _experts(module), device) for s, ps in parts.items()}
        except ValueError as e:               # FP8 experts not of whole scale blocks, act-order int4
            kept.append(f"{mname} ({e})")
            continue
        for s, packed in stacks.items():
            if packed.shape != tuple(getattr(module, s).shape):
                raise ValueError(f"{mname}.{s}: quantized experts of shape {packed.shape}, the model expects "
                                 f"{tuple(getattr(module, s).shape)}")
            _swap(module, s, packed)
            count += 1
    if kept:
        logger.info("quantized experts served dense (dequantized): %s", "; ".join(kept[:3]))
    return count


def _swap(module: nn.Module, stack: str, packed: nn.Module) -> None:
    """The dense stack parameter `stack` of `module` becomes `packed` (no longer asked of the loader)."""
    del module._parameters[stack]
    setattr(module, stack, packed)


def _stack(parts: list, experts: int, device: torch.device) -> nn.Module:
    """One stack of the checkpoint's per-expert parts (in expert order, a fused projection's parts
    side by side)."""
    if isinstance(parts[0], Fp8Weight):
        return Fp8Stack(concat(parts).to(device), experts)
    per = len(parts) // experts
    weights = [concat(parts[e * per:(e + 1) * per]).to(device) for e in range(experts)]
    if any(w.perm is not None for w in weights):
        raise ValueError("act-order int4 experts (each permutes its input rows its own way)")
    return Int4Stack(weights)


@torch.no_grad()
def use_dummy_quantized_experts(model: nn.Module, device: torch.device, seed: int = 0) -> int:
    """`load_format="dummy"` with `quantization="fp8"`: random FP8 expert stacks (128 x 128 blocks,
    weights about N(0, 0.02) like the dense dummy)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    count = 0
    for _, module in _moe_modules(model):
        for stack in module.expert_stacks:
            rows, cols = getattr(module, stack).shape
            w = torch.randn(rows, cols, device=device, generator=gen).to(torch.float8_e4m3fn)
            scale = torch.full((-(-rows // 128), -(-cols // 128)), 0.02, device=device)
            _swap(module, stack, Fp8Stack(Fp8Weight(w, scale, (128, 128)), _experts(module)))
            count += 1
    return count
