"""Programmatic dependent launch (PDL, sm_90 and later) for the decode path's chain of small kernels.

A batch-1 decode step is hundreds of kernels in a row, each depending on the one before for its
activations. Without PDL a kernel is launched only once the one before has completed. With PDL
(inside CUDA graphs too: a captured launch keeps its programmatic edge) a
kernel is launched as soon as every program of the one before has signalled
`griddepcontrol.launch_dependents` (or exited); its programs become resident and set up, then
`griddepcontrol.wait` until the kernel before has completed and its writes are visible. The launch
latency between kernels is hidden in the tail of the one before.

Where a kernel signals: the decode GEMV after its main loop (its dependents then start in its tail);
the others first thing, with their wait (the signal takes effect only once every program of the
kernel has started, i.e. in its last wave). Loading or prefetching weights before the wait was
tried and lost (`benchmarks/RESULTS.md`).

What keeps it correct: every program of a PDL kernel waits first thing, unconditionally, before it
reads or stores anything (`tests/kernels/test_pdl.py` checks each kernel's source). So a PDL kernel completes only after the kernel before it has, and the wait is
transitive: a kernel sees the writes of every kernel before it, PDL or not. A kernel launched
without PDL (cuBLAS, PyTorch's, fla-core's) waits for everything before it as usual.

On only for kernels launched inside `pdl_scope()` (`kernels/__init__.py`), which the CUDA-graph
capture opens, its warm-up run included (so the variants it captures are compiled outside the
capture). An eager step has nothing to gain (its host launches are slower than the GPU), and with
every launch on PDL an eager prefill was slower (RESULTS.md). Off before sm_90, under the Triton
interpreter and with `PIPESPEC_PDL=0`; then the constexpr `PDL` compiles the instructions out and the launch is a plain one.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from pipespec.kernels import in_pdl_scope


@triton.jit
def pdl_signal(PDL: tl.constexpr):
    """Let the next kernel launch (it takes effect once every program has signalled or exited)."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Wait until the previous kernel has completed and its writes are visible."""
    if PDL:
        gdc_wait()


@functools.cache
def _on(index: int, setting: str | None) -> bool:
    if setting == "0" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_on(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL here (cheap: it runs at every eager launch)."""
    if not in_pdl_scope() or device.type != "cuda":
        return False
    return _on(device.index if device.index is not None else torch.cuda.current_device(),
               os.environ.get("PIPESPEC_PDL"))


def pdl_args(device: torch.device) -> dict:
    """A Triton launch's keyword arguments for PDL on `device`: the kernel's constexpr `PDL` and
    the launch attribute, which go together."""
    on = pdl_on(device)
    return {"PDL": on, "launch_pdl": on}
