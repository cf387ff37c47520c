"""MoE routing in one kernel a token: scores, the choice of its top-k experts and their weights.

Routing is a dozen small PyTorch ops a layer (sigmoid or softmax, the correction bias, group scores,
two or three top-k's, a scatter, a mask, a gather, a sum): at decode each is a kernel of microseconds
inside the step's CUDA graph, and a small-expert MoE model spends more time launching them than
reading its router (RESULTS.md, the MTP families on the GPU). One program a token does all of it in
registers; top-k is k rounds of argmax, which picks the same experts in the same order as
`torch.topk` (largest first) on scores without ties.

The routing rules are the models' own (`model/deepseek/moe.py`'s `Router`, `model/moe.py`'s
`SparseMoE`), which stay the reference and the CPU path.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pipespec.kernels import fused_routing_supported, next_pow2
from pipespec.kernels.launch import cached_launch
from pipespec.kernels.pdl import pdl_args, pdl_signal, pdl_wait


@triton.jit
def _take(scores, chosen, lane, j):
    """Mask out entry j (it has been chosen): chosen -> -inf, and return the score at j."""
    hit = lane == j
    return tl.where(hit, float("-inf"), chosen), tl.sum(tl.where(hit, scores, 0.0), 0)


@cached_launch
@triton.jit
def _route_kernel(logit_ptr, bias_ptr, weight_ptr, id_ptr, stride_t, scale,
                  E: tl.constexpr, TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, N_GROUP: tl.constexpr,
                  TOPK_GROUP: tl.constexpr, SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr,
                  PDL: tl.constexpr):
    pdl_signal(PDL)
    pdl_wait(PDL)
    t = tl.program_id(0)
    lane = tl.arange(0, E)                                   # E: a power of two (checked on the host)
    logit = tl.load(logit_ptr + t * stride_t + lane).to(tl.float32)
    if SIGMOID:
        scores = tl.sigmoid(logit)
    else:
        p = tl.exp(logit - tl.max(logit, 0))
        scores = p / tl.sum(p, 0)
    chosen = scores
    if HAS_BIAS:                                             # the bias picks experts, never weighs them
        chosen = scores + tl.load(bias_ptr + lane).to(tl.float32)
    if N_GROUP > 1:                                          # keep the TOPK_GROUP groups whose best two score most
        G: tl.constexpr = E // N_GROUP
        grouped = tl.reshape(chosen, (N_GROUP, G))
        inner = tl.arange(0, G)
        best = tl.max(grouped, 1)
        second = tl.max(tl.where(inner[None, :] == tl.argmax(grouped, 1)[:, None], float("-inf"), grouped), 1)
        group_score = best + second
        groups = tl.arange(0, N_GROUP)
        keep = groups < 0
        for _ in tl.static_range(TOPK_GROUP):
            g = tl.argmax(group_score, 0)
            keep = keep | (groups == g)
            group_score = tl.where(groups == g, float("-inf"), group_score)
        kept = tl.reshape(keep[:, None] & (inner[None, :] >= 0), (E,))
        chosen = tl.where(kept, chosen, float("-inf"))
    slot = tl.arange(0, BLOCK_K)
    weights = tl.zeros((BLOCK_K,), dtype=tl.float32)
    ids = tl.zeros((BLOCK_K,), dtype=tl.int64)
    for i in tl.static_range(TOP_K):
        j = tl.argmax(chosen, 0)
        chosen, w = _take(scores, chosen, lane, j)
        weights = tl.where(slot == i, w, weights)
        ids = tl.where(slot == i, j.to(tl.int64), ids)
    if NORM:
        weights = weights / (tl.sum(weights, 0) + 1e-20)
    live = slot < TOP_K
    tl.store(weight_ptr + t * TOP_K + slot, weights * scale, mask=live)
    tl.store(id_ptr + t * TOP_K + slot, ids, mask=live)


def route(logits: torch.Tensor, top_k: int, *, sigmoid: bool, bias: torch.Tensor | None = None,
          n_group: int = 1, topk_group: int = 1, normalize: bool = True, scale: float = 1.0):
    """(weights [T, top_k] float32, expert ids [T, top_k] int64) from router logits [T, E].

    sigmoid=True: DeepSeek-V3 / GLM (scores sigmoid(logits), `bias` added to choose only, groups);
    sigmoid=False: softmax scores (Qwen MoE). `normalize`: weights over the chosen sum to 1; then
    times `scale` (DeepSeek's routed_scaling_factor)."""
    tokens, experts = logits.shape
    if not fused_routing_supported(experts, n_group):
        raise ValueError(f"fused routing needs a power-of-two expert count divisible by n_group; got "
                         f"{experts} experts in {n_group} groups")
    logits = logits.contiguous()
    weights = torch.empty(tokens, top_k, device=logits.device, dtype=torch.float32)
    ids = torch.empty(tokens, top_k, device=logits.device, dtype=torch.int64)
    if tokens:
        _route_kernel[(tokens,)](logits, bias if bias is not None else logits, weights, ids, logits.stride(0),
                                 float(scale), E=experts, TOP_K=top_k, BLOCK_K=next_pow2(top_k),
                                 N_GROUP=n_group, TOPK_GROUP=topk_group, SIGMOID=sigmoid,
                                 HAS_BIAS=bias is not None, NORM=normalize, **pdl_args(logits.device))
    return weights, ids
