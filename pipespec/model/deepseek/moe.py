"""DeepSeek-V3 MoE (also GLM-4.5's): a sigmoid router whose correction bias only picks experts,
group-limited top-k, routed experts plus always-on shared experts.

Routed experts live in two stacked parameters, loaded from the per-expert checkpoint tensors
(`mlp.experts.{e}.gate_proj/up_proj/down_proj`) concatenated along dim 0, and run as grouped GEMMs
(`routed_experts`).

With tensor parallelism the routed experts are split across the TP group (each rank loads and runs
its own E / T; the router is replicated, so every rank routes alike) and the shared experts are split
by their intermediate size; the partial outputs of both are summed by one all-reduce.
"""
from __future__ import annotations

import torch
from torch import nn

from pipespec import kernels
from pipespec.kernels import fused_routing_supported
from pipespec.model.deepseek.config import MoEConfig
from pipespec.model.layers import GatedMLP
from pipespec.model.linear import linear
from pipespec.model.routed_experts import as_experts, dense_stacks, routed_experts
from pipespec.model.tp_layers import SINGLE, expert_range
from pipespec.parallel import TensorParallel


class Router(nn.Module):
    # float32 in memory whatever the model's dtype: the logits are computed in float32 (as the
    # reference does), which a bf16 weight would cost a conversion of every step (3 copies a layer)
    float32_params = ("weight", "e_score_correction_bias")

    def __init__(self, hidden: int, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, hidden))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(cfg.num_experts), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] float32, expert ids [T, k])."""
        c = self.cfg
        logits = linear(x, self.weight.float())       # float32 products; .float(): no-op once loaded
        if kernels.enabled(x) and fused_routing_supported(c.num_experts, c.n_group):
            from pipespec.kernels.moe_routing import route     # one kernel for all that follows
            return route(logits, c.top_k, sigmoid=True, bias=self.e_score_correction_bias.float(),
                         n_group=c.n_group, topk_group=c.topk_group, normalize=c.norm_topk_prob,
                         scale=c.routed_scaling_factor)
        scores = logits.sigmoid()
        choice = scores + self.e_score_correction_bias.float()   # the bias picks experts, never weighs them
        if c.n_group > 1:
            grouped = choice.view(-1, c.n_group, c.num_experts // c.n_group)
            group_score = grouped.topk(2, dim=-1).values.sum(-1)          # a group's best two experts
            keep = torch.zeros_like(group_score, dtype=torch.bool)
            keep.scatter_(1, group_score.topk(c.topk_group, dim=-1).indices, True)
            choice = choice.masked_fill(~keep.repeat_interleave(c.num_experts // c.n_group, dim=1), float("-inf"))
        ids = choice.topk(c.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        if c.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * c.routed_scaling_factor, ids


class MoE(nn.Module):
    expert_stacks = ("experts_gate_up", "experts_down")    # quantized checkpoints keep them packed (quant/experts.py)

    def __init__(self, hidden: int, cfg: MoEConfig, tp: TensorParallel = SINGLE):
        super().__init__()
        self.cfg, self.tp = cfg, tp
        self.first, self.local = expert_range(cfg.num_experts, tp)       # this rank's experts
        e, i = self.local, cfg.intermediate_size
        self.gate = Router(hidden, cfg)
        self.experts_gate_up = nn.Parameter(torch.empty(e * 2 * i, hidden))   # per expert: gate rows, up rows
        self.experts_down = nn.Parameter(torch.empty(e * hidden, i))
        self.shared_experts = (GatedMLP(hidden, cfg.num_shared * i, tp, reduce=False,
                                        what="the shared experts' intermediate size") if cfg.num_shared else None)

    def checkpoint_names(self, prefix: str) -> dict[str, list[str]]:
        """Names of this module's stacked parameters (prefix: `model.layers.{l}.mlp.`)."""
        experts = range(self.first, self.first + self.local)
        names = {prefix + "experts_gate_up": [f"{prefix}experts.{e}.{p}.weight" for e in experts
                                              for p in ("gate_proj", "up_proj")],
                 prefix + "experts_down": [f"{prefix}experts.{e}.down_proj.weight" for e in experts]}
        return dense_stacks(self, names)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = routed_experts(x, ids, weights, as_experts(self.experts_gate_up, self.local),
                             as_experts(self.experts_down, self.local), self.first if self.tp.size > 1 else None,
                             shared=self.shared_experts)
        return self.tp.all_reduce(out)
