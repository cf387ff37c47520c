"""The one-host all-reduce's set-up is collective: whichever rank fails, every rank falls back to
NCCL and every rank has issued the same collectives, so the group's next sum is still right (a rank
that skipped the probe would have met its peer's probe with its vote and hung or summed garbage).

Symmetric memory needs GPUs: here a stand-in maps no memory and sums through the group itself, and
can be told to fail on one rank; the votes, the probe and the registration are the real code, over
two real processes and gloo. The GPU test is `test_one_host_all_reduce_cuda.py`."""
from __future__ import annotations

import pytest
import torch

from pipespec.runtime import launch
from pipespec.runtime.one_host_all_reduce import OneHostAllReduce
from tests.runtime.two_ranks import run_two_ranks


def _rank(rank: int, port: int, fail_rank, stage_of_failure: str, out) -> None:
    store = launch.connect_store("127.0.0.1", port, 30)
    pg = launch.tp_group(store, 0, rank, 2, "gloo", torch.device("cpu"), 30)

    class StandIn(OneHostAllReduce):
        def _map(self, store, rank, size, device, dtype, max_bytes):
            if rank == fail_rank and stage_of_failure == "set-up":
                raise RuntimeError("no symmetric memory on this rank")
            self.buffer = torch.empty(8, dtype=dtype)

        def all_reduce(self, x):
            pg.allreduce([x]).wait()
            if rank == fail_rank and stage_of_failure == "probe":
                x += 1                                 # a wrong sum on one rank: the probe must catch it
            return x

    made = StandIn.create(store, pg, 0, rank, 2, torch.device("cpu"), torch.float32)
    x = torch.full((3,), float(rank + 1))
    pg.allreduce([x]).wait()                           # the group's next sum after the set-up
    if made is not None:
        made.close()
    out.put((rank, {"made": made is not None, "next_sum": x.tolist()}))


@pytest.mark.parametrize("fail_rank,stage_of_failure", [(None, ""), (0, "set-up"), (1, "set-up"),
                                                        (1, "probe")])
def test_every_rank_agrees_and_the_group_stays_in_step(fail_rank, stage_of_failure):
    reports = run_two_ranks(_rank, fail_rank, stage_of_failure, timeout=60)
    assert {r["made"] for r in reports.values()} == {fail_rank is None}
    assert all(r["next_sum"] == [3.0, 3.0, 3.0] for r in reports.values()), reports
