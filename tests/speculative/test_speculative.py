"""MTP speculative decoding end to end: lossless for every K and pipeline size, real acceptance,
fixed-width results, clear errors, and shared tensors resolved through their owner."""
from __future__ import annotations

import json
import re

import pytest
import torch

from pipespec import LLM, SamplingParams
from pipespec.heads import bundled_head_path
from pipespec.model.mtp import load_mtp_file
from pipespec.plan import result_width
from pipespec.train.forward import chained_mtp, target_pass
from tests.conftest import DEFAULT_LLM_KWARGS, assert_engine_clean
from tests.speculative.staggered import run_staggered

def _spec(k: int) -> dict:
    return {"method": "mtp", "num_speculative_tokens": k}






@pytest.mark.parametrize("pp,k", [(1, 1), (1, 2), (1, 3), (1, 8), (2, 1), (2, 2), (2, 3)])
def test_greedy_lossless(pp, k, chat_prompts, mixed_params, reference):
    with LLM(**DEFAULT_LLM_KWARGS, pipeline_parallel_size=pp, speculative_config=_spec(k)) as llm:
        got = run_staggered(llm, chat_prompts, mixed_params)
        stats = llm.stats()["spec_decode"]
        assert_engine_clean(llm)
    assert got == reference
    assert stats["num_drafts"] > 0 and stats["num_draft_tokens"] >= stats["num_drafts"]
    assert stats["num_accepted_tokens"] > 0                # drafts are often right: every relay path ran
    assert sum(stats["accepted_per_position"]) == stats["num_accepted_tokens"]
    assert len(stats["accepted_per_position"]) == k


def test_seeded_sampling_with_speculation_is_reproducible(chat_prompts):
    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=11 + i, max_tokens=24) for i in range(3)]
    outs = []
    for _ in range(2):
        with LLM(**DEFAULT_LLM_KWARGS, speculative_config=_spec(2)) as llm:
            outs.append(run_staggered(llm, chat_prompts[:3], params))
    assert outs[0] == outs[1]


def _schedule_agreement(mtp, target, ids: list[int], start: int) -> tuple[int, int]:
    """Teacher-forced step-1 agreement along the K=1 draft schedule: a round at row t drafts x_{t+2};
    accepted -> next round at t+2, rejected -> t+1. (Plain agreement averages every position; the
    engine visits fewer positions inside runs of accepted drafts, so this is the like-for-like figure.)"""
    x = torch.tensor([ids])
    hidden, logits = target_pass(target, x)
    student = mtp.compute_logits(chained_mtp(mtp, target, x, hidden, 1)[0], target.head_weight()).argmax(-1)[0]
    teacher = logits[0, 1:].argmax(-1)
    rounds = agree = 0
    t = start
    while t + 1 < len(ids) - 1:
        ok = bool(student[t] == teacher[t])
        rounds, agree = rounds + 1, agree + ok
        t += 2 if ok else 1
    return rounds, agree


def test_measured_acceptance_matches_teacher_forced(chat_prompts, _session_llm):
    """At PP = 1 and 2. Greedy output is the same at both sizes (I6), so the teacher-forced agreement
    along its K = 1 schedule is computed once and each size's measured acceptance checked against it."""
    params = SamplingParams(temperature=0, max_tokens=48)
    # drafts over the whole vocabulary, as the teacher-forced agreement counts them
    spec = _spec(1) | {"draft_vocab": "full"}
    runs = {}
    for pp in (1, 2):
        with LLM(**DEFAULT_LLM_KWARGS, pipeline_parallel_size=pp, speculative_config=spec) as llm:
            outs = llm.generate([{"prompt_token_ids": p} for p in chat_prompts], params, use_tqdm=False)
            runs[pp] = [o.outputs[0].token_ids for o in outs], llm.stats()["spec_decode"]
    assert runs[1][0] == runs[2][0]
    target = _session_llm.engine.executor.stage.model
    mtp, _ = load_mtp_file(bundled_head_path(), target.arch)
    rounds = agree = 0
    for prompt, out in zip(chat_prompts, runs[1][0]):
        r, a = _schedule_agreement(mtp, target, prompt + out, len(prompt))
        rounds, agree = rounds + r, agree + a
    for pp, (_, stats) in runs.items():
        measured = stats["draft_acceptance_rate"]
        assert stats["num_drafts"] >= 0.9 * rounds, (pp, stats["num_drafts"], rounds)
        assert abs(measured - agree / rounds) <= 0.02, (pp, measured, agree / rounds)
        assert measured > 0.3, pp      # the bundled head is a real draft, not noise


def test_step_result_width_is_fixed(chat_prompts):
    shapes = []
    with LLM(**DEFAULT_LLM_KWARGS, speculative_config=_spec(3)) as llm:
        receive = llm.engine.executor.receive

        def spy(timeout):
            result = receive(timeout)
            shapes.append((result.data.shape[1], int(result.data.shape[0])))
            return result

        llm.engine.executor.receive = spy
        llm.generate([{"prompt_token_ids": p} for p in chat_prompts[:2]],
                     SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    # prefill steps, the first decode step and steady state all return (K+1) + 1 + K columns
    assert len(shapes) > 3 and {w for w, _ in shapes} == {result_width(3)}


def test_model_without_mtp_weights_points_to_train_mtp(tiny_models):
    with pytest.raises(ValueError, match="pipespec train-mtp") as err:
        LLM(model=str(tiny_models["llama"][0]), dtype="float32", device="cpu", num_kv_blocks=64,
            speculative_config=_spec(2))
    # a CLI user is shown the flag with JSON they can paste
    flag = re.search(r"--speculative-config '([^']*)'", str(err.value))
    assert flag and json.loads(flag.group(1))["model"] == "head.safetensors", str(err.value)


@pytest.mark.parametrize("bad", [{"method": "eagle", "num_speculative_tokens": 2},
                                 {"method": "mtp", "num_speculative_tokens": 0},
                                 {"method": "mtp", "num_speculative_tokens": 9},
                                 {"method": "mtp", "k": 2}, "not json"])
def test_bad_speculative_config(bad):
    with pytest.raises(ValueError, match="speculative_config"):
        LLM(speculative_config=bad)


def test_draft_sees_the_targets_current_tensors():
    """The proposer resolves the embedding and head through the target at call time (I5)."""
    with LLM(**DEFAULT_LLM_KWARGS, speculative_config=_spec(2)) as llm:
        runner = llm.engine.executor.stage
        proposer = runner.drafter
        old = runner.model.model.embed_tokens.weight
        new = torch.nn.Parameter(old.detach().clone() * 2)
        runner.model.model.embed_tokens.weight = new
        assert proposer._embed_weight() is new and proposer._head_weight() is new
        runner.model.model.embed_tokens.weight = old
