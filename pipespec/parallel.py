"""TensorParallel: one rank's place in its stage's tensor-parallel (TP) group, and the group's
collectives.

A stage of a TP = T engine is T ranks that split heads, the intermediate size and the vocabulary,
and sum their partial results with an all-reduce (or gather vocabulary slices in rank order).
Model code holds a `TensorParallel` given to it explicitly at construction (never a module global)
and calls `all_reduce` / `all_gather`; it never sees a process or a store. The runtime creates the
process group (`runtime/launch.py::tp_group`) once the stage is on its device and `attach`es it.

With size 1 every collective is the identity and no group is needed: `TensorParallel()` is what a
single-GPU or pure-pipeline stage gets.

Collectives go through the process group object itself (`group.allreduce`, `group.allgather`), a
gloo group on CPU and an NCCL group on CUDA. Every wait is bounded: a gloo wait by the group's
timeout (the stage timeout), an NCCL one by its watchdog at the same timeout. An NCCL all-reduce on
the current stream is captured by CUDA graphs like any kernel (`stage/cuda_graphs.py`).
"""
from __future__ import annotations

import time
from typing import Callable

import torch


class TensorParallel:
    def __init__(self, rank: int = 0, size: int = 1):
        if not (isinstance(size, int) and size >= 1 and 0 <= rank < size):
            raise ValueError(f"a tensor-parallel rank must be in [0, size), got rank {rank} of {size}")
        self.rank, self.size = rank, size
        self._group = None
        self._fast = None        # runtime/one_host_all_reduce.py: small sums on one host
        # debug (check_collectives): called with (op, shape, dtype) before every collective; it may
        # raise (the runtime's checker compares the group's descriptors, runtime/symmetry.py)
        self._record: Callable[[str, tuple, torch.dtype], None] | None = None

    def __repr__(self) -> str:
        return f"TensorParallel(rank={self.rank}, size={self.size})"

    def attach(self, group, record: Callable | None = None, fast=None) -> None:
        """The group's process group (gloo or NCCL, `size` ranks, this one `rank`); `record` logs
        each collective for the symmetry check; `fast`: a `OneHostAllReduce` for the sums it
        handles (every rank of the group has one, or none has)."""
        if self.size == 1:
            raise ValueError("a TP group of one rank needs no process group")
        if group is not None and group.size() != self.size:
            raise ValueError(f"a process group of {group.size()} ranks for a TP group of {self.size}")
        self._group, self._record, self._fast = group, record, fast

    def abort(self) -> None:
        """Abort the group's communicator (NCCL: ends a collective stuck on a dead peer, also one
        replayed from a CUDA graph, which NCCL's watchdog does not watch). The group is unusable after."""
        abort = getattr(self._group, "abort", None) or getattr(self._group, "_abort", None)
        if abort is not None:
            try:
                abort()
            except Exception:   # noqa: BLE001 - best effort on a path that is failing anyway
                pass

    def finish_within(self, timeout: float, what: str) -> None:
        """Wait, at most `timeout` seconds, for the work enqueued on the current CUDA stream.

        A collective captured in a CUDA graph is not watched by NCCL's watchdog: if a TP peer dies
        during a replay, the replay never ends, and a plain host sync (the result's copy to the host)
        would block for ever. So a TP stage on CUDA polls an event instead; past the timeout it aborts
        the communicator (which ends the stuck kernel) and raises, and the runtime reports the stage.
        """
        done = torch.cuda.Event()
        done.record()
        deadline = time.monotonic() + timeout
        while not done.query():
            if time.monotonic() > deadline:
                self.abort()
                raise TimeoutError(f"{what} did not finish on the GPU within {timeout:g}s (a tensor-parallel peer "
                                   "died or stopped?)")
            time.sleep(0)

    def close(self) -> None:
        """Shut the group down now (NCCL: destroys its communicator), rather than in its destructor
        at some later garbage collection, where an NCCL group's implicit abort was seen to hang for
        tens of seconds. Destroy the CUDA graphs that captured its collectives first
        (`Stage.close` keeps the order): a communicator is not freed while captured work holds it."""
        group, self._group, self._record = self._group, None, None
        if self._fast is not None:
            self._fast.close()
            self._fast = None
        shutdown = getattr(group, "shutdown", None) if is_nccl(group) else None
        if shutdown is not None:
            if torch.cuda.is_initialized():
                torch.cuda.synchronize()      # nothing of ours still running on the communicator
            shutdown()

    # -- how a dimension is split ---------------------------------------------------------------

    def split(self, n: int, what: str) -> tuple[int, int]:
        """(start, length) of this rank's share of `n` items that must divide evenly (heads, the
        intermediate size): a clear error names what does not."""
        if n % self.size:
            raise ValueError(f"{what}={n} is not divisible by tensor_parallel_size={self.size}; "
                             f"choose a tensor_parallel_size that divides it")
        per = n // self.size
        return self.rank * per, per

    def vocab_range(self, vocab: int) -> tuple[int, int]:
        """(start, rows) of this rank's slice of a vocabulary padded to a multiple of the size; the
        last rank's slice may hold padding rows past `vocab` (zero, never looked up)."""
        per = -(-vocab // self.size)
        return self.rank * per, per

    # -- collectives ----------------------------------------------------------------------------

    def _check(self, op: str, x: torch.Tensor) -> None:
        if self._group is None:
            raise RuntimeError(f"TP rank {self.rank} of {self.size}: {op} before the TP process group "
                               "was attached")
        if self._record is not None:
            self._record(op, tuple(x.shape), x.dtype)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of `x` over the group, in place (x contiguous); identity for size 1."""
        if self.size == 1:
            return x
        self._check("tp.all_reduce", x)
        if not x.is_contiguous():
            x = x.contiguous()
        if self._fast is not None and self._fast.handles(x):
            return self._fast.all_reduce(x)
        self._group.allreduce([x]).wait()
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` concatenated along the last dimension in rank order (the same bytes on
        every rank); identity for size 1."""
        if self.size == 1:
            return x
        self._check("tp.all_gather", x)
        x = x.contiguous()
        outs = [torch.empty_like(x) for _ in range(self.size)]
        self._group.allgather([outs], [x]).wait()
        return torch.cat(outs, dim=-1)


def is_nccl(group) -> bool:
    """Whether a process group (or backend) is NCCL's: its collectives run on the GPU."""
    return type(group).__name__ == "ProcessGroupNCCL"
