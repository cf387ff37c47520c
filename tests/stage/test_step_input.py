"""StepBuffers / StepInput: a plan laid out once in a stage's buffers, and the verify/draft geometry read
from it; a step padded to a CUDA graph bucket keeps its live views."""
from __future__ import annotations

import pytest
import torch

from pipespec.config import SchedulerConfig
from pipespec.engine.request import RequestStatus
from pipespec.engine.scheduler import Scheduler
from pipespec.stage.step_input import Padding, StepBuffers
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


def _buffers(k=K):
    return StepBuffers(torch.device("cpu"), max_rows=64, max_reqs=8, max_blocks_per_seq=16, num_spec_tokens=k,
                       padding=Padding(block=99, slot=7, block_size=16))


def _write(plan, k=K):
    return _buffers(k).write(plan)


def test_layout_rows_of_a_mixed_step():
    plan = _plan_with_drafts()
    # a: rows 0..2 = [13, 70, 71] at positions 3..5; b: rows 3..5 = its first 3 prompt tokens
    assert plan.input_ids.tolist() == [13, 70, 71, 20, 21, 22]
    buffers = _buffers()
    inp = buffers.write(plan)
    assert inp.sampling_reqs.tolist() == [0]                 # b's chunk does not end its prompt
    assert inp.verify_rows.tolist() == [[0, 1, 2]]
    assert inp.line_drafts.tolist() == [2]
    assert inp.draft_ids.tolist() == [[70, 71]]
    assert inp.first_positions.tolist() == [3]
    assert inp.max_query_len == 3 and inp.row_reqs.tolist() == [0, 0, 0, 1, 1, 1]
    # shifted left; b's last row takes its known next prompt token (23); a's last row is a placeholder
    assert inp.mtp_input_ids.tolist()[:2] == [70, 71] and inp.mtp_input_ids.tolist()[3:] == [21, 22, 23]
    assert buffers.embedded_drafts().tolist() == [[70, 71]]
    assert inp.input_ids.tolist() == plan.input_ids.tolist() and inp.block_tables.tolist() == plan.block_tables.tolist()


def test_short_draft_lines_are_padded_by_repeating_the_last_row():
    plan = _plan_with_drafts()
    plan.num_draft_rows[0] = plan.num_drafts[0] = 1             # a line of one draft row
    buffers = _buffers()
    assert buffers.write(plan).verify_rows.tolist() == [[1, 2, 2]]
    assert buffers.embedded_drafts().tolist() == [[71, -1]]


def test_dummy_draft_rows_keep_the_lines_geometry_and_are_masked():
    plan = _plan_with_drafts()
    plan.num_drafts[0] = 1                                    # rows 0..2, the last one a dummy
    buffers = _buffers()
    inp = buffers.write(plan)
    assert inp.verify_rows.tolist() == [[0, 1, 2]] and inp.line_drafts.tolist() == [1]
    assert buffers.embedded_drafts().tolist() == [[70, -1]]
    plan.num_drafts[0] = 3
    with pytest.raises(ValueError, match="real drafts"):
        buffers.write(plan)


def test_a_plan_larger_than_the_buffers_is_refused_by_name():
    plan = _plan_with_drafts()
    small = StepBuffers(torch.device("cpu"), max_rows=4, max_reqs=8, max_blocks_per_seq=16, num_spec_tokens=K)
    with pytest.raises(ValueError, match="6 rows, more than the stage's buffers hold"):
        small.write(plan)


def test_a_step_padded_to_a_bucket_keeps_its_views_and_pads_the_rest():
    """A steady step of 2 requests x (1 + K) rows padded to a bucket of 4: the live views read the
    plan's values, the padding requests sit in the spare block and state slot with K real drafts,
    and the views are the same memory as the bucket's capture views (what a CUDA graph reads)."""
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), 16, 8, 128, num_spec_tokens=K)
    reqs = [make_request(n, [10 + i, 11, 12], max_tokens=8) for i, n in enumerate("ab")]
    for r in reqs:
        sched.add(r)
    first = sched.schedule()
    sched.complete(first, StepResult.from_verification(first.plan.step_id, 2, K, torch.tensor([0, 1]),
                                                       torch.tensor([[13, -1, -1], [14, -1, -1]]), torch.tensor([1, 1]),
                                                       torch.tensor([[70, 71], [80, 81]])))
    for r, tok, drafts in zip(reqs, (13, 14), ([70, 71], [80, 81])):
        r.token_ids.append(tok)
        r.draft_ids = drafts
    plan = sched.schedule().plan
    assert plan.num_tokens == 2 * (K + 1)
    buffers = _buffers()
    capture = buffers.padding_views(4, K)
    inp = buffers.write(plan, pad_to=4)
    assert inp.padded and inp.num_reqs == 2 and capture.num_reqs == 4
    assert inp.input_ids.data_ptr() == capture.input_ids.data_ptr()
    assert inp.block_tables.data_ptr() == capture.block_tables.data_ptr()
    assert capture.input_ids.tolist()[:6] == plan.input_ids.tolist() == [13, 70, 71, 14, 80, 81]
    assert inp.draft_ids.tolist() == [[70, 71], [80, 81]]
    assert capture.verify_rows.tolist() == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]
    assert capture.positions.tolist()[6:] == [0, 1, 2, 0, 1, 2]
    assert capture.slot_mapping.tolist()[6:] == [99 * 16 + p for p in (0, 1, 2, 0, 1, 2)]
    assert capture.block_tables[2:].unique().tolist() == [99] and capture.state_slots[2:].tolist() == [7, 7]
    assert capture.query_start_loc.tolist() == [0, 3, 6, 9, 12] and capture.line_drafts.tolist() == [2, 2, 2, 2]
    assert capture.row_reqs.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert capture.carried.tolist() == [-1] * 4 and capture.state_commit[2:].tolist() == [-1, -1]
    # an eager write of another step rewrites the buffers; the padded layout comes back the same
    buffers.write(_plan_with_drafts())
    assert buffers.write(plan, pad_to=4).input_ids.data_ptr() == capture.input_ids.data_ptr()
    assert capture.input_ids.tolist()[:6] == [13, 70, 71, 14, 80, 81]
