"""Tensor parallelism on two GPUs over NCCL, CUDA graphs on (float32): greedy output at TP = 2 with
the family's own MTP layer at K = 2 equals TP = 1 without speculation, the driver's steps replay
graphs (the all-reduces and the vocabulary gather are captured in them), and the TP = 2 graphs
equal TP = 2 eager. One tiny checkpoint per family: Llama (dense GQA, with a DeepSeek-style head),
Qwen3-Next (Gated DeltaNet states, MoE) and DeepSeek-V3 (MLA over the paged Triton kernel, MoE).
"""
from __future__ import annotations

import pytest
import torch

from pipespec import LLM, SamplingParams
from tests.model import hybrid_tiny as ht
from tests.model.deepseek import tiny as ds

pytestmark = pytest.mark.gpu(devices=2)

KW = dict(dtype="float32", device="cuda", distributed_backend="nccl", gpu_memory_utilization=0.2,
          max_model_len=128, block_size=16, max_num_seqs=8, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def cases(tmp_path_factory, tokenizer, tiny_llama_head):
    """{family: (folder, head or None, vocabulary)}"""
    root = tmp_path_factory.mktemp("tp-cuda")
    folder, head = tiny_llama_head
    ht.write(root / "qwen3_next", "qwen3_next", tokenizer, num_mtp=1)
    ht.make_echo(root / "qwen3_next", 0.2, 0.1)      # drafts sometimes right: commits run on both ranks
    v3 = ds.write_with_mtp(root / "lora_yarn", "lora_yarn", seed=31, tokenizer=tokenizer)
    return {"llama": (str(folder), str(head), 40000), "qwen3_next": (str(root / "qwen3_next"), None, ht.VOCAB),
            "deepseek_v3": (str(v3), None, ds.VOCAB)}


def _greedy(llm, vocab):
    g = torch.Generator().manual_seed(5)
    prompts = [{"prompt_token_ids": torch.randint(3, vocab, (n,), generator=g).tolist()} for n in (30, 1, 9)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("family", ["llama", "qwen3_next", "deepseek_v3"])
def test_tp2_graphs_with_mtp_equal_tp1(cases, family):
    folder, head, vocab = cases[family]
    with LLM(model=folder, **KW) as llm:
        expected = _greedy(llm, vocab)
    spec = {"method": "mtp", "num_speculative_tokens": 2, **({"model": head} if head else {})}
    runs = {}
    for eager in (False, True):
        with LLM(model=folder, tensor_parallel_size=2, speculative_config=spec, enforce_eager=eager, **KW) as llm:
            assert len(llm.engine.executor.worker_pids) == 1
            runs[eager] = _greedy(llm, vocab)
            graphs = llm.engine.executor.stage.graphs
            if not eager:
                assert graphs is not None and graphs.replays > 0, "TP = 2 decode steps did not replay graphs"
            assert llm.stats()["spec_decode"]["num_draft_tokens"] > 0
    assert runs[True] == expected
    assert runs[False] == expected
