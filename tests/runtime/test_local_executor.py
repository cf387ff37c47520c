"""LocalExecutor (PP = 1): a real stage in the driver's process, and the I2 check at its boundary."""
from __future__ import annotations

import functools

import pytest

from pipespec.config import EngineConfig
from pipespec.engine.scheduler import Scheduler
from pipespec.checkpoint.source import resolve_model
from pipespec.runtime.executor import LocalExecutor
from pipespec.runtime.transport import StageError
from pipespec.stage import Stage
from tests.helpers import make_request

MAX_LEN = 64


def _executor(folder, driver_k: int, stage_config: EngineConfig) -> LocalExecutor:
    source = resolve_model(str(folder))
    return LocalExecutor(functools.partial(Stage, source, stage_config, (0, source.arch.num_layers), MAX_LEN),
                         source.arch.hidden_size, driver_k)


def _config(folder, head=None, k: int = 0) -> EngineConfig:
    spec = {"method": "mtp", "num_speculative_tokens": k, "model": str(head)} if k else None
    return EngineConfig.from_kwargs(model=str(folder), dtype="float32", device="cpu", num_kv_blocks=8,
                                    max_model_len=MAX_LEN, speculative_config=spec)


def test_local_executor_runs_the_stage_in_order(tiny_models):
    folder = tiny_models["llama"][0]
    config = _config(folder)
    ex = _executor(folder, 0, config)
    assert ex.max_in_flight == 1 and ex.available_cache().kv_blocks == 8
    ex.allocate_kv_cache(8)
    sched = Scheduler(config.scheduler, config.cache.block_size, 8, MAX_LEN)
    req = make_request("a", [5, 6, 7, 8, 9], max_tokens=3)
    sched.add(req)
    for _ in range(3):
        batch = sched.schedule()
        ex.submit(batch.plan)
        res = ex.receive(timeout=5.0)
        assert res.step_id == batch.plan.step_id
        (token,) = res.tokens(0)
        sched.complete(batch, res)
        req.token_ids.append(token)
    assert req.num_computed_tokens == 7 and len(req.token_ids) == 8
    ex.shutdown()


def test_the_result_width_follows_the_plans_k_and_a_k_beyond_the_stages_is_refused(tiny_llama_head):
    """I2: a result row is (K+1) + 1 + K wide for the K the plan names (adaptive K may name less than
    the config's), so a stage configured for K = 2 answers a plan for K = 1 with rows of width 4; a
    plan asking for more drafts than the stage was configured for is refused by name."""
    folder, head = tiny_llama_head
    ex = _executor(folder, 2, _config(folder, head, k=2))
    ex.allocate_kv_cache(8)
    config = _config(folder, head, k=1)
    sched = Scheduler(config.scheduler, config.cache.block_size, 8, MAX_LEN, num_spec_tokens=1)
    sched.add(make_request("a", [5, 6, 7], max_tokens=3))
    ex.submit(sched.schedule().plan)
    assert tuple(ex.receive(timeout=5.0).data.shape) == (1, 4)
    ex.shutdown()

    ex = _executor(folder, 1, _config(folder, head, k=1))
    ex.allocate_kv_cache(8)
    sched = Scheduler(config.scheduler, config.cache.block_size, 8, MAX_LEN, num_spec_tokens=2)
    sched.add(make_request("a", [5, 6, 7], max_tokens=3))
    with pytest.raises(StageError, match=r"step 1 asks for K=2; stage 0 is configured for K <= 1"):
        ex.submit(sched.schedule().plan)
    ex.shutdown()
