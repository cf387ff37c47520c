"""Adaptive K end to end on the default model: each step's K comes from the policy (measured, or a
forced sequence through the config), greedy output stays that of plain decoding at PP = 1 and 2,
every result row is as wide as its plan's K says, and the MTP KV stays right across steps with K = 0
(the drafts after them equal those of a fixed-K run at the same positions)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipespec import LLM, SamplingParams
from pipespec.plan import result_width
from tests.conftest import DEFAULT_LLM_KWARGS, assert_engine_clean
from tests.speculative.staggered import run_staggered

FORCED = [2, 0, 1, 0, 2]


def _spec(k: int, adaptive: bool = True, sequence=None) -> dict:
    spec = {"method": "mtp", "num_speculative_tokens": k, "adaptive": adaptive}
    return spec | ({"k_sequence": sequence} if sequence else {})




@pytest.mark.parametrize("pp,sequence", [(1, None), (1, FORCED), (2, None), (2, FORCED)])
def test_adaptive_greedy_output_is_plain_decodings(pp, sequence, chat_prompts, mixed_params, reference):
    # at PP = 2 the debug check compares every message's shape and the draft ids stage 0 embedded with
    # those the last stage verified (I3, I4), at every K
    with LLM(**DEFAULT_LLM_KWARGS, pipeline_parallel_size=pp, speculative_config=_spec(2, True, sequence),
             check_collectives=pp > 1) as llm:
        widths = []
        receive = llm.engine.executor.receive

        def spy(timeout):
            result = receive(timeout)
            widths.append((result.data.shape[1], result.num_spec_tokens))
            return result

        llm.engine.executor.receive = spy
        got = run_staggered(llm, chat_prompts, mixed_params)
        stats = llm.stats()["spec_decode"]
        assert_engine_clean(llm)
    assert got == reference
    k_steps = stats["adaptive_k"]["k_steps"]
    assert sum(k_steps) == len(widths)                                 # one choice per step
    assert stats["num_accepted_tokens"] > 0
    # each result is as wide as its own plan's K says: (K+1) + 1 + K
    assert all(w == result_width(k) for w, k in widths)
    if sequence is None:     # the measured policy has measured costs and moved between K values
        assert stats["adaptive_k"]["step_seconds"] and sum(n > 0 for n in k_steps) >= 2, stats["adaptive_k"]
    else:                    # K = 0, 1 and 2 all ran
        assert all(n > 0 for n in k_steps) and {w for w, _ in widths} == {result_width(k) for k in range(3)}


def _drafts_by_position(llm: LLM, prompts, max_tokens: int) -> dict[tuple[int, int], list[int]]:
    """(request, tokens known) -> the drafts proposed from there, over a greedy run."""
    eng, seen = llm.engine, {}
    for i, ids in enumerate(prompts):
        eng.add_request(f"d{i}", {"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                                            ignore_eos=True))
    while eng.has_unfinished_requests():
        eng.step()
        for req in eng.requests.values():
            if req.draft_ids:
                seen[(int(req.request_id[1:]), req.num_tokens)] = list(req.draft_ids)
    return seen


def test_drafts_after_k0_steps_equal_fixed_k_drafts(chat_prompts):
    """A K = 0 step skips the drafts but must still write the MTP KV of its rows: the drafts of a
    later step attend to it. So wherever both runs drafted from the same position, the drafts match."""
    prompts = chat_prompts[:3]
    with LLM(**DEFAULT_LLM_KWARGS, speculative_config=_spec(2, adaptive=False)) as llm:
        fixed = _drafts_by_position(llm, prompts, 32)
    with LLM(**DEFAULT_LLM_KWARGS, speculative_config=_spec(2, True, [0, 0, 2, 0, 1, 2])) as llm:
        forced = _drafts_by_position(llm, prompts, 32)
    common = [key for key in forced if key in fixed]
    assert len(common) > 20, (len(common), len(forced))
    mismatched = [(key, fixed[key], forced[key]) for key in common
                  if fixed[key][:len(forced[key])] != forced[key]]
    assert not mismatched, mismatched[:5]


def test_cli_accepts_adaptive_and_reports_the_k_distribution():
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[2]))
    proc = subprocess.run([sys.executable, "-m", "pipespec", "generate", "--device", "cpu", "--max-tokens", "24",
                           "--speculative-config", '{"method":"mtp","num_speculative_tokens":3,"adaptive":true}',
                           "The capital of France is"], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "adaptive K, steps per K [0: " in proc.stdout and ", 3: " in proc.stdout, proc.stdout


def test_retired_speculation_runs_no_drafter_and_stays_plain_decoding(chat_prompts, mixed_params, reference):
    """Once adaptive K retires speculation (no K paid; forced here at the start), every plan says
    K = 0 and drafting=False, the last stage writes no MTP KV, and greedy output is plain decoding's."""
    with LLM(**DEFAULT_LLM_KWARGS, speculative_config=_spec(2)) as llm:
        stage = llm.engine.executor.stage
        llm.engine.k_policy.retired = True
        mtp_kv = [c.key.clone() for c in stage.drafter.kv_caches]
        plans = []
        submit = llm.engine.executor.submit
        llm.engine.executor.submit = lambda plan: (plans.append(plan), submit(plan))[1]
        got = run_staggered(llm, chat_prompts, mixed_params)
        assert all(torch.equal(a, c.key) for a, c in zip(mtp_kv, stage.drafter.kv_caches)), \
            "a retired drafter wrote MTP KV"
        assert llm.stats()["spec_decode"]["adaptive_k"]["retired"]
        assert_engine_clean(llm)
    assert got == reference
    assert plans and all(p.num_spec_tokens == 0 and not p.drafting for p in plans)
