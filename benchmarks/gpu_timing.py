"""GPU timers for the benchmarks: CUDA events around a call, and calls replayed from one CUDA graph
as decode runs them. Timed eagerly, a kernel that runs faster than the host launches it measures the
launch (Triton's Python launch costs tens of microseconds)."""
from __future__ import annotations

import torch

from pipespec.stage.cuda_graphs import capture_graph


def gpu_ms(fn, iters: int = 50) -> float:
    """Median GPU milliseconds of one call of `fn` (a graph's replay, a kernel launch)."""
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def graph_ms(calls: list, iters: int = 20) -> float:
    """GPU milliseconds of one of `calls` (closures over different buffers), replayed from one CUDA
    graph that makes every call in turn: median over `iters` replays, divided by their number. Calls
    over distinct buffers whose total exceeds the L2 cache measure memory, not cache (benchmarks size
    them so)."""
    graph, _ = capture_graph(None, lambda: [call() for call in calls])    # as the engine's graphs run them
    ms = gpu_ms(graph.replay, iters) / len(calls)
    graph.reset()
    return ms


@torch.inference_mode()
def time_replay(stage, batch: int, iters: int = 50) -> dict[str, float]:
    """Median GPU milliseconds of one replay of each graph of `batch`'s bucket of a stage's largest K,
    on padding inputs: the device's share of a step, without the host's."""
    graphs = stage.graphs.by_k[max(stage.graphs.by_k)]
    bucket = graphs.bucket(batch)
    stage.buffers.padding_views(bucket.inp.num_reqs, graphs.num_spec_tokens)
    out = {}
    for name, graph in (("forward", bucket.forward), ("finish", bucket.finish)):
        if graph is not None:
            out[f"{name}_gpu_ms"] = round(gpu_ms(graph.replay, iters), 3)
    return out
