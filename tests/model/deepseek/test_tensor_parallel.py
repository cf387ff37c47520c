"""DeepSeek-V3 (MLA with q LoRA + group-limited MoE with shared experts), DeepSeek-V3.2 (the sparse-
attention indexer, replicated) and GLM-4.5 (GQA + MoE) split over TP = 2, composed with PP = 2 and
their own MTP layer at K = 2: greedy output equals TP = 1, PP = 1 without speculation. Heads, routed
experts (4 of 8 per rank), shared and dense intermediate sizes and the vocabulary are split."""
from __future__ import annotations

import pytest
import torch

from pipespec import LLM, SamplingParams
from tests.model.deepseek import tiny

KWARGS = dict(dtype="float32", device="cpu", max_model_len=128, block_size=16, num_kv_blocks=64,
              max_num_seqs=8, max_num_batched_tokens=24)
LENGTHS = (1, 4, 30)
ECHO = {"glm": dict(mixing=0.03, mtp_mixing=0.01), "v32": dict(index_topk=8, index_n_heads=16)}


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(9)
    return [{"prompt_token_ids": torch.randint(3, tiny.VOCAB, (n,), generator=g).tolist()} for n in LENGTHS]


def _generate(llm, prompts):
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("shape", ["lora_yarn", "glm", "v32"])
def test_tp2_pp2_mtp_k2_equals_tp1_pp1_without_speculation(shape, tmp_path, tokenizer, prompts):
    folder = str(tiny.write_with_mtp(tmp_path / shape, shape, seed=31, tokenizer=tokenizer, **ECHO.get(shape, {})))
    with LLM(model=folder, **KWARGS) as llm:
        expected = _generate(llm, prompts)
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    with LLM(model=folder, tensor_parallel_size=2, pipeline_parallel_size=2, speculative_config=spec,
             check_collectives=True, **KWARGS) as llm:
        assert _generate(llm, prompts) == expected
        stats = llm.stats()["spec_decode"]
        assert stats["num_accepted_tokens"] > 0, stats
