"""A stage's tensor-parallel group in two real processes over gloo (`launch.tp_group`): all-reduce
sums, all-gather concatenates in rank order, and with the collective check on, ranks about to issue
different collectives both fail at once naming the two descriptors (I3), instead of hanging."""
from __future__ import annotations

import torch

from pipespec.parallel import TensorParallel
from pipespec.runtime import launch, symmetry
from tests.runtime.two_ranks import run_two_ranks


def _rank(rank: int, port: int, mismatch: bool, out) -> None:
    torch.set_num_threads(1)
    store = launch.connect_store("127.0.0.1", port, 30)
    tp = TensorParallel(rank, 2)
    pg = launch.tp_group(store, 0, rank, 2, "gloo", torch.device("cpu"), 20)
    tp.attach(pg, symmetry.CollectiveChecker(symmetry.SymmetryRecorder(rank), pg, "tp0", rank, 2,
                                             torch.device("cpu")))
    try:
        summed = tp.all_reduce(torch.full((3,), float(rank + 1))).tolist()
        gathered = tp.all_gather(torch.full((2, 2), float(rank))).tolist()
        if mismatch:
            tp.all_reduce(torch.zeros(4 + rank))
        out.put((rank, (summed, gathered, None)))
    except symmetry.CollectiveMismatch as e:
        out.put((rank, (None, None, str(e))))


def _run(mismatch: bool) -> dict:
    return {rank: list(report) for rank, report in run_two_ranks(_rank, mismatch).items()}


def test_all_reduce_and_ordered_all_gather():
    results = _run(mismatch=False)
    for rank in (0, 1):
        summed, gathered, error = results[rank]
        assert error is None
        assert summed == [3.0, 3.0, 3.0]
        assert gathered == [[0.0, 0.0, 1.0, 1.0], [0.0, 0.0, 1.0, 1.0]]


def test_mismatched_collectives_fail_on_both_ranks_naming_them():
    results = _run(mismatch=True)
    for rank in (0, 1):
        error = results[rank][2]
        assert error is not None
        assert "TP rank 0: tp.all_reduce (4,) float32" in error and "TP rank 1: tp.all_reduce (5,) float32" in error
