"""The wire format (I2) and the point-to-point link: bounded waits (I7) and the symmetry check (I3).

The link tests run a real gloo pair: this process is rank 0, one spawned process rank 1.
"""
from __future__ import annotations

import dataclasses
import datetime
import os
import time

import pytest
import torch
import torch.distributed as dist

from pipespec.plan import StepPlan
from pipespec.runtime import launch, symmetry
from pipespec.runtime.symmetry import CollectiveMismatch, SymmetryRecorder, compare_reports
from pipespec.runtime.transport import (HEADER_LEN, Link, StageError, pack_plan, payload_len,
                                        unpack_plan)
from pipespec.sampling import SamplingTensors


def _plan(step_id=7, lens=(5, 1, 3), width=4, sample=(0, 2)) -> StepPlan:
    g = torch.Generator().manual_seed(step_id)
    t, b, s = sum(lens), len(lens), len(sample)
    qsl = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int64)
    return StepPlan(
        step_id=step_id,
        input_ids=torch.randint(0, 50000, (t,), generator=g), positions=torch.randint(0, 500, (t,), generator=g),
        slot_mapping=torch.randint(0, 4096, (t,), generator=g), query_start_loc=qsl,
        seq_lens=torch.randint(1, 500, (b,), generator=g), block_tables=torch.randint(0, 256, (b, width), generator=g),
        sampling_reqs=torch.tensor(sample, dtype=torch.int64),
        sampling=SamplingTensors(temperature=torch.rand(s, generator=g),
                                 top_k=torch.tensor([-1, 50][:s], dtype=torch.int64),
                                 top_p=torch.tensor([0.9, 1.0][:s], dtype=torch.float32),
                                 min_p=torch.tensor([0.0, 0.05][:s], dtype=torch.float32),
                                 seed=torch.tensor([2**62 + 3, -5][:s], dtype=torch.int64),
                                 needs_sort=True, all_greedy=False))


def _tensor_fields(plan: StepPlan) -> dict:
    out = {}
    for f in dataclasses.fields(plan):
        value = getattr(plan, f.name)
        if dataclasses.is_dataclass(value):
            out.update({f"{f.name}.{g.name}": getattr(value, g.name) for g in dataclasses.fields(value)})
        else:
            out[f.name] = value
    return out


def test_plan_round_trip_is_exact():
    plan = _plan()
    plan.num_draft_rows = torch.tensor([0, 1, 2])
    plan.next_token_ids = torch.tensor([-1, 7, 9])
    header, payload = pack_plan(plan)
    assert header.shape == (HEADER_LEN,) and header.dtype == torch.int64
    # the payload's size follows from the header alone
    assert payload.dtype == torch.int64 and payload.numel() == payload_len(header)
    got = unpack_plan(header, payload)
    assert got.step_id == plan.step_id
    want, have = _tensor_fields(plan), _tensor_fields(got)
    assert set(want) == set(have)
    for name, a in want.items():
        b = have[name]
        if isinstance(a, torch.Tensor):
            assert a.dtype == b.dtype and torch.equal(a, b), name          # floats bit for bit
        else:
            assert type(a) is type(b) and a == b, name
    assert got.sampling.needs_sort and not got.sampling.all_greedy


def test_plan_without_sampling_rows():
    plan = _plan(step_id=3, lens=(4, 4), width=1, sample=())
    plan.sampling.needs_sort, plan.sampling.all_greedy = False, True
    got = unpack_plan(*pack_plan(plan))
    assert got.sampling_reqs.numel() == 0 and got.sampling.all_greedy
    assert torch.equal(got.block_tables, plan.block_tables)


def test_plan_field_that_cannot_travel_is_refused():
    plan = _plan()
    plan.positions = plan.positions.reshape(1, 1, -1)
    with pytest.raises(StageError, match="plan field positions is a 3-d"):
        pack_plan(plan)


def test_symmetry_reports_compare_both_ends():
    a, b = SymmetryRecorder(0), SymmetryRecorder(1)
    for rec, direction, peer in ((a, "send", 1), (b, "recv", 0)):
        rec.record(direction, "ctrl", peer, "plan.header", (16,), torch.int64)
        rec.record(direction, "data", peer, "activations", (2, 5, 64), torch.float32)
    assert compare_reports({0: a.report(), 1: b.report()}) == []
    a.record("send", "data", 1, "activations", (2, 3, 64), torch.float32)
    b.record("recv", "data", 0, "activations", (2, 3, 64), torch.bfloat16)
    problems = compare_reports({0: a.report(), 1: b.report()})
    assert len(problems) == 1 and "data channel rank 0 -> rank 1" in problems[0]
    assert "bfloat16" in problems[0] and "float32" in problems[0]


def test_descriptor_round_trip():
    desc = symmetry.encode(12, "activations", (2, 7, 576), torch.bfloat16)
    assert desc.shape == (symmetry.DESCRIPTOR_LEN,)
    assert symmetry.decode(desc) == (12, "activations", (2, 7, 576), torch.bfloat16)


# -- a real gloo pair -----------------------------------------------------------------------------

_GROUPS = ("checked", "unchecked", "silent", "dying")


def _groups(store, rank):
    return {name: dist.ProcessGroupGloo(dist.PrefixStore(name, store), rank, 2, datetime.timedelta(seconds=30))
            for name in _GROUPS}


def _peer(port: int) -> None:
    """Rank 1: sends a (3, 4) tensor where rank 0 expects (4, 3), says nothing, then dies."""
    store = launch.connect_store("127.0.0.1", port, 30)
    groups = _groups(store, 1)
    cpu = torch.device("cpu")
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    # (a send must stay referenced until it completes: dropping its handle cancels it)
    pending = Link(1, groups["checked"], groups["checked"], cpu, check=True).send(x, 0, "activations")
    Link(1, groups["unchecked"], groups["unchecked"], cpu, check=False).send(x, 0, "activations").wait(30)
    store.wait(["die"])
    del pending
    os._exit(3)


@pytest.mark.serial
def test_link_catches_mismatch_times_out_and_notices_death():
    store, host, port = launch.host_store(60)
    proc = launch.spawn_context().Process(target=_peer, args=(port,), daemon=True)
    proc.start()
    try:
        groups = _groups(store, 0)
        cpu = torch.device("cpu")
        # with the check on, the disagreement is caught before the payload is read, naming both sides
        checked = Link(0, groups["checked"], groups["checked"], cpu, check=True)
        with pytest.raises(CollectiveMismatch) as err:
            checked.recv((4, 3), torch.float32, 1, "activations", timeout=20)
        assert "rank 0 expected to receive activations (4, 3) float32" in str(err.value)
        assert "rank 1 sent activations (3, 4) float32" in str(err.value)
        # without it, gloo takes the message into the wrong shape without a word: what the check is for
        unchecked = Link(0, groups["unchecked"], groups["unchecked"], cpu, check=False)
        got = unchecked.recv((4, 3), torch.float32, 1, "activations", timeout=20)
        assert got.shape == (4, 3) and got.flatten().tolist() == list(range(12))
        # a peer that stays silent: an error after the timeout, not a hang
        silent = Link(0, groups["silent"], groups["silent"], cpu)
        t0 = time.monotonic()
        with pytest.raises(StageError, match=r"no answer within 0.5s while waiting for result from rank 1"):
            silent.recv((2, 3), torch.int64, 1, "result", timeout=0.5)
        assert time.monotonic() - t0 < 5
        # a peer that dies: an error at once, long before the timeout
        dying = Link(0, groups["dying"], groups["dying"], cpu)
        store.set("die", "1")
        t0 = time.monotonic()
        with pytest.raises(StageError, match="connection lost while waiting for result from rank 1"):
            dying.recv((2, 3), torch.int64, 1, "result", timeout=60)
        assert time.monotonic() - t0 < 10
    finally:
        proc.join(10)
        if proc.exitcode is None:
            proc.kill()
            proc.join(5)
    assert proc.exitcode == 3
