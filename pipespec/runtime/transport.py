"""Point-to-point messages between pipeline ranks, with every shape derived from the plan (I2) and
every wait bounded (I7).

Messages of one step:

- driver -> each worker: a plan header (int64 [HEADER_LEN]: op, step id and every field's kind and
  shape), then, for a PLAN op, one int64 payload whose length and layout follow from the header
  alone (float32 fields travel bit-cast, so nothing is rounded);
- stage r -> stage r+1: the activations, [2, T, hidden] in the stage dtype (hidden and residual);
- last stage -> driver: the StepResult, int64 `plan_result_shape(plan)`: [B, result_width(K)], wider when
  the plan asks for logprobs and with a row more per prompt-logprob row (all known from the plan).

Two process groups carry them: `ctrl` (gloo, CPU tensors: plans and results) and `data` (the
activations: gloo on CPU, NCCL on CUDA). A gloo wait that times out closes its connection, so a
timeout is always final: it becomes a StageError and the pipeline is torn down.
"""
from __future__ import annotations

import datetime
import enum
from collections import deque
from dataclasses import fields

import torch

from pipespec.parallel import is_nccl
from pipespec.plan import StepPlan
from pipespec.runtime import symmetry
from pipespec.runtime.symmetry import CollectiveMismatch
from pipespec.sampling import SamplingTensors

# How long a worker waits for the next plan. Idle is not failure (a server may wait hours for a
# request); a driver that dies closes its connections, which ends this wait at once.
IDLE_TIMEOUT = 365 * 24 * 3600.0


class StageError(RuntimeError):
    """A pipeline stage failed, died or stopped answering."""


class Op(enum.IntEnum):
    PLAN = 1        # a step: payload, then activations, follow
    STOP = 2        # leave the worker loop
    SYMMETRY = 3    # publish the symmetry report to the store (debug check)
    STATS = 4       # publish busy-time counters to the store


# -- plan wire format -----------------------------------------------------------------------------
# The header describes every field of the plan (StepPlan's dataclass fields, SamplingTensors' nested)
# in their declaration order, SLOT int64 each: [kind, dtype or value, ndim, d0, d1]. The payload is
# the fields' tensors back to back, as int64 (float32 bit-cast through int32, so nothing is rounded),
# so its length and layout follow from the header alone. A field added to StepPlan travels without
# any change here, as long as it is a tensor of at most 2 dimensions, a scalar or None.

_SLOT = 5
_PREFIX = 3                                   # op, step_id, number of fields
_NONE, _TENSOR, _BOOL, _INT = 0, 1, 2, 3
_WIRE_DTYPES = (torch.int64, torch.float32, torch.int32, torch.bool)
_DTYPE_CODE = {dt: i for i, dt in enumerate(_WIRE_DTYPES)}
_NESTED = {"sampling": SamplingTensors}       # plan fields that are dataclasses of their own
_PREFIXED = ("step_id",)                     # travels in the header prefix


def _plan_slots() -> list[str]:
    slots = []
    for f in fields(StepPlan):
        if f.name in _PREFIXED:
            continue
        if f.name in _NESTED:
            slots += [f"{f.name}.{g.name}" for g in fields(_NESTED[f.name])]
        else:
            slots.append(f.name)
    return slots


_SLOTS = _plan_slots()
HEADER_LEN = 192
if _PREFIX + _SLOT * len(_SLOTS) > HEADER_LEN:
    raise ImportError(f"a plan of {len(_SLOTS)} fields does not fit the {HEADER_LEN}-slot header")


def control_header(op: Op) -> torch.Tensor:
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    header[0] = int(op)
    return header


def _get(plan: StepPlan, name: str):
    obj = plan
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def _slots(header: torch.Tensor) -> list[tuple[str, list[int]]]:
    values = header.tolist()
    count = values[2]
    if count != len(_SLOTS):
        raise StageError(f"the plan header describes {count} fields, this rank's StepPlan has "
                         f"{len(_SLOTS)}: the ranks run different versions of pipespec")
    return [(name, values[_PREFIX + i * _SLOT:_PREFIX + (i + 1) * _SLOT]) for i, name in enumerate(_SLOTS)]


def payload_len(header: torch.Tensor) -> int:
    n = 0
    for _, (kind, _, ndim, d0, d1) in _slots(header):
        if kind == _TENSOR:
            n += (d0 if ndim >= 1 else 1) * (d1 if ndim == 2 else 1)
    return n


def pack_plan(plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """(header, payload) of a plan."""
    header = control_header(Op.PLAN)
    header[1] = plan.step_id
    header[2] = len(_SLOTS)
    parts = []
    for i, name in enumerate(_SLOTS):
        value = _get(plan, name)
        at = _PREFIX + i * _SLOT
        if value is None:
            continue                                    # kind _NONE: all zeros
        if isinstance(value, bool):
            header[at:at + 2] = torch.tensor([_BOOL, int(value)])
        elif isinstance(value, int):
            header[at:at + 2] = torch.tensor([_INT, value])
        elif isinstance(value, torch.Tensor):
            if value.dtype not in _DTYPE_CODE or value.dim() > 2:
                raise StageError(f"plan field {name} is a {value.dim()}-d {value.dtype} tensor; the wire "
                                 f"format takes at most 2-d tensors of {', '.join(map(str, _WIRE_DTYPES))}")
            dims = list(value.shape) + [0] * (2 - value.dim())
            header[at:at + _SLOT] = torch.tensor([_TENSOR, _DTYPE_CODE[value.dtype], value.dim(), *dims])
            flat = value.detach().reshape(-1).to("cpu")
            if value.dtype == torch.float32:
                flat = flat.view(torch.int32)
            parts.append(flat.to(torch.int64))
        else:
            raise StageError(f"plan field {name} holds a {type(value).__name__}, which cannot travel "
                             "to the stages (tensors, ints, bools and None can)")
    return header, torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)


def unpack_plan(header: torch.Tensor, payload: torch.Tensor) -> StepPlan:
    values, at = {}, 0
    for name, (kind, code, ndim, d0, d1) in _slots(header):
        if kind == _NONE:
            values[name] = None
        elif kind == _BOOL:
            values[name] = bool(code)
        elif kind == _INT:
            values[name] = code
        else:
            shape = (d0, d1)[:ndim]
            n = (d0 if ndim >= 1 else 1) * (d1 if ndim == 2 else 1)
            chunk, at = payload[at:at + n], at + n
            dtype = _WIRE_DTYPES[code]
            if dtype == torch.float32:
                chunk = chunk.to(torch.int32).view(torch.float32)
            elif dtype != torch.int64:
                chunk = chunk.to(dtype)
            values[name] = chunk.reshape(shape)
    kwargs = {"step_id": int(header[1])}
    for name, value in values.items():
        if "." not in name:
            kwargs[name] = value
    for field_name, klass in _NESTED.items():
        prefix = field_name + "."
        kwargs[field_name] = klass(**{k[len(prefix):]: v for k, v in values.items() if k.startswith(prefix)})
    return StepPlan(**kwargs)


# -- the link ------------------------------------------------------------------------------------


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


class Link:
    """This rank's point-to-point messages over the ctrl and data groups.

    `send` is asynchronous: the returned handle keeps the buffer alive until `wait`ed. `recv` blocks
    for at most `timeout` seconds. With `check` (`check_collectives`) every message is
    preceded by its descriptor and checked against the receiver's expectation before it is received.
    """

    def __init__(self, rank: int, ctrl_pg, data_pg, data_device: torch.device, check: bool = False):
        self.rank = rank
        self.groups = {"ctrl": ctrl_pg, "data": data_pg}
        self.data_device = data_device
        # gloo carries CPU tensors only: activations on a GPU go through host memory unless NCCL
        self.data_on_host = data_device.type != "cpu" and not is_nccl(data_pg)
        self.recorder = symmetry.SymmetryRecorder(rank) if check else None

    @property
    def check(self) -> bool:
        return self.recorder is not None

    def _group(self, op: str) -> str:
        return "data" if op == "activations" else "ctrl"

    def send(self, tensor: torch.Tensor, dst: int, op: str) -> "Pending":
        group = self._group(op)
        pg = self.groups[group]
        if group == "data" and self.data_on_host:
            tensor = tensor.to("cpu")
        tensor = tensor.contiguous()
        works, keep = [], [tensor]
        on_gpu = is_nccl(pg)
        if self.recorder is not None:
            seq = self.recorder.record("send", group, dst, op, tensor.shape, tensor.dtype)
            desc = symmetry.encode(seq, op, tensor.shape, tensor.dtype)
            if group == "data" and not self.data_on_host and tensor.device.type != "cpu":
                desc = desc.to(tensor.device)
            keep.append(desc)
            works.append(pg.send([desc], dst, 0))
        works.append(pg.send([tensor], dst, 0))
        return Pending(works, keep, f"{op} to rank {dst}", on_gpu)

    def recv(self, shape, dtype: torch.dtype, src: int, op: str, timeout: float) -> torch.Tensor:
        group = self._group(op)
        pg = self.groups[group]
        device = self.data_device if group == "data" and not self.data_on_host else torch.device("cpu")
        if self.recorder is not None:
            seq = self.recorder.record("recv", group, src, op, shape, dtype)
            desc = torch.empty(symmetry.DESCRIPTOR_LEN, dtype=torch.int64, device=device)
            _wait(pg.recv([desc], src, 0), timeout, f"{op} descriptor from rank {src}", is_nccl(pg))
            got = symmetry.decode(desc.cpu())
            want = (seq, op, tuple(shape), dtype)
            if got != want:
                raise CollectiveMismatch(
                    f"rank {self.rank} expected to receive {symmetry.describe(op, shape, dtype)} (#{seq}) "
                    f"from rank {src}, but rank {src} sent {symmetry.describe(got[1], got[2], got[3])} "
                    f"(#{got[0]})")
        buf = torch.empty(tuple(shape), dtype=dtype, device=device)
        _wait(pg.recv([buf], src, 0), timeout, f"{op} from rank {src}", is_nccl(pg))
        if group == "data" and self.data_on_host:
            buf = buf.to(self.data_device)
        return buf


class Pending:
    """Sends in flight; their buffers stay referenced until they complete."""

    def __init__(self, works, keep, what: str, on_gpu: bool = False):
        self.works, self.keep, self.what, self.on_gpu = works, keep, what, on_gpu

    def wait(self, timeout: float) -> None:
        for work in self.works:
            _wait(work, timeout, self.what, self.on_gpu, sending=True)
        self.works, self.keep = [], []


class SendQueue:
    """Bounded set of outstanding sends. With at most `depth` steps in flight, a send older than that
    has been received already, so waiting on it costs nothing."""

    def __init__(self, depth: int, timeout: float):
        self.depth, self.timeout = depth, timeout
        self._q: deque[Pending] = deque()

    def add(self, pending: Pending) -> None:
        self._q.append(pending)
        while len(self._q) > self.depth:
            self._q.popleft().wait(self.timeout)

    def drain(self, timeout: float | None = None) -> None:
        while self._q:
            self._q.popleft().wait(self.timeout if timeout is None else timeout)


def _wait(work, timeout: float, what: str, on_gpu: bool = False, sending: bool = False) -> None:
    """Wait for a message, at most `timeout` seconds.

    An NCCL transfer is waited for on the GPU, not the host: `wait()` without a timeout only orders
    the current stream after it, so a stage enqueues its step while the activations are still on
    their way (given a timeout, NCCL's wait polls from the host in millisecond sleeps, which costs
    every pipeline step: RESULTS.md). Such a wait is bounded all the same: the NCCL group's
    watchdog aborts a transfer older than the stage timeout (`launch.data_group`), and the host's
    next read of a result (gloo, with a timeout) fails then.
    """
    try:
        if on_gpu:
            work.wait()
            return
        work.wait(_td(timeout))
    except RuntimeError as e:
        text = str(e)
        verb = "sending" if sending else "waiting for"
        if "Timed out" in text or "timeout" in text.lower():
            raise StageError(f"no answer within {timeout:g}s while {verb} {what}") from None
        raise StageError(f"connection lost while {verb} {what}: {_first_line(text)}") from None


def _first_line(text: str) -> str:
    line = text.strip().splitlines()[0] if text.strip() else text
    # gloo prefixes its messages with the source file and appends generic advice: keep the fact
    line = line.split("] ", 1)[-1] if line.startswith("[") else line
    return line.split(". This is typically", 1)[0]



def library_text(exc: BaseException) -> str:
    """An exception from torch.distributed (gloo, NCCL) in one line: its type and first fact, without
    the source-file prefix and the generic advice."""
    return f"{type(exc).__name__}: {_first_line(str(exc))}"
