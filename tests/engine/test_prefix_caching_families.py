"""Prefix caching in every family with paged attention, at PP = 1, 2 and 3: Llama and Qwen3 (GQA),
MiMo (Qwen2 blocks, its own MTP layer), GLM-4.5 (GQA, MoE), DeepSeek-V3 (MLA: the latent cache is
reused by block id), DeepSeek-V3.2 and GLM-5 (MLA plus the sparse-attention indexer, whose per-token
keys are reused by the same block ids), with the checkpoint's own MTP layer where it ships one
(the hybrid families: test_prefix_caching_hybrid.py). A second round of prompts reuses the first round's prompts and answers;
its greedy output equals a run with the cache off, and the cache was really hit."""
from __future__ import annotations

import pytest
import torch

from pipespec import LLM, SamplingParams
from tests.conftest import assert_engine_clean
from tests.model.deepseek import tiny
from tests.model.mtp import tiny_families as tf

KWARGS = dict(dtype="float32", device="cpu", max_model_len=160, block_size=16, num_kv_blocks=64,
              max_num_seqs=8, max_num_batched_tokens=24)
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tokenizer, tiny_models):
    root = tmp_path_factory.mktemp("prefix-cache-families")
    out = {family: str(tiny_models[family][0]) for family in ("llama", "qwen3")}
    for shape, extra in (("lora_yarn", {}), ("glm", {}), ("v32", dict(index_topk=8)),
                         ("glm5", dict(index_topk=8, index_n_heads=16))):
        out[shape] = str(tiny.write_with_mtp(root / shape, shape, seed=31, tokenizer=tokenizer, **extra))
    out["mimo"] = str(tf.write_checkpoint(root / "mimo", "mimo", tf.echo_tensors("mimo", 1, 11, 0.1, 0.05), 1,
                                          tokenizer))
    return out


@pytest.fixture(scope="module")
def first_round():
    """Three prompts of ids below the tiny DeepSeek vocabulary, sharing 40 tokens."""
    g = torch.Generator().manual_seed(9)
    shared = torch.randint(3, tiny.VOCAB, (40,), generator=g).tolist()
    return [shared + torch.randint(3, tiny.VOCAB, (n,), generator=g).tolist() for n in (3, 11, 20)]


def _two_rounds(llm: LLM, first_round) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    first = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in first_round], params,
                                                           use_tqdm=False)]
    second_round = [p + out + [7, 8, 9] for p, out in zip(first_round, first)] + [first_round[0][:32]]
    second = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in second_round], params,
                                                            use_tqdm=False)]
    return first + second


def _spec(family: str, k: int) -> dict | None:
    return {"method": "mtp", "num_speculative_tokens": k} if k else None


_REFERENCE: dict[str, list] = {}


@pytest.mark.parametrize("family,pp,k", [("llama", 1, 0), ("llama", 3, 0), ("qwen3", 2, 0),
                                         ("lora_yarn", 1, 2), ("lora_yarn", 2, 3), ("lora_yarn", 3, 1),
                                         ("mimo", 2, 2), ("glm", 2, 2), ("v32", 3, 1), ("glm5", 2, 2),
                                         ("glm5", 3, 3)])
def test_cache_on_equals_cache_off(family, pp, k, folders, first_round):
    if family not in _REFERENCE:
        with LLM(model=folders[family], enable_prefix_caching=False, **KWARGS) as llm:
            _REFERENCE[family] = _two_rounds(llm, first_round)
    with LLM(model=folders[family], pipeline_parallel_size=pp, speculative_config=_spec(family, k), **KWARGS) as llm:
        got = _two_rounds(llm, first_round)
        stats = llm.stats()
        assert_engine_clean(llm)
    assert got == _REFERENCE[family]
    # the second round reuses every first-round prompt's whole blocks (and more)
    assert stats["prefix_cache"]["hits"] >= 3 * 32 + 16, stats["prefix_cache"]
    if k:       # drafts both accepted and rejected (a rejected draft's KV sits in blocks the cache keeps)
        spec = stats["spec_decode"]
        assert 0 < spec["num_accepted_tokens"] < spec["num_draft_tokens"], spec
