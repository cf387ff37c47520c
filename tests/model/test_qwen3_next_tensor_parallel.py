"""Qwen3.5 (dense, nested multimodal layout), Qwen3.5-MoE (fused 3-D experts) and Qwen3-Next (fused
q/k/v/z DeltaNet projection, MoE) split over TP = 2 and composed with PP = 2 and their own MTP layer
at K = 2: greedy output equals TP = 1, PP = 1 without speculation. Split: gated-attention heads,
Gated DeltaNet key heads with their value heads (and their conv channels, decay and states), routed
experts, the shared expert's and dense MLPs' intermediate sizes, and the vocabulary. Drafts are
sometimes rejected (mixing 0.2), so candidate-state commits run on every TP rank."""
from __future__ import annotations

import pytest
import torch

from pipespec import LLM, SamplingParams
from tests.model import hybrid_tiny as ht

KWARGS = dict(dtype="float32", device="cpu", max_model_len=128, block_size=16, num_kv_blocks=32,
              max_num_seqs=8, max_num_batched_tokens=24)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(4)
    return [{"prompt_token_ids": torch.randint(3, ht.VOCAB, (n,), generator=g).tolist()} for n in (5, 30, 11)]


def _generate(llm, prompts):
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("kind", ht.KINDS)
def test_tp2_pp2_mtp_k2_equals_tp1_pp1_without_speculation(kind, tmp_path, tokenizer, prompts):
    folder = tmp_path / kind
    ht.write(folder, kind, tokenizer, num_mtp=1)
    ht.make_echo(folder, 0.2, 0.1)
    with LLM(model=str(folder), **KWARGS) as llm:
        expected = _generate(llm, prompts)
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    with LLM(model=str(folder), tensor_parallel_size=2, pipeline_parallel_size=2, speculative_config=spec,
             check_collectives=True, **KWARGS) as llm:
        assert _generate(llm, prompts) == expected
        stats = llm.stats()["spec_decode"]
        assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"], stats
