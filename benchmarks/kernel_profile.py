"""Where a decode step's GPU time goes: kernel time by name over a timed call, from PyTorch's
profiler (which sees the kernels inside replayed CUDA graphs), per generated token.

Used by `tp_two_gpu.py --profile` and `family_gpu.py --profile`; a collective's kernel time includes
its wait for the peer ranks, so a rank that starts its steps late shows up as long all-reduces.
"""
from __future__ import annotations

import time

import torch
from torch.profiler import ProfilerActivity, profile


def kernel_times(run, trace: str | None = None) -> tuple[float, dict[str, tuple[float, int]]]:
    """Profile `run()`: (wall seconds, {kernel name: (device microseconds, launches)}); `trace`: also
    write the run's Chrome trace there."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        run()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
    if trace:
        prof.export_chrome_trace(trace)
    return wall, {e.key: (e.self_device_time_total, e.count) for e in prof.key_averages()
                  if getattr(e, "self_device_time_total", 0) > 0}


def _report(wall: float, kernels: dict[str, tuple[float, int]], tokens: int, top: int) -> dict:
    rows = sorted(kernels.items(), key=lambda kv: -kv[1][0])
    per_token = 1e3 * tokens                      # microseconds in all -> milliseconds per token
    return {"wall_ms_per_token": round(wall * 1e3 / tokens, 3),
            "kernels_ms_per_token": round(sum(us for us, _ in kernels.values()) / per_token, 3),
            "launches_per_token": round(sum(n for _, n in kernels.values()) / tokens, 1),
            "top": [(name[:80], round(us / per_token, 4), round(n / tokens, 1)) for name, (us, n) in rows[:top]]}


def kernel_profile(run, tokens: int, top: int = 15, trace: str | None = None) -> dict:
    """Profile `run()` (which generates `tokens` tokens, summed over the batch's requests or not, as the
    caller counts them): wall ms per token, summed kernel ms per token, and the `top` kernels
    (ms and launches per token)."""
    wall, kernels = kernel_times(run, trace)
    return _report(wall, kernels, tokens, top)


def decode_profile(run_full, run_first, tokens: int, top: int = 20) -> dict:
    """The decode steps alone: a `tokens`-token run's kernels less a one-token run's (the prefill, the
    first token), per decode token."""
    wall, full = kernel_times(run_full)
    wall1, first = kernel_times(run_first)
    diff = {name: (us - first.get(name, (0.0, 0))[0], n - first.get(name, (0.0, 0))[1])
            for name, (us, n) in full.items()}
    return _report(wall - wall1, {k: v for k, v in diff.items() if v[1] > 0}, tokens - 1, top)
