"""StepLayout: the verify/draft geometry, worked out once from a scheduler's plan."""
from __future__ import annotations

import pytest
import torch

from pipespec.config import SchedulerConfig
from pipespec.engine.request import RequestStatus
from pipespec.engine.scheduler import Scheduler
from pipespec.layout import StepLayout, shift_left
from pipespec.plan import StepResult
from tests.helpers import make_request

K = 2


def _plan_with_drafts():
    """Request a decodes with drafts [70, 71]; b is a 5-token prompt cut into a 3-token chunk."""
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=6, long_prefill_token_threshold=0), 16, 8, 128,
                      num_spec_tokens=K)
    a = make_request("a", [10, 11, 12], max_tokens=8)
    sched.add(a)
    first = sched.schedule()
    sched.complete(first, StepResult.from_verification(first.plan.step_id, 1, K, torch.tensor([0]),
                                                       torch.tensor([[13, -1, -1]]), torch.tensor([1]),
                                                       torch.tensor([[70, 71]])))
    a.token_ids.append(13)
    a.draft_ids = [70, 71]
    sched.add(make_request("b", [20, 21, 22, 23, 24], max_tokens=8))
    batch = sched.schedule()
    assert a.status is RequestStatus.RUNNING and batch.num_drafts == [2, 0]
    return batch.plan


def test_layout_rows_of_a_mixed_step():
    plan = _plan_with_drafts()
    # a: rows 0..2 = [13, 70, 71] at positions 3..5; b: rows 3..5 = its first 3 prompt tokens
    assert plan.input_ids.tolist() == [13, 70, 71, 20, 21, 22]
    layout = StepLayout.from_plan(plan, K)
    assert layout.sample_rows.tolist() == [0]                 # b's chunk does not end its prompt
    assert layout.verify_rows.tolist() == [[0, 1, 2]]
    assert layout.num_drafts.tolist() == [2]
    assert layout.draft_ids.tolist() == [[70, 71]]
    assert layout.first_positions.tolist() == [3]
    assert layout.max_query_len == 3
    # shifted left; b's last row takes its known next prompt token (23); a's last row is a placeholder
    assert layout.mtp_input_ids.tolist()[:2] == [70, 71] and layout.mtp_input_ids.tolist()[3:] == [21, 22, 23]
    assert layout.draft_rows_of_input().tolist() == [[70, 71]]


def test_short_draft_lines_are_padded_by_repeating_the_last_row():
    plan = _plan_with_drafts()
    plan.num_drafts[0] = plan.real_drafts[0] = 1              # a line of one draft row
    layout = StepLayout.from_plan(plan, K)
    assert layout.verify_rows.tolist() == [[1, 2, 2]]
    assert layout.draft_rows_of_input().tolist() == [[71, -1]]


def test_dummy_draft_rows_keep_the_lines_geometry_and_are_masked():
    plan = _plan_with_drafts()
    plan.real_drafts[0] = 1                                    # rows 0..2, the last one a dummy
    layout = StepLayout.from_plan(plan, K)
    assert layout.verify_rows.tolist() == [[0, 1, 2]] and layout.num_drafts.tolist() == [1]
    assert layout.draft_rows_of_input().tolist() == [[70, -1]]
    plan.real_drafts[0] = 3
    with pytest.raises(ValueError, match="real drafts"):
        StepLayout.from_plan(plan, K)


def test_shift_left_takes_the_known_next_token_at_chunk_ends():
    ids = torch.tensor([1, 2, 3, 4, 5])
    qsl = torch.tensor([0, 2, 5])
    assert shift_left(ids, qsl, torch.tensor([9, -1])).tolist() == [2, 9, 4, 5, 1]
