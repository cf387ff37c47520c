"""DeepSeek-V3, V3.2 (index_topk covering the prompt) and GLM-4.5 logits equal transformers' in float32: prefill (for MLA: expanded form),
chunked prefill and one-token decode steps (MLA: absorbed form against the paged latent cache), and
greedy text."""
from __future__ import annotations

import pytest
import torch

from pipespec import LLM, SamplingParams
from tests.helpers import engine_logits, hf_greedy, hf_logits
from tests.model.deepseek import tiny

TOL = 1e-4


@pytest.fixture(scope="module")
def models(tmp_path_factory, tokenizer):
    root = tmp_path_factory.mktemp("deepseek")
    out = {}
    for i, shape in enumerate(tiny.SHAPES):       # DeepSeek-V3 twice, GLM-4.5, DeepSeek-V3.2
        folder, hf = tiny.write_model(root / shape, shape, seed=20 + i, tokenizer=tokenizer)
        llm = LLM(model=str(folder), dtype="float32", device="cpu", max_model_len=128, num_kv_blocks=16,
                  max_num_batched_tokens=64)
        out[shape] = (llm, hf)
    yield out
    for llm, _ in out.values():
        llm.shutdown()


@pytest.fixture(scope="module")
def ids():
    return torch.randint(3, tiny.VOCAB, (40,), generator=torch.Generator().manual_seed(7)).tolist()


@pytest.mark.parametrize("shape", list(tiny.SHAPES))
def test_logits_match_transformers(shape, models, ids):
    llm, hf = models[shape]
    ref = hf_logits(hf, ids)
    assert ref.abs().max() > 1.0, "random weights too small for a meaningful comparison"
    # None: one 40-row prefill (expanded form); 13: chunks of <= 16 rows and 1: decode-sized steps,
    # each attending to latents earlier plans cached (absorbed form)
    for chunk in (None, 13, 1):
        ours = engine_logits(llm, ids, chunk=chunk)
        diff = (ours - ref).abs().max().item()
        assert diff < TOL, f"{shape} chunk={chunk}: max |logit diff| {diff:.2e}"


@pytest.mark.parametrize("shape", list(tiny.SHAPES))
def test_greedy_matches_transformers(shape, models, ids):
    llm, hf = models[shape]
    out = llm.generate({"prompt_token_ids": ids[:12]}, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
                       use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(hf, ids[:12], 20)


@pytest.mark.parametrize("shape", ["v32", "glm"])
def test_async_scheduling_greedy_matches_transformers(shape, models, ids):
    """Steps ahead with carried tokens over MLA's latent cache and the sparse indexer's key cache
    (V3.2), or GQA + MoE (GLM-4.5): a batch's greedy output is transformers' for each prompt."""
    llm, hf = models[shape]
    folder = llm.engine.config.model.model
    prompts = [ids[:12], ids[5:9], ids[20:37]]
    with LLM(model=folder, dtype="float32", device="cpu", max_model_len=128, num_kv_blocks=16,
             max_num_batched_tokens=64, async_scheduling=True) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
        assert llm.engine.stats()["num_carried_rows"] > 0
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 12) for p in prompts]


def test_config_is_read(models):
    model = models["lora_yarn"][0].engine.executor.stage.model
    cfg = model.cfg
    assert cfg.q_lora_rank == 24 and cfg.rope_interleave and cfg.yarn.factor == 4.0
    assert cfg.moe.n_group == 2 and cfg.moe.first_dense == 1 and cfg.moe.num_experts == 8
    assert type(model.model.layers["0"].mlp).__name__ == "GatedMLP"
    assert type(model.model.layers["1"].mlp).__name__ == "MoE"


def test_kv_budget_counts_the_latent(models):
    """Each layer caches kv_lora_rank + qk_rope_head_dim values per token, not per-head K and V."""
    stage = models["lora_yarn"][0].engine.executor.stage
    per_token = (32 + 8) * 4                                     # float32
    assert [tuple(c.key.shape[1:]) for c in stage.kv_caches] == [(1, 40)] * 3
    assert all(c.value.numel() == 0 for c in stage.kv_caches)
    assert stage._bytes_per_block() == 3 * per_token * stage.block_size


@pytest.mark.parametrize("load_format", ["auto", "dummy"])
def test_router_stays_float32_in_a_bf16_engine(tmp_path, tokenizer, load_format):
    """The router's weight and correction bias are kept float32 (its logits are float32, as the
    reference computes them); every other parameter takes the engine's dtype."""
    folder, _ = tiny.write_model(tmp_path / "m", "lora_yarn", seed=5, tokenizer=tokenizer)
    with LLM(model=str(folder), dtype="bfloat16", device="cpu", max_model_len=64, num_kv_blocks=8,
             load_format=load_format) as llm:
        params = dict(llm.engine.executor.stage.model.named_parameters())
        routers = {n: p.dtype for n, p in params.items() if ".mlp.gate." in n}
        assert routers and set(routers.values()) == {torch.float32}
        assert len(routers) == 2 * 2                         # weight and bias of the two MoE layers
        assert {p.dtype for n, p in params.items() if n not in routers} == {torch.bfloat16}
        out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=4, temperature=0.0),
                           use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4
