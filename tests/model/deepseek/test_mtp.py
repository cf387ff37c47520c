"""DeepSeek-V3, V3.2, GLM-4.5 and GLM-5 with the MTP layer their checkpoints ship (the family's own
block: MLA + MoE with a latent cache, plus the sparse-attention indexer for V3.2 / GLM-5 with top-k
8 < context, so the target and the MTP layer each select, and GLM-5's layer 1 reuses layer 0's
selection: a selection surviving from another step or from the MTP layer would break equality;
GQA + MoE): greedy with MTP equals greedy without for K = 1..3 at PP = 1, 2
and 3; the echo checkpoint's drafts are mostly accepted, and a layer wired to the wrong half of the
concat is not."""
from __future__ import annotations

import pytest
import torch

from pipespec import LLM, SamplingParams
from tests.conftest import assert_engine_clean
from tests.model.deepseek import tiny

KWARGS = dict(dtype="float32", device="cpu", max_model_len=128, block_size=16, num_kv_blocks=64,
              max_num_seqs=8, max_num_batched_tokens=24)
LENGTHS, MAX_TOKENS = (1, 4, 9, 30), (12, 5, 10, 12)


# (shape, pick): the DeepSeek-V3 and GLM-4.5 echo checkpoints, and a miswired DeepSeek-V3 one
CHECKPOINTS = (("lora_yarn", "embedding"), ("glm", "embedding"), ("v32", "embedding"), ("glm5", "embedding"),
               ("lora_yarn", "hidden"))
# at the default echo strength the tiny GLM's drafts agree less (35% over K = 3, measured; its
# target's next token depends more on the context); a weaker mix keeps them mostly right
ECHO = {"glm": dict(mixing=0.03, mtp_mixing=0.01), "v32": dict(index_topk=8, index_n_heads=16),
        "glm5": dict(index_topk=8, index_n_heads=16)}
CACHE_ENTRY = {"lora_yarn": (1, 32 + 8), "glm": (2, 32), "v32": (1, 32 + 8 + 16), "glm5": (1, 32 + 8 + 16)}


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tokenizer):
    root = tmp_path_factory.mktemp("deepseek-mtp")
    return {(shape, pick): str(tiny.write_with_mtp(root / f"{shape}-{pick}", shape, seed=31, tokenizer=tokenizer,
                                                   pick=pick, **ECHO.get(shape, {})))
            for shape, pick in CHECKPOINTS}


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(5)
    return [{"prompt_token_ids": torch.randint(3, tiny.VOCAB, (n,), generator=g).tolist()} for n in LENGTHS]


def _generate(llm, prompts):
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def reference(folders, prompts):
    out = {}
    for key, folder in folders.items():
        with LLM(model=folder, **KWARGS) as llm:
            out[key] = _generate(llm, prompts)
    return out


def _run(folder, shape, prompts, pp, k):
    spec = {"method": "mtp", "num_speculative_tokens": k}
    with LLM(model=folder, pipeline_parallel_size=pp, speculative_config=spec, **KWARGS) as llm:
        if pp == 1:
            from pipespec.model.mtp.deepseek_native import NativeDeepSeekMTP
            layers = llm.engine.executor.stage.drafter.layers
            assert [type(layer) for layer in layers] == [NativeDeepSeekMTP]
            assert type(layers[0].block.mlp).__name__ == "MoE"
            assert tuple(llm.engine.executor.stage.drafter.kv_caches[0].key.shape[1:]) == CACHE_ENTRY[shape]
        got = _generate(llm, prompts)
        stats = llm.stats()["spec_decode"]
        assert_engine_clean(llm)
    return got, stats


# every (PP, K) for DeepSeek-V3; the others share the drafting path, so a diagonal covers their blocks
CASES = ([("lora_yarn", pp, k) for pp in (1, 2, 3) for k in (1, 2, 3)]
         + [("glm", 1, 2), ("glm", 2, 3), ("glm", 3, 1), ("v32", 1, 3), ("v32", 2, 2), ("v32", 3, 3),
            ("glm5", 1, 2), ("glm5", 2, 3), ("glm5", 3, 3)])


@pytest.mark.parametrize("shape,pp,k", CASES)
def test_greedy_lossless_with_the_checkpoints_mtp_layer(shape, pp, k, folders, prompts, reference):
    key = (shape, "embedding")
    got, stats = _run(folders[key], shape, prompts, pp, k)
    assert got == reference[key]
    assert 0.4 < stats["draft_acceptance_rate"] <= 1.0, stats


def test_miswired_mtp_layer_drafts_badly(folders, prompts, reference):
    key = ("lora_yarn", "hidden")
    got, stats = _run(folders[key], "lora_yarn", prompts, 1, 2)
    assert got == reference[key]
    assert stats["draft_acceptance_rate"] < 0.2, stats


@pytest.mark.parametrize("shape", ["lora_yarn", "glm", "v32"])
def test_async_scheduling_continues_verify_steps_losslessly(shape, folders, prompts, reference):
    """Steps planned before the verify step ahead returns, their lines moved on by the drafts it
    accepts on the device: the latent cache, GLM's GQA cache and V3.2's indexer keys land where they
    belong (greedy output is plain decoding's)."""
    key = (shape, "embedding")
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    with LLM(model=folders[key], async_scheduling=True, speculative_config=spec, **KWARGS) as llm:
        got = _generate(llm, prompts)
        stats = llm.stats()
        assert_engine_clean(llm)
    assert got == reference[key]
    assert stats["num_carried_rows"] > 0 and stats["spec_decode"]["num_accepted_tokens"] > 0, stats
