"""The MTP families on a GPU (float32): Qwen3.5-MoE and Qwen3-Next (Gated DeltaNet states inside
CUDA graphs, fla-core prefill when installed), DeepSeek-V3 dense MLA (the paged Triton kernel,
graphs) and V3.2 sparse attention (the torch backend). Each: logits equal the CPU engine's, greedy
output replayed from CUDA graphs equals eager execution, and MTP at K = 2 changes nothing (GPU only).
"""
from __future__ import annotations

import pytest
import torch

from pipespec import LLM, SamplingParams
from tests.helpers import engine_logits
from tests.model import hybrid_tiny as ht
from tests.model.deepseek import tiny as ds

pytestmark = pytest.mark.gpu

KW = dict(dtype="float32", max_model_len=128, block_size=16, max_num_seqs=8, max_num_batched_tokens=64)
CASES = ("qwen3_5_moe", "qwen3_next", "lora_yarn", "v32")


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tokenizer):
    root = tmp_path_factory.mktemp("families")
    out = {}
    for kind in ("qwen3_5_moe", "qwen3_next"):
        ht.write(root / kind, kind, tokenizer, num_mtp=1)
        out[kind] = str(root / kind)
    for shape in ("lora_yarn", "v32"):
        out[shape] = str(ds.write_with_mtp(root / shape, shape, seed=31, tokenizer=tokenizer))
    return out


def _prompts(vocab):
    g = torch.Generator().manual_seed(3)
    return [{"prompt_token_ids": torch.randint(3, vocab, (n,), generator=g).tolist()} for n in (30, 7, 19)]


def _greedy(llm, prompts, n=24):
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("case", CASES)
def test_gpu_logits_equal_cpu_and_graphs_equal_eager(case, folders):
    vocab = ht.VOCAB if case.startswith("qwen") else ds.VOCAB
    prompts = _prompts(vocab)
    ids = prompts[0]["prompt_token_ids"]
    with LLM(model=folders[case], device="cpu", num_kv_blocks=32, **KW) as cpu:
        want_logits = engine_logits(cpu, ids)
    runs = {}
    for k in (0, 2):
        spec = {"method": "mtp", "num_speculative_tokens": k} if k else None
        for eager in (True, False):
            with LLM(model=folders[case], device="cuda", gpu_memory_utilization=0.2, enforce_eager=eager,
                     speculative_config=spec, **KW) as llm:
                stage = llm.engine.executor.stage
                if k == 0 and eager:
                    torch.testing.assert_close(engine_logits(llm, ids).cpu(), want_logits, atol=2e-4, rtol=2e-4)
                runs[k, eager] = _greedy(llm, prompts)
                if not eager:
                    if case == "v32":      # sparse attention: the torch backend, eager by design
                        assert stage.graphs is None
                    else:
                        assert stage.graphs is not None and stage.graphs.replays > 10
    assert runs[0, False] == runs[0, True]
    assert runs[2, False] == runs[2, True] == runs[0, True]
