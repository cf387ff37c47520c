"""PipelineExecutor on its own: the symmetry check (I3) on a deliberately mismatched pipeline.

Stage 1 is built in bfloat16 while stage 0 sends float32 activations, as two ranks launched with
different settings would be: the checked receiver names both sides of the disagreement, and the
driver reports it as that stage's failure.
"""
from __future__ import annotations

import functools
import os

import pytest

from pipespec.config import EngineConfig
from pipespec.engine.scheduler import Scheduler
from pipespec.checkpoint.source import resolve_model
from pipespec.runtime.launch import pid_alive
from pipespec.runtime.pipeline_executor import PipelineExecutor
from pipespec.runtime.transport import StageError
from pipespec.runtime.worker import WorkerSettings
from pipespec.stage import Stage
from tests.helpers import make_request

MAX_LEN = 128


def _config(folder, dtype: str) -> EngineConfig:
    return EngineConfig.from_kwargs(model=str(folder), dtype=dtype, device="cpu", num_kv_blocks=16,
                                    max_model_len=MAX_LEN)


def test_symmetry_check_catches_mismatched_stages(tiny_models):
    folder = tiny_models["llama"][0]
    source = resolve_model(str(folder))
    f32, bf16 = _config(folder, "float32"), _config(folder, "bfloat16")
    factories = [functools.partial(Stage, source, f32, (0, 2), MAX_LEN),
                 functools.partial(Stage, source, bf16, (2, 3), MAX_LEN)]
    settings = WorkerSettings(num_stages=2, hidden_size=source.arch.hidden_size, num_spec_tokens=0, stage_timeout=20,
                              startup_timeout=120, backend="gloo", threads=1, check=True)
    executor = PipelineExecutor(factories, settings)
    pids = executor.worker_pids
    try:
        assert executor.max_in_flight == 2
        executor.allocate_kv_cache(executor.available_cache().kv_blocks)
        sched = Scheduler(f32.scheduler, f32.cache.block_size, 16, MAX_LEN)
        sched.add(make_request("a", [5, 6, 7, 8, 9], max_tokens=2))
        executor.submit(sched.schedule().plan)
        with pytest.raises(StageError) as err:
            executor.receive(timeout=20)
    finally:
        executor.shutdown()
    msg = str(err.value)
    assert "pipeline stage 1 failed: CollectiveMismatch" in msg, msg
    assert ("rank 1 expected to receive activations (2, 5, 64) bfloat16 (#0) from rank 0, "
            "but rank 0 sent activations (2, 5, 64) float32 (#0)") in msg, msg
    assert executor.failed
    assert not any(pid_alive(p) for p in pids)


def _stage_reading_the_environment():
    raise RuntimeError("PIPESPEC_TEST_MARK=" + os.environ.get("PIPESPEC_TEST_MARK", "unset"))


def test_workers_see_the_drivers_environment_as_of_their_start(tiny_models, monkeypatch):
    """Workers fork from a fork server started with the first engine: each still gets the driver's
    environment of its own start (PIPESPEC_PDL, CUDA and OpenMP variables a program sets)."""
    folder = tiny_models["llama"][0]
    source = resolve_model(str(folder))
    settings = WorkerSettings(num_stages=2, hidden_size=source.arch.hidden_size, num_spec_tokens=0, stage_timeout=20,
                              startup_timeout=120, backend="gloo", threads=1)
    stage0 = functools.partial(Stage, source, _config(folder, "float32"), (0, 2), MAX_LEN)
    for mark in ("first", "second"):
        monkeypatch.setenv("PIPESPEC_TEST_MARK", mark)
        with pytest.raises(StageError, match=f"pipeline stage 1 failed while loading: .*PIPESPEC_TEST_MARK={mark}"):
            PipelineExecutor([stage0, _stage_reading_the_environment], settings)
