"""How many CPU threads each pipeline stage runs.

The cores a process may use are its CPU affinity (`os.sched_getaffinity`: taskset, cpusets), capped
by a cgroup CPU quota (containers), not the machine's core count. Stages on one machine share those
cores, so each gets an equal share and the threads never outnumber the cores: an OpenMP thread that
waits for a core holds up every other thread of the same operation (RESULTS.md has the figures).
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)


def threads_per_stage(cores: int, stages: int) -> int:
    """Threads of each of `stages` stages sharing `cores` cores: an equal share, at least one."""
    return max(1, cores // max(1, stages))


def capped_threads(current: int, cores: int) -> int:
    """A single stage in the caller's process keeps its thread count (a count set lower on purpose
    stays), but never more than the usable cores."""
    return max(1, min(current, cores))


def usable_cores(cgroup_root: Path = Path("/sys/fs/cgroup")) -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = cgroup_cpu_quota(cgroup_root)
    return max(1, min(cores, int(quota))) if quota is not None else cores


def cgroup_cpu_quota(root: Path) -> float | None:
    """CPUs' worth of time the cgroup may use (cgroup v2 cpu.max, or v1 cfs quota); None: no limit."""
    try:
        v2 = root / "cpu.max"
        if v2.exists():
            quota, period = v2.read_text().split()[:2]
            return None if quota == "max" else int(quota) / int(period)
        v1 = root / "cpu" / "cpu.cfs_quota_us"
        if v1.exists():
            quota = int(v1.read_text())
            period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
            return None if quota <= 0 else quota / period
    except (OSError, ValueError):
        return None
    return None


def stage_threads(asked: int | None, on_cpu: bool, stages: int) -> int | None:
    """Threads of each stage of a pipeline whose `stages` stages share this machine's cores:
    `asked` (--threads-per-stage) if given, else an equal share of the usable cores; None off CPU."""
    if asked is not None or not on_cpu:
        return asked
    cores = usable_cores()
    threads = threads_per_stage(cores, stages)
    logger.info("CPU threads: %d per stage (%d usable cores, %d stage(s) sharing them; "
                "--threads-per-stage overrides)", threads, cores, stages)
    return threads
