"""An all-reduce for the TP ranks of one host that reads the peers' buffers directly (NVLink), for
the small sums of decode steps.

Why: a TP = 2 decode step of an 8B model issues ~65 all-reduces of one small row, and NCCL's fixed
cost per call adds up to a large share of what splitting the weights saves (RESULTS.md, TP = 2).
PyTorch's symmetric memory maps every rank's buffer into every other rank, and its one-shot
all-reduce has each rank copy its input into its own buffer, meet the others at a device-side
barrier, and sum everyone's buffer itself: one kernel, no host, captured by CUDA graphs like any.

Sums larger than `max_bytes` (prefill chunks) and dtypes other than the buffer's still go through
NCCL. Setting up is a collective probe over the TP group's NCCL group: the fast path is used only if
every rank set it up and it gave NCCL's sum on every rank, so the ranks never disagree on which
path a collective takes. Opt-in: `custom_all_reduce=True` (`--custom-all-reduce`).
"""
from __future__ import annotations

import logging
import uuid

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

MAX_BYTES = 1 << 20   # one-shot reads every peer's whole buffer: past ~1 MiB NCCL's ring wins


class OneHostAllReduce:
    def __init__(self, buffer: torch.Tensor | None, group_name: str, group=None):
        self.buffer, self.group_name, self._group = buffer, group_name, group

    def handles(self, x: torch.Tensor) -> bool:
        return x.dtype == self.buffer.dtype and x.numel() <= self.buffer.numel() and x.is_cuda

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of `x` over the group, into `x` (contiguous, `handles(x)`)."""
        staging = self.buffer[: x.numel()].view(x.shape)   # the op wants the buffer in x's shape
        total = torch.ops.symm_mem.one_shot_all_reduce_copy(staging, x, "sum", self.group_name)
        return x.copy_(total)

    @classmethod
    def create(cls, store: dist.Store, nccl_group, stage: int, tp_rank: int, tp_size: int,
               device: torch.device, dtype: torch.dtype, max_bytes: int = MAX_BYTES) -> OneHostAllReduce | None:
        """Set up on every rank of the stage's TP group (collective); None where any rank could not,
        or the probe's sum differed from NCCL's (a log line says why)."""
        store = dist.PrefixStore(f"one-host-ar/{stage}", store)
        if tp_rank == 0:     # one name per engine: a process may build several engines in turn
            store.set("name", f"pipespec-tp{stage}-{uuid.uuid4().hex[:12]}")
        name = store.get("name").decode()
        # Every rank issues the same NCCL collectives in the same order whatever fails where (a rank
        # that skipped the probe's sum would meet its peer's probe with its vote: mismatched sums):
        # a vote that the set-up worked everywhere, then the probe, then a vote on its result.
        made, why = None, ""
        try:
            made = cls._register(store, nccl_group, name, tp_rank, tp_size)
            made._map(store, tp_rank, tp_size, device, dtype, max_bytes)
        except Exception as e:   # noqa: BLE001 - a capability probe: any failure means "use NCCL"
            why = f"{type(e).__name__}: {e}"
        if not _everywhere(nccl_group, not why, device):
            why = why or "another rank could not set it up"
        else:
            # small integers: every order of summing them gives the same, exactly
            probe = (torch.arange(1000, device=device) % 8 + tp_rank).to(dtype)
            want = probe.clone()
            nccl_group.allreduce([want]).wait()
            try:
                if not torch.equal(made.all_reduce(probe.clone()), want):
                    why = "its probe sum differed from NCCL's"
            except Exception as e:   # noqa: BLE001 - as above
                why = f"{type(e).__name__}: {e}"
            if not _everywhere(nccl_group, not why, device):
                why = why or "another rank's probe sum differed from NCCL's"
        if why:
            if made is not None:
                made.close()
            logger.info("TP stage %d: the one-host all-reduce is off (%s); NCCL's all-reduce serves every sum",
                        stage, why)
            return None
        if tp_rank == 0:
            logger.info("TP stage %d: one-host all-reduce (symmetric memory, one-shot) for sums up to %d KiB, "
                        "NCCL above", stage, max_bytes >> 10)
        return made

    @classmethod
    def _register(cls, store, nccl_group, name: str, rank: int, size: int) -> OneHostAllReduce:
        from torch._C._distributed_c10d import ProcessGroup, _register_process_group

        # The symmetric-memory ops find their group by name in c10d's registry, where only groups
        # made by `dist.new_group` are; the stage's TP group is a bare NCCL backend: register a
        # ProcessGroup over it under this engine's name (what `new_group` does inside).
        group = ProcessGroup(store, rank, size)
        group._register_backend(torch.device("cuda"), ProcessGroup.BackendType.NCCL, nccl_group)
        group._set_default_backend(ProcessGroup.BackendType.NCCL)
        group._set_group_name(name)
        _register_process_group(name, group)
        return cls(None, name, group)          # registered: close() unregisters it, whatever follows

    def _map(self, store, rank: int, size: int, device: torch.device, dtype: torch.dtype, max_bytes: int) -> None:
        """Allocate this rank's buffer and map every peer's (collective)."""
        from torch.distributed import _symmetric_memory as symm

        symm._SymmetricMemory.set_group_info(self.group_name, rank, size, store)
        self.buffer = symm.empty(max_bytes // torch.tensor([], dtype=dtype).element_size(), dtype=dtype,
                                 device=device)
        symm.rendezvous(self.buffer, self.group_name)

    def close(self) -> None:
        """Unregister the group's name (the NCCL group itself is the stage's to shut down)."""
        from torch._C._distributed_c10d import _unregister_process_group
        if self._group is not None:
            _unregister_process_group(self.group_name)
            self._group = self.buffer = None


def _everywhere(nccl_group, ok: bool, device: torch.device) -> bool:
    """Whether `ok` holds on every rank of the group (a MIN over it)."""
    vote = torch.tensor([int(ok)], dtype=torch.int32, device=device)
    nccl_group.allreduce([vote], _min_op()).wait()
    return bool(vote.item())


def _min_op():
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MIN
    return opts
