"""The fused MoE routing kernel against the models' own PyTorch routing (DeepSeek-V3 / GLM sigmoid
with correction bias and group-limited top-k; Qwen softmax): the same experts in the same order, the
same weights. On a GPU; on CPU under the Triton interpreter (TRITON_INTERPRET=1 with triton)."""
from __future__ import annotations


import pytest
import torch

from pipespec.kernels import fused_routing_supported
from tests.kernels import DEVICE, ON_KERNELS

pytestmark = ON_KERNELS


def _router(experts, top_k, n_group, topk_group, norm, scale, seed):
    from pipespec.model.deepseek.config import MoEConfig
    from pipespec.model.deepseek.moe import Router
    cfg = MoEConfig(num_experts=experts, top_k=top_k, intermediate_size=8, num_shared=1, n_group=n_group,
                    topk_group=topk_group, norm_topk_prob=norm, routed_scaling_factor=scale, first_dense=0)
    router = Router(32, cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        router.weight.copy_(torch.randn(experts, 32, generator=g))
        router.e_score_correction_bias.copy_(torch.randn(experts, generator=g) * 0.5)
    return router.to(DEVICE)


@pytest.mark.parametrize("experts,top_k,n_group,topk_group,norm,scale", [
    (256, 8, 8, 4, True, 2.5),        # DeepSeek-V3
    (64, 6, 1, 1, True, 1.0),         # DeepSeek-V2-Lite-like, one group
    (64, 4, 4, 2, False, 1.8),        # groups, unnormalised
])
def test_sigmoid_routing_equals_the_routers_reference(experts, top_k, n_group, topk_group, norm, scale):
    router = _router(experts, top_k, n_group, topk_group, norm, scale, seed=experts + top_k)
    x = torch.randn(19, 32, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    with torch.inference_mode():
        fused_w, fused_ids = router(x)                       # the kernel (inference mode, Triton)
    want_w, want_ids = router(x)                             # outside inference mode: the PyTorch rules
    assert torch.equal(fused_ids, want_ids)
    torch.testing.assert_close(fused_w, want_w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("norm", [True, False])
def test_softmax_routing_equals_softmax_topk(norm):
    from pipespec.kernels.moe_routing import route
    logits = torch.randn(23, 128, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    weights, ids = route(logits, 10, sigmoid=False, normalize=norm)
    want_w, want_ids = torch.softmax(logits, -1).topk(10, dim=-1)
    if norm:
        want_w = want_w / want_w.sum(-1, keepdim=True)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_w, rtol=1e-5, atol=1e-6)


def test_unsupported_expert_counts_are_named():
    from pipespec.kernels.moe_routing import route
    assert not fused_routing_supported(96) and not fused_routing_supported(64, 3)
    with pytest.raises(ValueError, match="power-of-two expert count"):
        route(torch.zeros(2, 96, device=DEVICE), 2, sigmoid=True)
