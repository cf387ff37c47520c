"""How the engine gets its stages: one Stage per rank (T ranks per pipeline stage, rank = stage * T +
tp_rank), each with its own config (device) and its `TensorParallel` place, in this process (one
rank), in spawned workers, or in a torchrun world; and the entry point of a torchrun rank > 0, which
serves its stage until the driver stops it.
"""
from __future__ import annotations

import dataclasses
import functools
import logging

import torch

from pipespec.checkpoint.source import ModelSource, resolve_model
from pipespec.config import EngineConfig
from pipespec.parallel import TensorParallel
from pipespec.placement import weights_dtype
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
    """Rank `rank`'s config: with several ranks on CUDA every rank gets its own GPU (cuda:rank on one
    machine, cuda:LOCAL_RANK under torchrun)."""
    p = config.parallel.world_size
    device = config.model.device
    if p == 1:
        return config
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        return config if config.model.device == "cpu" else _with_device(config, "cpu")
    if device != "cuda":
        raise ValueError(f"with pipeline_parallel_size or tensor_parallel_size > 1 give device='cuda' (rank "
                         f"i then runs on cuda:i, or cuda:LOCAL_RANK under torchrun) or 'cpu', not {device!r}")
    if env is not None:
        return _with_device(config, f"cuda:{env.local_rank}")
    count = torch.cuda.device_count()
    if count == 0:
        raise ValueError("device 'cuda' was asked for, but CUDA is not available")
    if count < p:
        if config.parallel.distributed_backend != "gloo":
            raise ValueError(f"pipeline_parallel_size x tensor_parallel_size = {p} ranks on CUDA needs {p} "
                             f"GPUs, found {count} (distributed_backend='gloo' lets ranks share GPUs, for testing)")
        logger.warning("%d ranks share %d GPU(s)", p, count)
    return _with_device(config, f"cuda:{rank % count}")


def _with_device(config: EngineConfig, device: str) -> EngineConfig:
    return dataclasses.replace(config, model=dataclasses.replace(config.model, device=device))


def _worker_settings(config: EngineConfig, hidden_size: int, env: launch.TorchrunEnv | None) -> WorkerSettings:
    par = config.parallel
    on_cpu = config.model.device == "cpu" or (config.model.device == "auto" and not torch.cuda.is_available())
    threads = stage_threads(par.threads_per_stage, on_cpu, env.local_world_size if env is not None else par.world_size)
    return WorkerSettings(num_stages=par.pipeline_parallel_size, hidden_size=hidden_size,
                          num_spec_tokens=config.num_spec_tokens, stage_timeout=par.stage_timeout,
                          startup_timeout=par.startup_timeout, backend=par.distributed_backend,
                          threads=threads, check=par.check_collectives,
                          log_level=logging.getLogger("pipespec").getEffectiveLevel(),
                          tensor_parallel_size=par.tensor_parallel_size,
                          custom_all_reduce=par.custom_all_reduce)


def _torchrun_env(config: EngineConfig) -> launch.TorchrunEnv | None:
    env = launch.torchrun_env()
    par = config.parallel
    if env is not None and env.world_size != par.world_size:
        raise ValueError(f"launched by torchrun with WORLD_SIZE={env.world_size}, but pipeline_parallel_size x "
                         f"tensor_parallel_size is {par.pipeline_parallel_size} x {par.tensor_parallel_size}; "
                         "they must be equal")
    return env


def _make_stage(source: ModelSource, config: EngineConfig, ranges, max_model_len: int, rank: int,
                env: launch.TorchrunEnv | None):
    """Rank `rank`'s stage factory (picklable: spawned workers call it)."""
    t = config.parallel.tensor_parallel_size
    tp = TensorParallel(rank % t, t) if t > 1 else None
    return functools.partial(Stage, source, _stage_config(config, rank, env), ranges[rank // t], max_model_len,
                             tp=tp)


def check_tensor_parallel(arch, tp: int) -> None:
    """In the parent, before any worker starts: the attention heads must split evenly over `tp` ranks
    (and the KV heads split or replicate evenly); ValueError names the sizes that would work."""
    if tp <= 1:
        return
    heads, kv = arch.num_heads, arch.num_kv_heads

    def fits(t: int) -> bool:
        return heads % t == 0 and (kv % t == 0 if kv >= t else t % kv == 0)

    if fits(tp):
        return
    choices = [t for t in range(1, heads + 1) if fits(t)]
    raise ValueError(f"tensor_parallel_size={tp} does not split the model's attention heads evenly "
                     f"(num_attention_heads={heads}, num_key_value_heads={kv}); choose one of "
                     f"{', '.join(map(str, choices))}")


def build_executor(config: EngineConfig, source: ModelSource, max_model_len: int) -> Executor:
    """LocalExecutor for one stage, PipelineExecutor (spawned workers or a torchrun world) for more."""
    par = config.parallel
    check_tensor_parallel(source.arch, par.tensor_parallel_size)
    ranges = par.layer_ranges(source.arch.num_layers)
    if par.world_size == 1:
        torch.set_num_threads(par.threads_per_stage or capped_threads(torch.get_num_threads(), usable_cores()))
        return LocalExecutor(functools.partial(Stage, source, config, ranges[0], max_model_len),
                             source.arch.hidden_size, config.num_spec_tokens)
    env = _torchrun_env(config)
    if env is not None and env.rank != 0:
        raise RuntimeError(f"rank {env.rank} of a torchrun launch runs a stage worker, not an engine; "
                           "start it with `python -m pipespec ...` (or pipespec.engine.stages.run_stage_worker)")
    ranks = [0] if env is not None else range(par.world_size)
    factories = [None] * par.world_size
    for r in ranks:
        factories[r] = _make_stage(source, config, ranges, max_model_len, r, env)
    logger.info("pipeline of %d stages x %d TP ranks, layers %s", par.pipeline_parallel_size,
                par.tensor_parallel_size, ", ".join(f"{a}-{b - 1}" for a, b in ranges))
    return PipelineExecutor(factories, _worker_settings(config, source.arch.hidden_size, env), torchrun=env)


def run_stage_worker(config: EngineConfig) -> int:
    """Rank > 0 of a torchrun launch: build this rank's stage and serve it until the driver stops."""
    env = _torchrun_env(config)
    if env is None or env.rank == 0:
        raise RuntimeError("run_stage_worker is for ranks > 0 of a torchrun launch")
    source = resolve_model(config.model.model, weights_dtype(config), config.model.revision,
                           config.model.download_dir)
    check_tensor_parallel(source.arch, config.parallel.tensor_parallel_size)    # each rank says it, exit 2
    max_model_len = check_max_model_len(config.model.max_model_len, source.arch.max_position)
    ranges = config.parallel.layer_ranges(source.arch.num_layers)
    make_stage = _make_stage(source, config, ranges, max_model_len, env.rank, env)
    return run_torchrun_worker(make_stage, _worker_settings(config, source.arch.hidden_size, env))
