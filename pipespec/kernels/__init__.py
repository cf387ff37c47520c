"""Triton kernels for the GPU path: paged attention, KV writes and the fused elementwise ops.

Nothing here runs on CPU: callers ask `enabled(x)` and fall back to plain PyTorch. The kernels have
no backward, so they serve inference only (training keeps the differentiable PyTorch ops).
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib.util
import os
from dataclasses import dataclass

import torch

HAVE_TRITON = importlib.util.find_spec("triton") is not None
# TRITON_INTERPRET=1 runs the kernels on CPU tensors (slowly): how they are developed without a GPU
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def enabled(x: torch.Tensor) -> bool:
    """Whether the fused kernels serve this tensor: Triton present, a CUDA tensor, no autograd."""
    return (HAVE_TRITON and (x.is_cuda or _INTERPRET) and torch.is_inference_mode_enabled())


_PDL_SCOPE = contextvars.ContextVar("pipespec_pdl_scope", default=False)


@contextlib.contextmanager
def pdl_scope():
    """Kernels launched inside launch with programmatic dependent launch where the device has it
    (`kernels/pdl.py`): the CUDA-graph capture opens it. Here, not there, so that CPU-only code may
    open it without Triton."""
    token = _PDL_SCOPE.set(True)
    try:
        yield
    finally:
        _PDL_SCOPE.reset(token)


def in_pdl_scope() -> bool:
    return _PDL_SCOPE.get()


def serve_device(device: torch.device) -> bool:
    """Whether the kernels will serve tensors on `device` (decided once, at load)."""
    return HAVE_TRITON and (device.type == "cuda" or _INTERPRET)


def fused_routing_supported(num_experts: int, n_group: int = 1) -> bool:
    """Whether `moe_routing.route` takes this router: a power-of-two expert count (every released
    MoE this engine loads) that its groups divide."""
    return num_experts & (num_experts - 1) == 0 and num_experts % n_group == 0 and num_experts >= n_group


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for launch sizes on the host: triton.cdiv is a constexpr function there, costly to call."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The least power of two >= n (1 for n <= 1), for block sizes on the host (as `cdiv`)."""
    return 1 << (n - 1).bit_length() if n > 1 else 1


@functools.cache
def _sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """SMs of `device`, read once per device (the kernels size their grids by it at every call of an
    eager step); 132, a Hopper GPU's (sm_90), for the interpreter on CPU."""
    if device.type != "cuda":
        return 132
    return _sms(device.index if device.index is not None else torch.cuda.current_device())


@dataclass(frozen=True)
class SMLimits:
    """What one SM holds at once, which bounds how many programs of a kernel it runs together:
    registers, shared memory bytes (per block 1 KiB of it is the system's), threads, blocks. The
    defaults are a Hopper GPU's (sm_90), for the interpreter on CPU."""
    registers: int = 65536
    shared: int = 233472
    threads: int = 2048
    blocks: int = 32


@functools.cache
def _limits(index: int) -> SMLimits:
    p = torch.cuda.get_device_properties(index)
    return SMLimits(p.regs_per_multiprocessor, p.shared_memory_per_multiprocessor,
                    p.max_threads_per_multi_processor, SMLimits.blocks)


def sm_limits(device: torch.device) -> SMLimits:
    """`SMLimits` of `device`, read once per device; sm_90's defaults for the interpreter on CPU."""
    if device.type != "cuda":
        return SMLimits()
    return _limits(device.index if device.index is not None else torch.cuda.current_device())
