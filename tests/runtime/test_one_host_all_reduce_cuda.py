"""The one-host all-reduce on two GPUs (two real processes, NCCL beside it): every rank sets it up,
its sums equal NCCL's, eagerly and replayed from a CUDA graph, small sums take it and large ones
NCCL, and a second one set up in the same processes after the first is closed works too; and what
64 sums of one 8B-model row cost each way, in a graph (printed, not asserted)."""
from __future__ import annotations

import logging

import pytest
import torch

from pipespec.parallel import TensorParallel
from pipespec.runtime import launch
from pipespec.runtime.one_host_all_reduce import MAX_BYTES, OneHostAllReduce
from tests.runtime.two_ranks import run_two_ranks

pytestmark = pytest.mark.gpu(devices=2)


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _rank(rank: int, port: int, out) -> None:
    lines = _Lines()             # the set-up's log line says why it is off, if it is
    log = logging.getLogger("pipespec.runtime.one_host_all_reduce")
    log.setLevel(logging.INFO)
    log.addHandler(lines)
    device = torch.device("cuda", rank)
    store = launch.connect_store("127.0.0.1", port, 60)
    pg = launch.tp_group(store, 0, rank, 2, "nccl", device, 60)
    fast = OneHostAllReduce.create(store, pg, 0, rank, 2, device, torch.bfloat16)
    tp = TensorParallel(rank, 2)
    tp.attach(pg, None, fast)
    g = torch.Generator(device=device).manual_seed(rank)
    report = {"set_up": fast is not None, "equal": [], "handles_large": None, "log": lines.lines}
    if fast is not None:
        for rows in (1, 3, 64):
            x = torch.randn(rows, 4096, generator=g, device=device, dtype=torch.bfloat16)
            want = x.clone()
            pg.allreduce([want]).wait()
            report["equal"].append(torch.equal(tp.all_reduce(x.clone()), want))
        # replayed from a graph, on new inputs written into the captured buffer
        x = torch.zeros(8, 4096, device=device, dtype=torch.bfloat16)
        graph = torch.cuda.CUDAGraph()
        y = x.clone()
        tp.all_reduce(y)
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            y.copy_(x)
            tp.all_reduce(y)
        for _ in range(3):
            x.copy_(torch.randn(8, 4096, generator=g, device=device, dtype=torch.bfloat16))
            graph.replay()
            want = x.clone()
            pg.allreduce([want]).wait()
            report["equal"].append(torch.equal(y, want))
        report["handles_large"] = fast.handles(torch.empty(MAX_BYTES, dtype=torch.bfloat16, device=device))
        graph.reset()
    torch.cuda.synchronize()
    tp.close()
    # a second engine in the same processes (tests, benchmarks, a server rebuilding its engine):
    # a new NCCL group and a new one-host all-reduce; on two H200s an engine built so hung in set-up
    pg = launch.tp_group(store, 1, rank, 2, "nccl", device, 60)
    second = OneHostAllReduce.create(store, pg, 1, rank, 2, device, torch.bfloat16)
    report["second_set_up"] = second is not None
    if second is not None:
        x = torch.randn(3, 4096, generator=g, device=device, dtype=torch.bfloat16)
        want = x.clone()
        pg.allreduce([want]).wait()
        report["equal"].append(torch.equal(second.all_reduce(x), want))
        second.close()
    torch.cuda.synchronize()
    pg.shutdown()
    out.put((rank, report))


def test_one_host_all_reduce_equals_nccl_eager_and_in_graphs():
    reports = run_two_ranks(_rank, timeout=180)
    print(reports)
    for rank, report in reports.items():
        assert report["set_up"], f"rank {rank} did not set up the one-host all-reduce: {report['log']}"
        assert report["second_set_up"], f"rank {rank}: a second one-host all-reduce in the process: {report['log']}"
        assert report["equal"] == [True] * 7, report
        assert report["handles_large"] is False
