"""Programmatic dependent launch (PDL, sm_90 and later) for the decode path's Triton kernels.

A decode step is hundreds of small kernels in a row, each of which streams some weights and then
waits on the one before it for its activations. Launched with PDL, a kernel's programs may start
while the kernel before it is still finishing: they announce at once that the next kernel may start
too (`griddepcontrol.launch_dependents`), hint the weights they will read into L2, and only then
wait for the previous kernel's results (`griddepcontrol.wait`, which returns once that kernel has
completed and its writes are visible). The weight stream of kernel n + 1 thus overlaps the tail of
kernel n instead of starting after it.

What keeps it correct: before the wait a kernel reads nothing but weights (never written during
serving) and writes nothing, and every program waits before it reads an activation or stores; a
kernel launched without PDL (cuBLAS, PyTorch's own) waits for everything before it as usual. The
wait is transitive: a kernel completes only after its own wait returned, so the kernel after it
sees every earlier kernel's writes.

Where the GPU or the toolchain lacks it (before sm_90, the Triton interpreter), or
`PIPESPEC_PDL=0` is set, kernels are launched plainly and the constexpr `PDL` compiles the
instructions out.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def pdl_prefetch(ptrs, PDL: tl.constexpr):
    """Hint each address of `ptrs` into L2 (one 128-byte line each is enough); no data is read into
    registers, so nothing waits for it."""
    if PDL:
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                                  is_pure=False, pack=1)


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Let the next kernel start, then wait until the previous one has completed (its writes
    visible). Every program calls it before reading activations or storing anything."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()


@functools.cache
def _supported(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_on(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL (pass as both `PDL=` and `launch_pdl=`)."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1" or os.environ.get("PIPESPEC_PDL") == "0":
        return False
    return _supported(device.index if device.index is not None else torch.cuda.current_device())
