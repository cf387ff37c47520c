"""The I3 debug check: every message between two ranks is sent and received as the same (op, shape,
dtype); and the I4 one: the first stage embeds the draft ids the last stage verifies.

Turned on with `check_collectives=True` (`PIPESPEC_CHECK_COLLECTIVES=1` sets the config's default).
Then each point-to-point message is preceded by a fixed-width descriptor `[seq, op, dtype, ndim,
d0..d3]`, and the receiver compares it with what it is about to receive, before receiving it: a
disagreement fails loudly on the spot, naming both sides, instead of hanging or silently reading
garbage (gloo accepts a short message into a longer buffer). Each rank also keeps, per peer and
direction, a count and a running digest of what it sent or received; `compare_reports` checks that
the two ends of every channel saw the same sequence, that the ranks of each tensor-parallel group
issued the same collectives (op, shape, dtype, in the same order), and that the stages' per-step
draft digests (`stage/trace.py`) agree.
"""
from __future__ import annotations

import hashlib
from collections import deque

import torch

DESCRIPTOR_LEN = 8
_MAX_DIMS = DESCRIPTOR_LEN - 4

OPS = ("plan.header", "plan.payload", "activations", "result", "tp.all_reduce", "tp.all_gather")
_OP_CODE = {name: i + 1 for i, name in enumerate(OPS)}
_DTYPES = (torch.int64, torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.uint8,
           torch.float64)
_DTYPE_CODE = {dt: i + 1 for i, dt in enumerate(_DTYPES)}


class CollectiveMismatch(RuntimeError):
    """Two ranks disagree about a message: a protocol bug (docs/architecture.md, I2/I3)."""


def describe(op: str, shape, dtype) -> str:
    return f"{op} {tuple(shape)} {str(dtype).removeprefix('torch.')}"


def encode(seq: int, op: str, shape, dtype) -> torch.Tensor:
    shape = tuple(shape)
    if len(shape) > _MAX_DIMS:
        raise ValueError(f"a message may have at most {_MAX_DIMS} dimensions, got {shape}")
    dims = list(shape) + [-1] * (_MAX_DIMS - len(shape))
    return torch.tensor([seq, _OP_CODE[op], _DTYPE_CODE[dtype], len(shape), *dims], dtype=torch.int64)


def decode(desc: torch.Tensor) -> tuple[int, str, tuple[int, ...], object]:
    seq, op, dt, ndim, *dims = desc.tolist()
    op_name = OPS[op - 1] if 1 <= op <= len(OPS) else f"<op {op}>"
    dtype = _DTYPES[dt - 1] if 1 <= dt <= len(_DTYPES) else f"<dtype {dt}>"
    shape = tuple(dims[:ndim]) if 0 <= ndim <= _MAX_DIMS else (f"<ndim {ndim}>",)
    return seq, op_name, shape, dtype


class _ChannelLog:
    __slots__ = ("count", "digest", "last")

    def __init__(self):
        self.count = 0
        self.digest = hashlib.blake2b(digest_size=12)
        self.last: deque[str] = deque(maxlen=6)

    def add(self, entry: str) -> int:
        seq = self.count
        self.count += 1
        self.digest.update(entry.encode() + b"\n")
        self.last.append(f"#{seq} {entry}")
        return seq


class SymmetryRecorder:
    """(op, shape, dtype) of every message this rank sent or received, per group, peer and direction."""

    def __init__(self, rank: int):
        self.rank = rank
        self._logs: dict[tuple[str, str, int], _ChannelLog] = {}

    def record(self, direction: str, group: str, peer: int, op: str, shape, dtype) -> int:
        """Log one message; returns its sequence number on that channel."""
        key = (direction, group, peer)
        log = self._logs.get(key)
        if log is None:
            log = self._logs[key] = _ChannelLog()
        return log.add(describe(op, shape, dtype))

    def report(self) -> dict:
        """JSON-able summary: {"send|data|1": [count, digest, last entries], ...}."""
        return {f"{d}|{g}|{p}": [log.count, log.digest.hexdigest(), list(log.last)]
                for (d, g, p), log in sorted(self._logs.items())}


class CollectiveChecker:
    """I3 inside a tensor-parallel group, on the spot: before each collective every rank records
    (op, shape, dtype) and the group all-gathers the descriptors, so ranks about to issue different
    collectives fail loudly, naming both, instead of hanging or summing garbage. Inside a CUDA graph
    capture it only records (a capture cannot read the descriptors back; replays repeat what was
    checked at capture)."""

    def __init__(self, recorder: SymmetryRecorder, group, name: str, tp_rank: int, size: int, device):
        self.recorder, self.group, self.name = recorder, group, name
        self.tp_rank, self.size, self.device = tp_rank, size, device

    def __call__(self, op: str, shape, dtype) -> None:
        seq = self.recorder.record("coll", self.name, -1, op, shape, dtype)
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return
        desc = encode(seq, op, shape, dtype).to(self.device)
        descs = [torch.empty_like(desc) for _ in range(self.size)]
        self.group.allgather([descs], [desc]).wait()
        seen = [decode(d.cpu()) for d in descs]
        if any(s != seen[self.tp_rank] for s in seen):
            raise CollectiveMismatch(f"the {self.name} group's ranks are about to issue different collectives: " + "; ".join(
                f"TP rank {r}: {describe(s[1], s[2], s[3])} (#{s[0]})" for r, s in enumerate(seen)))


def _channels(report: dict) -> dict:
    return {k: v for k, v in report.items() if "|" in k}


def compare_draft_traces(reports: dict[int, dict]) -> list[str]:
    """I4: at every step with drafts, the draft ids the first stage embedded are the ones the last
    stage verified (each stage digests the draft rows of the plan it ran)."""
    first, last = min(reports), max(reports)
    embedded = reports[first].get("drafts", {}).get("embedded", {})
    verified = reports[last].get("drafts", {}).get("verified", {})
    problems = [f"step {step}: stage {first} embedded drafts {embedded.get(step, 'none')}, stage {last} "
                f"verified {verified.get(step, 'none')}"
                for step in sorted(set(embedded) | set(verified), key=int) if embedded.get(step) != verified.get(step)]
    return [f"I4 broken: {p}" for p in problems[:5]] + ([f"... {len(problems) - 5} more"] if len(problems) > 5 else [])


def compare_collectives(reports: dict[int, dict]) -> list[str]:
    """I3 inside a TP group: every rank of the group issued the same collectives in the same order."""
    groups: dict[str, dict[int, list]] = {}
    for rank, report in reports.items():
        for key, value in report.items():
            if key.startswith("coll|"):
                groups.setdefault(key.split("|")[1], {})[rank] = value
    problems = []
    for group, seen in sorted(groups.items()):
        if len({(count, digest) for count, digest, _ in seen.values()}) > 1:
            problems.append(f"{group} group: its ranks issued different collectives: " + "; ".join(
                f"rank {r}: {count} (last: {', '.join(last) or '-'})" for r, (count, _, last) in sorted(seen.items())))
    return problems


def compare_reports(reports: dict[int, dict]) -> list[str]:
    """Problems found between the ends of every channel, inside every TP group, and in the draft
    traces (empty when all ranks agree)."""
    problems = compare_draft_traces(reports) + compare_collectives(reports)
    reports = {rank: _channels(report) for rank, report in reports.items()}
    for rank, report in sorted(reports.items()):
        for key, (count, digest, last) in report.items():
            direction, group, peer = key.split("|")
            if direction != "send":
                continue
            other = reports.get(int(peer), {}).get(f"recv|{group}|{rank}", [0, None, []])
            if (count, digest) != (other[0], other[1]):
                problems.append(
                    f"{group} channel rank {rank} -> rank {peer}: rank {rank} sent {count} messages "
                    f"(last: {'; '.join(last) or '-'}), rank {peer} received {other[0]} "
                    f"(last: {'; '.join(other[2]) or '-'})")
        for key, (count, _, last) in report.items():
            direction, group, peer = key.split("|")
            if direction == "recv" and f"send|{group}|{rank}" not in reports.get(int(peer), {}):
                problems.append(f"{group} channel rank {peer} -> rank {rank}: rank {rank} received "
                                f"{count} messages that rank {peer} never sent (last: {'; '.join(last)})")
    return problems
