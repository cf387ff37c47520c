"""CPU threads per stage: an equal share of the cores the process may use, never oversubscribed."""
import os

import pytest

from pipespec.runtime.cpu_threads import (capped_threads, cgroup_cpu_quota, stage_threads, threads_per_stage,
                                          usable_cores)


@pytest.mark.parametrize("cores,stages,want", [(2, 1, 2), (2, 2, 1), (2, 3, 1), (16, 3, 5), (16, 4, 4), (1, 1, 1),
                                               (8, 0, 8)])
def test_threads_per_stage_share_the_cores(cores, stages, want):
    got = threads_per_stage(cores, stages)
    assert got == want
    assert got * max(stages, 1) <= max(cores, max(stages, 1))     # never more threads than cores (or stages)


def test_a_single_local_stage_keeps_a_lower_count_but_never_exceeds_the_cores():
    assert capped_threads(current=1, cores=8) == 1
    assert capped_threads(current=64, cores=2) == 2
    assert capped_threads(current=0, cores=2) == 1


def test_cgroup_quota(tmp_path):
    assert cgroup_cpu_quota(tmp_path) is None                          # no cgroup files: no limit
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_quota(tmp_path) is None
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert cgroup_cpu_quota(tmp_path) == 1.5
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpu_quota(v1) is None
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("300000\n")
    assert cgroup_cpu_quota(v1) == 3.0


def test_usable_cores_follow_affinity_and_quota(tmp_path):
    affinity = len(os.sched_getaffinity(0))
    assert usable_cores(tmp_path) == affinity
    (tmp_path / "cpu.max").write_text("150000 100000\n")              # 1.5 CPUs: one whole core
    assert usable_cores(tmp_path) == 1


def test_asked_threads_win_and_none_off_cpu():
    assert stage_threads(3, on_cpu=True, stages=2) == 3
    assert stage_threads(None, on_cpu=False, stages=2) is None
    assert stage_threads(None, on_cpu=True, stages=1) == usable_cores()
