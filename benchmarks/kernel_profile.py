"""Where a decode step's GPU time goes: kernel time by name over a timed call, from PyTorch's
profiler (which sees the kernels inside replayed CUDA graphs), per generated token.

Used by `tp_two_gpu.py --profile` and `family_gpu.py --profile`; a collective's kernel time includes
its wait for the peer ranks, so a rank that starts its steps late shows up as long all-reduces.
"""
from __future__ import annotations

import time

import torch
from torch.profiler import ProfilerActivity, profile


def kernel_profile(run, tokens: int, top: int = 15, trace: str | None = None) -> dict:
    """Profile `run()` (which generates `tokens` tokens, summed over the batch's requests or not, as the
    caller counts them): wall ms per token, summed kernel ms per token, and the `top` kernels."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        run()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
    events = [e for e in prof.key_averages() if getattr(e, "self_device_time_total", 0) > 0]
    events.sort(key=lambda e: -e.self_device_time_total)
    per_token = 1e3 * tokens                      # microseconds in all -> milliseconds per token
    if trace:
        prof.export_chrome_trace(trace)
    return {"wall_ms_per_token": round(wall * 1e3 / tokens, 3),
            "kernels_ms_per_token": round(sum(e.self_device_time_total for e in events) / per_token, 3),
            "top": [(e.key[:80], round(e.self_device_time_total / per_token, 4), e.count) for e in events[:top]]}
