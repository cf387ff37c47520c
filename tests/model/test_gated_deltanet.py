"""The Gated DeltaNet reference: its recurrence equals transformers' chunked gated delta rule (GQA
heads, an initial state); and a verify step's candidate states are exactly the states of running the
accepted rows alone, so committing the one the plan names continues as if nothing was rejected."""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from pipespec.model.gated_deltanet import GatedDeltaNet, gated_delta_rule, l2_normalize
from pipespec.model.linear_state import LinearFlags, LinearMeta, allocate_states
from pipespec.model.hybrid_config import HybridConfig

CFG = HybridConfig(layer_types=("linear_attention",), linear_num_key_heads=2, linear_num_value_heads=4,
                   linear_key_head_dim=8, linear_value_head_dim=6, conv_kernel=4, partial_rotary_factor=0.25,
                   fused_linear_proj=False)


def test_recurrence_equals_transformers_chunked_rule():
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule
    # its PyTorch rule itself: where fla-core is installed transformers dispatches to fla's GPU kernel
    torch_chunk_gated_delta_rule = getattr(torch_chunk_gated_delta_rule, "__wrapped__", torch_chunk_gated_delta_rule)
    g = torch.Generator().manual_seed(0)
    b, L, hk, hv, dk, dv = 2, 37, 2, 4, 8, 6
    q, k = (torch.randn(b, L, hk, dk, generator=g) for _ in range(2))
    v = torch.randn(b, L, hv, dv, generator=g)
    decay = -torch.rand(b, L, hv, generator=g)
    beta = torch.rand(b, L, hv, generator=g)
    state = torch.randn(b, hv, dk, dv, generator=g) * 0.1
    # q and k spread over the value heads first (transformers' later versions do it inside)
    qv, kv = (x.repeat_interleave(hv // hk, dim=2) for x in (q, k))
    ref, ref_state = torch_chunk_gated_delta_rule(qv, kv, v, g=decay, beta=beta, initial_state=state.clone(),
                                                  output_final_state=True, use_qk_l2norm_in_kernel=True)
    qn = (l2_normalize(q) * dk ** -0.5).repeat_interleave(hv // hk, dim=2)
    kn = l2_normalize(k).repeat_interleave(hv // hk, dim=2)
    out, final, _ = gated_delta_rule(qn, kn, v, decay, beta, state, torch.ones(b, L, dtype=torch.bool))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(final, ref_state, atol=1e-5, rtol=1e-4)


def _run(layer, states, x, pos0, slot=0, commit=-1, drafts=0):
    n = x.shape[0]
    commit, drafts = torch.tensor([commit]), torch.tensor([drafts])
    meta = LinearMeta.build(torch.tensor([0, n]), torch.arange(pos0, pos0 + n), torch.tensor([slot]),
                            commit, drafts, states, LinearFlags.of(n, commit, drafts))
    return layer(x, meta, states[0])


@pytest.mark.parametrize("accepted", [0, 1, 2, 3])
@pytest.mark.parametrize("value_dim", [6, 8])     # 8: where Triton runs (GPU, interpreter), the fused kernels
def test_committing_a_candidate_continues_as_if_only_the_accepted_rows_ran(accepted, value_dim):
    torch.manual_seed(1)
    layer = GatedDeltaNet(16, dataclasses.replace(CFG, linear_value_head_dim=value_dim), 1e-6)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.3)
    x = torch.randn(10, 16)
    with torch.inference_mode():
        plain = allocate_states([layer.state_shape()], 2, 4, torch.float32, "cpu")
        ref = _run(layer, plain, x[:5 + accepted + 2], 0)           # every accepted row, then one more
        states = allocate_states([layer.state_shape()], 2, 4, torch.float32, "cpu")
        _run(layer, states, x[:5], 0)                              # prefill
        before = copy.deepcopy(states)
        verify = _run(layer, states, x[5:9], 5, drafts=3)          # 1 + 3 verify rows: candidates only
        assert torch.equal(states[0].rec, before[0].rec) and torch.equal(states[0].conv, before[0].conv)
        torch.testing.assert_close(verify[:accepted + 1], ref[5:5 + accepted + 1])
        nxt = _run(layer, states, x[5 + accepted + 1:5 + accepted + 2], 5 + accepted + 1, commit=accepted)
        torch.testing.assert_close(nxt, ref[-1:])
