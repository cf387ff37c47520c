"""The stage invariants of docs/architecture.md, each checked so that it fails when broken.

- I1: a stage keeps nothing derived from earlier steps but its KV cache: a fresh stage given a copy
  of that cache produces the same next result, and nothing else a stage holds changes as it steps.
- I4: stage 0 embeds exactly the draft ids the last stage verifies, traced per step across PP = 3.
"""
from __future__ import annotations

import torch

from pipespec import LLM, SamplingParams
from pipespec.config import EngineConfig
from pipespec.engine.scheduler import Scheduler
from pipespec.checkpoint.source import resolve_model
from pipespec.plan import StepResult
from pipespec.runtime.symmetry import compare_draft_traces
from pipespec.stage import Stage
from tests.helpers import make_request

K, MAX_LEN, BLOCKS = 2, 64, 8


def _config(folder, head) -> EngineConfig:
    return EngineConfig.from_kwargs(model=str(folder), dtype="float32", device="cpu", num_kv_blocks=BLOCKS,
                                    max_model_len=MAX_LEN, max_num_batched_tokens=8,
                                    speculative_config={"method": "mtp", "num_speculative_tokens": K,
                                                        "model": str(head)})


def _stage(folder, head) -> Stage:
    source = resolve_model(str(folder))
    stage = Stage(source, _config(folder, head), (0, source.arch.num_layers), MAX_LEN)
    stage.allocate_kv_cache(BLOCKS)
    return stage


def _held_state(stage: Stage) -> dict[str, torch.Tensor]:
    """Every tensor the stage holds but its KV caches: weights, buffers, and tensors kept as attributes."""
    out = {}
    for i, module in enumerate(stage.modules_with_weights()):
        for name, t in list(module.named_parameters()) + list(module.named_buffers()):
            out[f"{i}.{name}"] = t.detach().clone()
    for owner in (stage, stage.drafter):
        for name, value in vars(owner).items():
            if isinstance(value, torch.Tensor):
                out[f"{type(owner).__name__}.{name}"] = value.clone()
    return out


def _apply(sched: Scheduler, batch, data: torch.Tensor) -> None:
    """What the driver does with a result: accept tokens, keep the drafts (engine/llm_engine.py)."""
    result = StepResult(batch.plan.step_id, data, K)
    sched.complete(batch, result)
    for row, req in enumerate(batch.requests):
        req.token_ids += result.tokens(row)
        req.draft_ids = result.drafts(row)


def test_i1_a_fresh_stage_with_the_same_kv_cache_gives_the_same_step(tiny_llama_head):
    folder, head = tiny_llama_head
    stage = _stage(folder, head)
    config = stage.config
    sched = Scheduler(config.scheduler, config.cache.block_size, BLOCKS, MAX_LEN, num_spec_tokens=K)
    sched.add(make_request("a", [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], max_tokens=30))   # two chunks
    sched.add(make_request("b", [40, 41, 42], max_tokens=30))
    before = _held_state(stage)
    attrs = (set(vars(stage)), set(vars(stage.drafter)))
    for _ in range(6):                         # prefill chunks, then decode steps verifying drafts
        batch = sched.schedule()
        _apply(sched, batch, stage.step(batch.plan))
    batch = sched.schedule()
    assert sum(batch.num_drafts) > 0, "the step compared must verify drafts"
    fresh = _stage(folder, head)
    for mine, theirs in zip(stage.kv_caches + stage.drafter.kv_caches, fresh.kv_caches + fresh.drafter.kv_caches):
        theirs.key.copy_(mine.key)
        theirs.value.copy_(mine.value)
    assert torch.equal(stage.step(batch.plan), fresh.step(batch.plan))
    after = _held_state(stage)
    assert before.keys() == after.keys() and attrs == (set(vars(stage)), set(vars(stage.drafter)))
    changed = [name for name in before if not torch.equal(before[name], after[name])]
    assert not changed, f"stage state other than the KV cache changed while stepping: {changed}"


def test_i4_stage_0_embeds_the_drafts_the_last_stage_verifies(tiny_llama_head):
    folder, head = tiny_llama_head
    prompts = [{"prompt_token_ids": list(range(5 + i, 12 + 3 * i))} for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    with LLM(model=str(folder), device="cpu", dtype="float32", pipeline_parallel_size=3, num_kv_blocks=32,
             max_model_len=MAX_LEN, check_collectives=True, threads_per_stage=1,
             speculative_config={"method": "mtp", "num_speculative_tokens": K, "model": str(head)}) as llm:
        llm.generate(prompts, params, use_tqdm=False)
        reports = llm.engine.executor.check_symmetry()      # raises on any I3 or I4 mismatch
    embedded, verified = reports[0]["drafts"]["embedded"], reports[2]["drafts"]["verified"]
    assert len(embedded) >= 8 and embedded == verified
    assert "drafts" in reports[1] and not reports[1]["drafts"]["embedded"] and not reports[1]["drafts"]["verified"]


def test_i4_check_names_a_step_whose_drafts_differ():
    reports = {0: {"drafts": {"embedded": {"7": "aa/2", "8": "bb/2"}, "verified": {}}},
               1: {"drafts": {"embedded": {}, "verified": {"7": "aa/2", "8": "00/0"}}}}
    problems = compare_draft_traces(reports)
    assert problems == ["I4 broken: step 8: stage 0 embedded drafts bb/2, stage 1 verified 00/0"]
    reports[1]["drafts"]["verified"]["8"] = "bb/2"
    assert compare_draft_traces(reports) == []
