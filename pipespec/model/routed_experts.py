"""Routed experts of a sparse MoE as two grouped matrix products, for every MoE family.

The (token, slot) pairs are sorted by expert on the device, each expert's rows are contiguous, and
`torch._grouped_mm` runs every expert's gate-up and down products in one launch each (CUTLASS
grouped GEMMs on Hopper, a loop inside PyTorch on the CPU). On a GPU it takes bf16 only; other
dtypes there (float32 test runs) multiply by each pair's gathered expert weights instead. Nothing reads a count back to the host,
so a step with MoE layers can be captured in a CUDA graph, and the weights are read once per step
whatever the batch. The per-slot outputs are put back in (token, slot) order and summed over the
slots, so the result does not depend on how the experts' rows were ordered.

With tensor parallelism a rank holds experts [first, first + E_local) only (`first` given): pairs
routed to other ranks' experts ride along in its last expert's group (so the groups still cover
every row, as a grouped GEMM may require, with no data-dependent shape) and their outputs are masked
to zero here (their own rank adds them; the caller all-reduces).

A few pairs (decode) take `kernels/moe_experts.py` instead on the GPU: GEMVs with no sort, see
`FEW_PAIRS` below.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pipespec import kernels
from pipespec.model.quant.experts import STACKS, quantized_routed_experts

# At most this many (token, slot) pairs run as per-pair GEMVs (kernels/moe_experts.py). They read an
# expert once per pair that picks it, the grouped GEMMs once per expert picked, so the GEMVs pay
# about pairs / distinct experts (1 at one token: its top-k differ; 32 random pairs over 64 experts:
# 1.2; over 32 experts, top-8: 1.4) and win on rate: they stream close to the memory's bandwidth
# (repeats mostly hit L2: pairs of one expert read a tile together) where the grouped GEMMs at a few
# rows per expert do not, and skip their sort and scatter. They won up to 32 pairs on every shape
# tried and lost at 64 on some (RESULTS.md); routing that repeats experts more than random (similar
# tokens) moves the break-even down, hence 32. A test on host shapes: a captured graph keeps its path.
FEW_PAIRS = 32


def as_experts(stack, experts: int):
    """A module's stacked expert parameter [E * rows, cols] as [E, rows, cols]; a quantized stack
    (`model/quant/experts.py`) as it is."""
    return stack if isinstance(stack, STACKS) else stack.view(experts, -1, stack.shape[-1])


def dense_stacks(module, names: dict[str, list[str]]) -> dict[str, list[str]]:
    """A MoE module's stack names (full parameter name -> checkpoint tensors) without the stacks kept
    quantized (`model/quant/experts.py`), which the dense loader must not fill."""
    return {k: v for k, v in names.items() if not isinstance(getattr(module, k.rpartition(".")[2]), STACKS)}


def routed_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                   down: torch.Tensor, first: int | None = None, shared: nn.Module | None = None) -> torch.Tensor:
    """sum over slots j of weights[t, j] * expert_{ids[t, j]}(x[t]).

    x [T, H]; ids [T, k] int64; weights [T, k]; gate_up [E, 2I, H] (per expert: gate rows, then up
    rows); down [E, H, I] (or both quantized stacks, `as_experts`). Returns [T, H] in x's dtype. `first`:
    the global id of gate_up's first expert when this rank holds only some (pairs routed elsewhere
    contribute nothing). `shared`: the shared experts (a `GatedMLP`), whose output is added; the
    few-pair kernels run one shaped like a routed expert as one more pair a token, and add any other's."""
    t, k = ids.shape
    if isinstance(gate_up, STACKS):                       # experts kept quantized (model/quant/experts.py)
        return _plus(quantized_routed_experts(x, ids, weights, gate_up, down, first), shared, x)
    if kernels.enabled(x) and t * k <= FEW_PAIRS and gate_up.is_contiguous() and down.is_contiguous():
        from pipespec.kernels.moe_experts import few_pair_experts, shared_fits
        mlp = None if shared is None else (getattr(shared.gate_up_proj, "weight", None),
                                           getattr(shared.down_proj, "weight", None))
        if shared_fits(mlp, gate_up, down):
            return few_pair_experts(x, ids, weights, gate_up, down, first, shared=mlp)
        return few_pair_experts(x, ids, weights, gate_up, down, first, None if shared is None else shared(x))
    e = gate_up.shape[0]
    flat = ids.reshape(-1)
    mine = None
    if first is not None:                                 # another rank's experts: into the last group
        flat = flat - first
        mine = (flat >= 0) & (flat < e)
        flat = torch.where(mine, flat, torch.full_like(flat, e - 1))
    order = flat.argsort(stable=True)                     # (token, slot) pairs grouped by expert
    counts = torch.zeros(e, dtype=torch.int32, device=x.device)
    counts.index_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    ends = counts.cumsum(0, dtype=torch.int32)            # end row of each expert's group
    rows = x[order // k]
    if x.is_cuda and x.dtype != torch.bfloat16:
        experts = flat[order]
        gate, up = torch.bmm(gate_up[experts], rows[:, :, None]).squeeze(-1).chunk(2, dim=-1)
        y = torch.bmm(down[experts], (F.silu(gate) * up)[:, :, None]).squeeze(-1)
    else:
        gate, up = torch._grouped_mm(rows, gate_up.transpose(-1, -2), offs=ends).chunk(2, dim=-1)
        y = torch._grouped_mm(F.silu(gate) * up, down.transpose(-1, -2), offs=ends)
    if mine is not None:                                  # other ranks' pairs add nothing here
        y = torch.where(mine[order][:, None], y, torch.zeros((), dtype=y.dtype, device=y.device))
    per_slot = torch.empty_like(y)
    per_slot[order] = y                                   # back to (token, slot) order
    w = weights.reshape(t, k, 1).float()
    return _plus((per_slot.view(t, k, -1).float() * w).sum(1).to(x.dtype), shared, x)


def _plus(y: torch.Tensor, shared: nn.Module | None, x: torch.Tensor) -> torch.Tensor:
    return y if shared is None else y + shared(x)
