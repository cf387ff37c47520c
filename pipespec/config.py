"""Frozen, validated engine configuration.

Every knob a user can turn lives here, checked once at construction so the rest of the engine can
trust it. Model architecture (layer counts, head sizes) is not user configuration: it is read from
the checkpoint into `pipespec.model.arch.ArchConfig`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

_DTYPES = ("auto", "float32", "bfloat16", "float16")


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


@dataclass(frozen=True)
class ModelConfig:
    model: str | None = None          # HF folder, GGUF file, or None for the default model
    dtype: str = "auto"               # auto: float32 on CPU, the checkpoint's (or bf16) on GPU
    device: str = "auto"              # auto: cuda if available, else cpu
    max_model_len: int | None = None  # None: the model's context length
    seed: int = 0                     # seeds requests that do not bring their own seed

    def __post_init__(self):
        _require(self.dtype in _DTYPES, f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        _require(self.max_model_len is None or self.max_model_len >= 2,
                 f"max_model_len must be >= 2, got {self.max_model_len}")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    num_kv_blocks: int | None = None       # explicit block count (wins over the two below)
    kv_cache_memory: int | None = None     # bytes for the KV cache (CPU default: 1 GiB)
    gpu_memory_utilization: float = 0.90   # fraction of GPU memory the engine may fill

    def __post_init__(self):
        _require(self.block_size >= 1 and self.block_size & (self.block_size - 1) == 0,
                 f"block_size must be a power of two, got {self.block_size}")
        _require(self.num_kv_blocks is None or self.num_kv_blocks >= 1,
                 f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        _require(self.kv_cache_memory is None or self.kv_cache_memory > 0,
                 f"kv_cache_memory must be > 0 bytes, got {self.kv_cache_memory}")
        _require(0.0 < self.gpu_memory_utilization <= 1.0,
                 f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 1024   # token budget of one step
    max_num_seqs: int = 64               # requests running at once
    enable_chunked_prefill: bool = True

    def __post_init__(self):
        _require(self.max_num_batched_tokens >= 1,
                 f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        _require(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}")


@dataclass(frozen=True)
class ParallelConfig:
    pipeline_parallel_size: int = 1
    stage_timeout: float = 30.0          # seconds a stage may take to answer before it counts as dead

    def __post_init__(self):
        _require(self.pipeline_parallel_size == 1,
                 f"pipeline_parallel_size={self.pipeline_parallel_size} is not supported yet; use 1")
        _require(self.stage_timeout > 0, f"stage_timeout must be > 0 seconds, got {self.stage_timeout}")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineConfig":
        """Build from flat vLLM-style keyword arguments (`LLM(model=..., max_num_seqs=...)`)."""
        parts = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig,
                 "parallel": ParallelConfig}
        values: dict[str, dict] = {name: {} for name in parts}
        for key, value in kwargs.items():
            owner = next((name for name, klass in parts.items()
                          if key in {f.name for f in dataclasses.fields(klass)}), None)
            if owner is None:
                raise TypeError(f"unknown engine argument {key!r}")
            values[owner][key] = value
        return cls(**{name: klass(**values[name]) for name, klass in parts.items()})
