"""StepPlan / StepResult: the messages of a step, and the shapes they give every message (I2)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pipespec.plan import (StepResult, activation_shape, draft_chain_overrun, position_margin, result_shape,
                           result_width)


def test_step_result_rows():
    # 3 requests, rows 0 and 2 sample; row 1 is a prefill chunk that does not
    res = StepResult.from_verification(4, 3, 0, torch.tensor([0, 2]), torch.tensor([[11], [33]]),
                                       torch.tensor([1, 1]))
    assert res.step_id == 4 and res.data.shape == (3, result_width(0)) == (3, 2)
    assert res.tokens(0) == [11] and res.tokens(1) == [] and res.tokens(2) == [33]
    assert res.data.device.type == "cpu"


def test_step_result_with_drafts_and_empty():
    k = 2
    res = StepResult.from_verification(1, 2, k, torch.tensor([1]), torch.tensor([[7, 8, -1]]), torch.tensor([2]),
                                       torch.tensor([[40, 41]]))
    assert res.data.shape == result_shape(2, k) == (2, 6)
    assert res.tokens(1) == [7, 8] and res.drafts(1) == [40, 41]
    assert res.tokens(0) == [] and res.drafts(0) == []
    empty = StepResult.empty(3, 4, k)
    assert empty.data.shape == (4, 6) and all(empty.tokens(r) == [] for r in range(4))


def test_plan_query_lengths_and_shapes():
    from pipespec.config import SchedulerConfig
    from pipespec.engine.scheduler import Scheduler
    from tests.helpers import make_request
    sched = Scheduler(SchedulerConfig(), 16, 8, 128)
    a, b = make_request("a", [5] * 7, arrival=0), make_request("b", [6] * 3, arrival=1)
    sched.add(a)
    sched.add(b)
    plan = sched.schedule().plan
    assert plan.num_reqs == 2 and plan.num_tokens == 10
    assert plan.query_lens().tolist() == [7, 3] and plan.max_query_len() == 7
    assert activation_shape(plan, 64) == (2, 10, 64)


def test_draft_margins():
    # K verify rows, then K more drafted past the last accepted token; the chain's KV K-1 past the query
    assert [position_margin(k) for k in (0, 1, 3)] == [0, 2, 6]
    assert [draft_chain_overrun(k) for k in (0, 1, 3)] == [0, 0, 2]


def test_result_with_logprobs_round_trips():
    """Packed logprobs (float64 bits in int64 columns) come back exactly; tokens and drafts keep their columns."""
    from pipespec.plan import StepResult, result_width
    from pipespec.sampling import append_logprobs
    k, n, vocab = 2, 3, 11
    logits = torch.randn(2, k + 1, vocab, generator=torch.Generator().manual_seed(0))
    tokens = torch.tensor([[4, 7, -1], [1, 2, 3]])
    base = StepResult.from_verification(5, 3, k, torch.tensor([0, 2]), tokens, torch.tensor([2, 3]),
                                        torch.tensor([[8, 9], [10, 0]])).data
    data = append_logprobs(base, logits, torch.tensor([0, 2]), k, n)
    assert data.shape == (3, result_width(k, n)) == (3, 2 * k + 2 + (k + 1) * (2 + 2 * n))
    res = StepResult(5, data, k)
    assert res.num_logprobs == n and res.tokens(0) == [4, 7] and res.drafts(2) == [10, 0] and res.drafts(1) == []
    logp = logits.log_softmax(-1)
    for m in (n, 1):                   # the plan's N, and a request's smaller N cut from it
        for row, line in ((0, 0), (2, 1)):
            count = len(res.tokens(row))
            got = np.frombuffer(res.logprob_records(row, count, m), dtype=np.int64).reshape(count, 2 + 2 * m)
            for j, rec in enumerate(got):
                t, lps = res.tokens(row)[j], logp[line, j]
                floats = rec.view(np.float64)
                assert floats[0] == pytest.approx(float(lps[t]), abs=1e-6)   # (float64 bits travel exactly)
                assert rec[1] == int((lps > lps[t]).sum()) + 1
                assert rec[2:2 + m].tolist() == lps.topk(m).indices.tolist()
                assert floats[2 + m:].tolist() == pytest.approx(lps.topk(m).values.tolist(), abs=1e-6)
    assert res.tokens(1) == []
    assert StepResult(5, base, k).num_logprobs == -1
