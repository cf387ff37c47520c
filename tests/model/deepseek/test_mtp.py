"""DeepSeek-V3 with the MTP layer its checkpoint ships (MLA + MoE block, latent cache): greedy with
MTP equals greedy without for K = 1..3 at PP = 1, 2 and 3; the echo checkpoint's drafts are mostly
accepted, and a layer wired to the wrong half of the concat is not."""
from __future__ import annotations

import pytest
import torch

from pipespec import LLM, SamplingParams
from tests.conftest import assert_engine_clean
from tests.model.deepseek import tiny

KWARGS = dict(dtype="float32", device="cpu", max_model_len=128, block_size=16, num_kv_blocks=64,
              max_num_seqs=8, max_num_batched_tokens=24)
LENGTHS, MAX_TOKENS = (1, 4, 9, 30), (12, 5, 10, 12)


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tokenizer):
    root = tmp_path_factory.mktemp("deepseek-mtp")
    return {pick: str(tiny.write_with_mtp(root / pick, "lora_yarn", seed=31, tokenizer=tokenizer, pick=pick))
            for pick in ("embedding", "hidden")}


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(5)
    return [{"prompt_token_ids": torch.randint(3, tiny.VOCAB, (n,), generator=g).tolist()} for n in LENGTHS]


def _generate(llm, prompts):
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def reference(folders, prompts):
    with LLM(model=folders["embedding"], **KWARGS) as llm:
        return _generate(llm, prompts)


def _run(folder, prompts, pp, k):
    spec = {"method": "mtp", "num_speculative_tokens": k}
    with LLM(model=folder, pipeline_parallel_size=pp, speculative_config=spec, **KWARGS) as llm:
        if pp == 1:
            from pipespec.model.mtp.deepseek_native import NativeDeepSeekMTP
            layers = llm.engine.executor.stage.drafter.layers
            assert [type(layer) for layer in layers] == [NativeDeepSeekMTP]
            assert type(layers[0].block.mlp).__name__ == "MoE"
            assert tuple(llm.engine.executor.stage.drafter.kv_caches[0].key.shape[1:]) == (1, 32 + 8)
        got = _generate(llm, prompts)
        stats = llm.stats()["spec_decode"]
        assert_engine_clean(llm)
    return got, stats


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("pp", [1, 2, 3])
def test_greedy_lossless_with_the_checkpoints_mtp_layer(pp, k, folders, prompts, reference):
    got, stats = _run(folders["embedding"], prompts, pp, k)
    assert got == reference
    assert 0.4 < stats["draft_acceptance_rate"] <= 1.0, stats


def test_miswired_mtp_layer_drafts_badly(folders, prompts):
    got, stats = _run(folders["hidden"], prompts, 1, 2)
    assert got == _generate_ref(folders["hidden"], prompts)
    assert stats["draft_acceptance_rate"] < 0.2, stats


def _generate_ref(folder, prompts):
    with LLM(model=folder, **KWARGS) as llm:
        return _generate(llm, prompts)
