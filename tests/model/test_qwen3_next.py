"""Qwen3.5 (multimodal layout), Qwen3.5-MoE and Qwen3-Next targets: float32 logits equal
transformers' at prefill and at every decode step, in one plan or in chunks; greedy output equals
transformers' greedy for a batch of requests decoding together (state slots per request); and a KV
cache small enough to preempt requests changes nothing (their state slots are freed and restarted).
"""
from __future__ import annotations

import pytest
import torch

from pipespec import LLM, SamplingParams
from pipespec.checkpoint.source import resolve_model
from tests.conftest import assert_engine_clean
from tests.helpers import engine_logits, hf_greedy, hf_logits
from tests.model import hybrid_tiny as ht

TOL = 1e-4
KWARGS = dict(dtype="float32", device="cpu", max_model_len=128, block_size=16, num_kv_blocks=32,
              max_num_seqs=8, max_num_batched_tokens=48)


@pytest.fixture(scope="module")
def hybrid_models(tmp_path_factory, tokenizer):
    root = tmp_path_factory.mktemp("hybrid")
    return {kind: (root / kind, ht.write(root / kind, kind, tokenizer)) for kind in ht.KINDS}


@pytest.fixture(scope="module")
def ids():
    return torch.randint(3, ht.VOCAB, (30,), generator=torch.Generator().manual_seed(1)).tolist()


def test_config_is_read_from_the_nested_text_config(hybrid_models):
    arch = resolve_model(str(hybrid_models["qwen3_5"][0])).arch
    assert arch.model_type == "qwen3_5" and arch.hidden_size == ht.H and arch.num_layers == ht.LAYERS
    assert arch.hybrid.layer_types == tuple(ht.LAYER_TYPES) and arch.hybrid.partial_rotary_factor == 0.25
    assert not arch.hybrid.fused_linear_proj and arch.hybrid.num_experts == 0
    nxt = resolve_model(str(hybrid_models["qwen3_next"][0])).arch.hybrid
    assert nxt.fused_linear_proj and nxt.moe_layers == (0, 2, 3)
    # the top-level flag of the vision-language checkpoint decides tying, as in transformers
    import json

    from pipespec.model.arch import ArchConfig
    cfg = json.loads((hybrid_models["qwen3_5"][0] / "config.json").read_text())
    cfg["tie_word_embeddings"] = True
    assert ArchConfig.from_hf(cfg).tie_word_embeddings


def test_vision_tower_is_not_read(hybrid_models):
    names = resolve_model(str(hybrid_models["qwen3_5"][0])).weights().names()
    assert "model.embed_tokens.weight" in names and not any("visual" in n for n in names)


@pytest.mark.parametrize("kind", ht.KINDS)
def test_logits_match_transformers_at_prefill_and_every_decode_step(kind, hybrid_models, ids):
    folder, hf = hybrid_models[kind]
    ref = hf_logits(hf, ids)
    assert ref.abs().max() > 1.0
    with LLM(model=str(folder), **KWARGS) as llm:
        # whole prompt in one plan; in chunks of 7 (each chunk starts from the states the last left);
        # one token per plan: every step a decode step from the slot's state
        for chunk in (None, 7, 1):
            ours = engine_logits(llm, ids, chunk=chunk)
            diff = (ours - ref).abs().max().item()
            assert diff < TOL, f"{kind} chunk={chunk}: max |logit diff| {diff:.2e}"


@pytest.mark.parametrize("kind", ht.KINDS)
def test_batched_greedy_equals_transformers_and_preemption_changes_nothing(kind, hybrid_models):
    folder, hf = hybrid_models[kind]
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, ht.VOCAB, (n,), generator=g).tolist() for n in (5, 23, 11, 40)]
    expected = [hf_greedy(hf, p, 10) for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    # 5 blocks of 16 for requests needing 1-4 each: the scheduler must preempt and recompute; and
    # async scheduling, whose steps ahead read and write the state slots before the last returned
    for kv_blocks, overlap in ((32, False), (5, False), (5, True)):
        with LLM(model=str(folder), **dict(KWARGS, num_kv_blocks=kv_blocks, max_model_len=64,
                                            max_num_batched_tokens=16, async_scheduling=overlap)) as llm:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            preempted = llm.engine.scheduler.num_preemptions
            assert (llm.engine.scheduler.num_carried_rows > 0) == overlap
            assert_engine_clean(llm)
            assert llm.engine.scheduler.state_slots.num_free == KWARGS["max_num_seqs"]
        assert [o.outputs[0].token_ids for o in outs] == expected, f"{kind} kv_blocks={kv_blocks} async={overlap}"
        assert (preempted > 0) == (kv_blocks == 5)


def test_fused_3d_expert_tensors_load_like_per_expert_ones(hybrid_models, tmp_path, tokenizer, ids):
    """The same MoE checkpoint with experts stored fused ([E, 2I, H] gate+up, [E, H, I] down, as
    transformers holds them) gives the same logits."""
    import re
    import shutil

    from safetensors.torch import load_file, save_file

    folder, hf = hybrid_models["qwen3_5_moe"]
    fused = tmp_path / "fused"
    shutil.copytree(folder, fused)
    tensors = load_file(str(fused / "model.safetensors"))
    per_expert = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
    groups: dict[str, dict] = {}
    for name in [n for n in tensors if per_expert.match(n)]:
        prefix, e, kind = per_expert.match(name).groups()
        groups.setdefault(prefix, {})[int(e), kind] = tensors.pop(name)
    assert groups
    for prefix, parts in groups.items():
        n = 1 + max(e for e, _ in parts)
        tensors[prefix + ".gate_up_proj"] = torch.stack([torch.cat([parts[e, "gate"], parts[e, "up"]]) for e in range(n)])
        tensors[prefix + ".down_proj"] = torch.stack([parts[e, "down"] for e in range(n)])
    save_file(tensors, str(fused / "model.safetensors"), metadata={"format": "pt"})
    with LLM(model=str(fused), **KWARGS) as llm:
        diff = (engine_logits(llm, ids) - hf_logits(hf, ids)).abs().max().item()
    assert diff < TOL


def test_a_stage_of_linear_attention_layers_only_holds_no_kv_cache(hybrid_models):
    from pipespec.config import EngineConfig
    from pipespec.stage import Stage

    folder = str(hybrid_models["qwen3_5"][0])
    config = EngineConfig.from_kwargs(model=folder, dtype="float32", device="cpu", max_num_seqs=4)
    middle = Stage(resolve_model(folder), config, (2, 3), 64)     # layer 2: linear attention
    assert middle.model.cache_shapes() == [] and len(middle.model.state_shapes()) == 1
    assert middle.available_cache().kv_blocks > 10**9                    # no bound from this stage
    middle.allocate_kv_cache(8)
    assert middle.kv_caches == [] and len(middle.linear_states) == 1
    assert middle.linear_states[0].rec.shape[0] == 4 + 1          # a slot per request it may run, one for padding


def test_tied_qwen3_5_matches_transformers_and_drafts_losslessly_at_pp2(tmp_path, tokenizer, ids):
    """The small real Qwen3.5 models tie the LM head to the embedding (no lm_head tensor); the last of
    two stages then drafts with its tied head copy as the MTP embedding."""
    folder = tmp_path / "tied"
    hf = ht.write(folder, "qwen3_5", tokenizer, num_mtp=1, tied=True)
    prompts = [{"prompt_token_ids": ids[:n]} for n in (7, 30)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with LLM(model=str(folder), **KWARGS) as llm:
        assert llm.engine.arch.tie_word_embeddings
        assert (engine_logits(llm, ids) - hf_logits(hf, ids)).abs().max().item() < TOL
        plain = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    with LLM(model=str(folder), pipeline_parallel_size=2, speculative_config={"method": "mtp", "num_speculative_tokens": 2},
             **KWARGS) as llm:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == plain
