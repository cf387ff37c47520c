"""Routed MoE experts that stay FP8 on the GPU (DeepSeek-V3 / GLM-5 FP8 releases).

A model's routed experts are two stacked tensors per MoE layer (gate+up [E * 2I, H], down [E * H, I];
`model/deepseek/moe.py`, `model/moe.py` name them in `expert_stacks`). Loaded dense they would take
twice the FP8 checkpoint's memory, and the experts are most of it (DeepSeek-V3: ~650B of 671B
parameters), so where the kernels serve, `use_quantized_experts` replaces each stack whose checkpoint
tensors are all FP8 by an `Fp8Stack`: the per-expert e4m3 weights and block scales concatenated, as
the checkpoint has them. `routed_experts` then multiplies them:
- up to `GEMV_PAIRS` (token, expert) pairs, every decode step and every CUDA graph: the few-pair GEMV
  kernels of `kernels/moe_experts.py`, dequantizing in registers;
- more (prefill chunks, eager): each present expert dequantized in turn and multiplied by its rows
  (a host sync over the expert ids, which eager steps allow).
AWQ and GPTQ experts (Qwen3.5 int4 releases) still load dense: the expert kernels read FP8 only.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from pipespec.model.quant.packed import Fp8Weight, concat

logger = logging.getLogger(__name__)

# The GEMV kernels re-read an expert for each pair that picks it (mostly from L2), which a decode
# batch of 512 tokens at top-8 still affords; the dequantizing loop syncs with the host, so it is kept
# for the larger eager steps only, never inside a graph.
GEMV_PAIRS = 4096


class Fp8Stack(nn.Module):
    """A stack of experts' FP8 weights: weight e4m3 [E * rows, cols], scale_inv float32 with one
    value per `block` (non-persistent buffers, so they move with the model and count as its memory
    but are never asked of the dense loader)."""

    def __init__(self, packed: Fp8Weight, experts: int):
        super().__init__()
        self.register_buffer("weight", packed.weight, persistent=False)
        self.register_buffer("scale_inv", packed.scale_inv, persistent=False)
        self.block, self.experts = packed.block, experts

    def expert(self, e: int) -> torch.Tensor:
        """Expert e's dense [rows, cols] float32 weight (its rows need not be whole scale blocks)."""
        rows, cols = self.weight.shape[0] // self.experts, self.weight.shape[1]
        bo, bi = self.block
        first = torch.arange(e * rows, (e + 1) * rows, device=self.weight.device)
        scale = self.scale_inv[first // bo].repeat_interleave(bi, 1)[:, :cols]
        return self.weight[e * rows:(e + 1) * rows].float() * scale


def fp8_routed_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: Fp8Stack,
                       down: Fp8Stack, first: int | None = None) -> torch.Tensor:
    """`routed_experts` with FP8 stacks (same arguments otherwise, same rounding)."""
    from pipespec import kernels
    capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
    if kernels.enabled(x) and (ids.numel() <= GEMV_PAIRS or capturing):
        from pipespec.kernels.moe_experts import few_pair_experts
        return few_pair_experts(x, ids, weights, gate_up, down, first)
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


def _stacks(model: nn.Module):
    """(module name, module, stack name) of every routed-expert stack, listed before any is replaced."""
    return [(name, m, s) for name, m in model.named_modules() for s in getattr(m, "expert_stacks", ())
            if isinstance(getattr(m, s), nn.Parameter)]


def _experts(module: nn.Module) -> int:
    return getattr(module, "local", None) or module.num


def use_quantized_experts(model: nn.Module, source, device: torch.device) -> int:
    """Replace the routed-expert stacks of `model` whose checkpoint tensors are all FP8 in `source` (a
    `QuantizedSource`) by `Fp8Stack`s on `device`; returns how many. Call before the dense load."""
    if source.config.method != "fp8":
        return 0
    names = model.checkpoint_names()
    count, kept = 0, []
    for mname, module, stack in _stacks(model):
        parts = names.get(f"{mname}.{stack}", [])
        if not parts or not all(source.is_quantized(p) for p in parts):
            continue
        try:
            packed = concat([source.packed(p) for p in parts])
        except ValueError as e:               # per-expert rows that are not whole scale blocks
            kept.append(f"{mname}.{stack} ({e})")
            continue
        param = getattr(module, stack)
        if tuple(packed.shape) != tuple(param.shape):
            raise ValueError(f"{mname}.{stack}: FP8 experts of shape {tuple(packed.shape)}, the model expects "
                             f"{tuple(param.shape)}")
        _replace(module, stack, packed.to(device))
        count += 1
    if kept:
        logger.info("FP8 experts served dense (dequantized): %s", "; ".join(kept[:3]))
    return count


def _replace(module: nn.Module, stack: str, packed: Fp8Weight) -> None:
    del module._parameters[stack]
    setattr(module, stack, Fp8Stack(packed, _experts(module)))


@torch.no_grad()
def use_dummy_quantized_experts(model: nn.Module, device: torch.device, seed: int = 0) -> int:
    """`load_format="dummy"` with `quantization="fp8"`: random FP8 expert stacks (128 x 128 blocks,
    weights about N(0, 0.02) like the dense dummy)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    count = 0
    for _, module, stack in _stacks(model):
        rows, cols = getattr(module, stack).shape
        w = torch.randn(rows, cols, device=device, generator=gen).to(torch.float8_e4m3fn)
        _replace(module, stack, Fp8Weight(w, torch.full((-(-rows // 128), -(-cols // 128)), 0.02, device=device),
                                          (128, 128)))
        count += 1
    return count
