"""Sparse MoE of Qwen3-Next / Qwen3.5-MoE: softmax router, top-k, renormalised weights, and a shared
expert scaled by a sigmoid gate. Expert weights are held stacked ([E * 2I, H] gate+up, [E * H, I]
down) and loaded from per-expert checkpoint tensors (fused 3-D ones are shown per expert by the
weight source); they run as grouped GEMMs (`routed_experts`).

With tensor parallelism the routed experts are split across the TP group (E / T per rank; the router
and the shared expert's gate are replicated, so every rank routes alike), the shared expert by its
intermediate size; the partial outputs are summed by one all-reduce."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pipespec import kernels
from pipespec.kernels import fused_routing_supported
from pipespec.model.layers import GatedMLP
from pipespec.model.routed_experts import as_experts, dense_stacks, routed_experts
from pipespec.model.tp_layers import SINGLE, expert_range
from pipespec.parallel import TensorParallel


class Experts(nn.Module):
    expert_stacks = ("gate_up_proj", "down_proj")          # quantized checkpoints keep them packed (quant/experts.py)

    def __init__(self, num: int, hidden: int, inter: int, tp: TensorParallel = SINGLE):
        super().__init__()
        self.first, num = expert_range(num, tp)           # this rank's experts
        self.split = tp.size > 1
        self.num, self.hidden, self.inter = num, hidden, inter
        self.gate_up_proj = nn.Parameter(torch.empty(num * 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(num * hidden, inter))

    def checkpoint_names(self, prefix: str) -> dict[str, list[str]]:
        """prefix: '...mlp.experts'."""
        experts = range(self.first, self.first + self.num)
        names = {f"{prefix}.gate_up_proj": [f"{prefix}.{e}.{p}.weight" for e in experts
                                            for p in ("gate_proj", "up_proj")],
                 f"{prefix}.down_proj": [f"{prefix}.{e}.down_proj.weight" for e in experts]}
        return dense_stacks(self, names)

    def forward(self, x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return routed_experts(x, index, weight, as_experts(self.gate_up_proj, self.num),
                              as_experts(self.down_proj, self.num), self.first if self.split else None)


class SparseMoE(nn.Module):
    def __init__(self, hidden: int, num_experts: int, top_k: int, inter: int, shared_inter: int,
                 norm_topk: bool, tp: TensorParallel = SINGLE):
        super().__init__()
        self.top_k, self.norm_topk, self.tp = top_k, norm_topk, tp
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.experts = Experts(num_experts, hidden, inter, tp)
        self.shared_expert = GatedMLP(hidden, shared_inter, tp, reduce=False,
                                      what="shared_expert_intermediate_size")
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x).float()
        if kernels.enabled(x) and fused_routing_supported(logits.shape[-1]):
            from pipespec.kernels.moe_routing import route     # softmax, top-k and norm in one kernel
            weight, index = route(logits, self.top_k, sigmoid=False, normalize=self.norm_topk)
        else:
            probs = F.softmax(logits, dim=-1)
            weight, index = probs.topk(self.top_k, dim=-1)
            if self.norm_topk:
                weight = weight / weight.sum(-1, keepdim=True)
        out = self.experts(x, index, weight)
        return self.tp.all_reduce(out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x))
