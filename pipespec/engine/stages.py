"""How the engine gets its stages: one Stage per pipeline rank, each with its own config (device), in
this process (PP = 1), in spawned workers, or in a torchrun world; and the entry point of a torchrun
rank > 0, which serves its stage until the driver stops it.
"""
from __future__ import annotations

import dataclasses
import functools
import logging

import torch

from pipespec.config import EngineConfig
from pipespec.model.placement import weights_dtype
from pipespec.model.source import ModelSource, resolve_model
from pipespec.runtime import launch
from pipespec.runtime.cpu_threads import capped_threads, stage_threads, usable_cores
from pipespec.runtime.executor import Executor, LocalExecutor
from pipespec.runtime.pipeline_executor import PipelineExecutor
from pipespec.runtime.worker import WorkerSettings, run_torchrun_worker
from pipespec.stage import Stage

logger = logging.getLogger(__name__)


def check_max_model_len(asked: int | None, model_max: int) -> int:
    if asked is None:
        return model_max
    if asked > model_max:
        raise ValueError(f"max_model_len={asked} exceeds the model's context length {model_max}")
    return asked


def _stage_config(config: EngineConfig, rank: int, env: launch.TorchrunEnv | None) -> EngineConfig:
    """Stage `rank`'s config: with PP > 1 on CUDA every stage gets its own GPU (cuda:rank on one
    machine, cuda:LOCAL_RANK under torchrun)."""
    p = config.parallel.pipeline_parallel_size
    device = config.model.device
    if p == 1:
        return config
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        return config if config.model.device == "cpu" else _with_device(config, "cpu")
    if device != "cuda":
        raise ValueError(f"with pipeline_parallel_size > 1 give device='cuda' (stage i then runs on "
                         f"cuda:i, or cuda:LOCAL_RANK under torchrun) or 'cpu', not {device!r}")
    if env is not None:
        return _with_device(config, f"cuda:{env.local_rank}")
    count = torch.cuda.device_count()
    if count == 0:
        raise ValueError("device 'cuda' was asked for, but CUDA is not available")
    if count < p:
        if config.parallel.distributed_backend != "gloo":
            raise ValueError(f"pipeline_parallel_size={p} on CUDA needs {p} GPUs, found {count} "
                             "(distributed_backend='gloo' lets stages share GPUs, for testing)")
        logger.warning("%d stages share %d GPU(s)", p, count)
    return _with_device(config, f"cuda:{rank % count}")


def _with_device(config: EngineConfig, device: str) -> EngineConfig:
    return dataclasses.replace(config, model=dataclasses.replace(config.model, device=device))


def _worker_settings(config: EngineConfig, hidden_size: int, env: launch.TorchrunEnv | None) -> WorkerSettings:
    par = config.parallel
    p = par.pipeline_parallel_size
    on_cpu = config.model.device == "cpu" or (config.model.device == "auto" and not torch.cuda.is_available())
    threads = stage_threads(par.threads_per_stage, on_cpu, env.local_world_size if env is not None else p)
    return WorkerSettings(world_size=p, hidden_size=hidden_size, num_spec_tokens=config.num_spec_tokens, stage_timeout=par.stage_timeout,
                          startup_timeout=par.startup_timeout, backend=par.distributed_backend,
                          threads=threads, check=par.check_collectives,
                          log_level=logging.getLogger("pipespec").getEffectiveLevel())


def _torchrun_env(config: EngineConfig) -> launch.TorchrunEnv | None:
    env = launch.torchrun_env()
    p = config.parallel.pipeline_parallel_size
    if env is not None and env.world_size != p:
        raise ValueError(f"launched by torchrun with WORLD_SIZE={env.world_size}, but "
                         f"pipeline_parallel_size is {p}; they must be equal")
    return env


def build_executor(config: EngineConfig, source: ModelSource, max_model_len: int) -> Executor:
    """LocalExecutor for one stage, PipelineExecutor (spawned workers or a torchrun world) for more."""
    par = config.parallel
    ranges = par.layer_ranges(source.arch.num_layers)
    if par.pipeline_parallel_size == 1:
        torch.set_num_threads(par.threads_per_stage or capped_threads(torch.get_num_threads(), usable_cores()))
        return LocalExecutor(functools.partial(Stage, source, config, ranges[0], max_model_len),
                             source.arch.hidden_size, config.num_spec_tokens)
    env = _torchrun_env(config)
    if env is not None and env.rank != 0:
        raise RuntimeError(f"rank {env.rank} of a torchrun launch runs a stage worker, not an engine; "
                           "start it with `python -m pipespec ...` (or pipespec.engine.stages.run_stage_worker)")
    ranks = [0] if env is not None else range(par.pipeline_parallel_size)
    factories = [None] * par.pipeline_parallel_size
    for r in ranks:
        factories[r] = functools.partial(Stage, source, _stage_config(config, r, env), ranges[r],
                                         max_model_len)
    logger.info("pipeline of %d stages, layers %s", par.pipeline_parallel_size,
                ", ".join(f"{a}-{b - 1}" for a, b in ranges))
    return PipelineExecutor(factories, _worker_settings(config, source.arch.hidden_size, env), torchrun=env)


def run_stage_worker(config: EngineConfig) -> int:
    """Rank > 0 of a torchrun launch: build this rank's stage and serve it until the driver stops."""
    env = _torchrun_env(config)
    if env is None or env.rank == 0:
        raise RuntimeError("run_stage_worker is for ranks > 0 of a torchrun launch")
    source = resolve_model(config.model.model, weights_dtype(config))
    max_model_len = check_max_model_len(config.model.max_model_len, source.arch.max_position)
    ranges = config.parallel.layer_ranges(source.arch.num_layers)
    make_stage = functools.partial(Stage, source, _stage_config(config, env.rank, env), ranges[env.rank],
                                   max_model_len)
    return run_torchrun_worker(make_stage, _worker_settings(config, source.arch.hidden_size, env))
