"""Frozen, validated engine configuration.

Every knob a user can turn lives here, checked once at construction so the rest of the engine can
trust it. Model architecture (layer counts, head sizes) is not user configuration: it is read from
the checkpoint into `pipespec.model.arch.ArchConfig`.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

_DTYPES = ("auto", "float32", "bfloat16", "float16")
_ATTENTION_BACKENDS = ("auto", "torch", "triton")
_LOAD_FORMATS = ("auto", "dummy")
_QUANTIZATIONS = (None, "fp8", "awq", "gptq")


CHECK_COLLECTIVES_ENV = "PIPESPEC_CHECK_COLLECTIVES"


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no", "off")


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


@dataclass(frozen=True)
class ModelConfig:
    model: str | None = None          # HF folder, GGUF file, or None for the default model
    dtype: str = "auto"               # auto: float32 on CPU, the checkpoint's (or bf16) on GPU
    device: str = "auto"              # auto: cuda if available, else cpu
    max_model_len: int | None = None  # None: the model's context length
    # seeds the requests that bring no seed of their own: an engine given a seed draws the same
    # text run after run; None (vLLM's default) draws a fresh seed per engine
    seed: int | None = None
    attention_backend: str = "auto"   # auto: triton on CUDA (when installed), torch elsewhere
    enforce_eager: bool = False       # True: never replay CUDA graphs (GPU decode runs op by op)
    load_format: str = "auto"         # dummy: random weights of the checkpoint's shapes (benchmarks)
    # fp8 / awq / gptq: with load_format="dummy", random weights in that format (benchmarks); with a
    # checkpoint it must name the checkpoint's own quantization_config method (None: whatever it is)
    quantization: str | None = None
    # vLLM's names: a Hub id's revision and cache folder; another tokenizer (folder or Hub id, at
    # tokenizer_revision); a chat template (a file or the template itself) replacing the model's
    revision: str | None = None
    download_dir: str | None = None
    tokenizer: str | None = None
    tokenizer_revision: str | None = None
    chat_template: str | None = None

    def __post_init__(self):
        _require(self.dtype in _DTYPES, f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        _require(self.attention_backend in _ATTENTION_BACKENDS,
                 f"attention_backend must be one of {_ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        _require(self.load_format in _LOAD_FORMATS,
                 f"load_format must be one of {_LOAD_FORMATS}, got {self.load_format!r}")
        _require(isinstance(self.enforce_eager, bool), f"enforce_eager must be a bool, got {self.enforce_eager!r}")
        _require(self.quantization in _QUANTIZATIONS,
                 f"quantization must be one of {_QUANTIZATIONS}, got {self.quantization!r}")
        _require(self.max_model_len is None or self.max_model_len >= 2,
                 f"max_model_len must be >= 2, got {self.max_model_len}")
        _require(self.seed is None or (isinstance(self.seed, int) and not isinstance(self.seed, bool)),
                 f"seed must be an integer or None, got {self.seed!r}")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    num_kv_blocks: int | None = None       # explicit block count (wins over the two below)
    kv_cache_memory: int | None = None     # bytes for the KV cache (CPU default: 1 GiB)
    gpu_memory_utilization: float = 0.90   # fraction of GPU memory the engine may fill
    # vLLM's name: reuse the KV of full blocks of a prompt's prefix already computed (engine/scheduler.py)
    enable_prefix_caching: bool = True
    # models with linear-attention layers: prefix-cache snapshots of their states each stage keeps
    # (engine/scheduler.py says where they are taken); None: sized from memory (stage/memory.py),
    # 0: none (no prefix caching)
    prefix_cache_state_snapshots: int | None = None

    def __post_init__(self):
        _require(self.block_size >= 1 and self.block_size & (self.block_size - 1) == 0,
                 f"block_size must be a power of two, got {self.block_size}")
        _require(self.num_kv_blocks is None or self.num_kv_blocks >= 1,
                 f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        _require(self.kv_cache_memory is None or self.kv_cache_memory > 0,
                 f"kv_cache_memory must be > 0 bytes, got {self.kv_cache_memory}")
        _require(isinstance(self.enable_prefix_caching, bool),
                 f"enable_prefix_caching must be true or false, got {self.enable_prefix_caching!r}")
        n = self.prefix_cache_state_snapshots
        _require(n is None or (isinstance(n, int) and not isinstance(n, bool) and n >= 0),
                 f"prefix_cache_state_snapshots must be an integer >= 0, got {n!r}")
        _require(0.0 < self.gpu_memory_utilization <= 1.0,
                 f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 1024   # token budget of one step
    max_num_seqs: int = 64               # requests running at once
    enable_chunked_prefill: bool = True
    # most prompt tokens one request's prefill chunk takes in a step while the engine holds other
    # requests (vLLM's name); None: a quarter of the step budget, 0: no limit
    long_prefill_token_threshold: int | None = None
    # vLLM's name: schedule step n + 1 while the device runs step n (engine/llm_engine.py says how).
    # None: on where it applies (one stage, on a GPU; speculative steps included); True with a
    # pipeline is an error
    async_scheduling: bool | None = None

    def __post_init__(self):
        _require(self.async_scheduling in (None, True, False),
                 f"async_scheduling must be true, false or None (auto), got {self.async_scheduling!r}")
        _require(self.max_num_batched_tokens >= 1,
                 f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        _require(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        t = self.long_prefill_token_threshold
        _require(t is None or (isinstance(t, int) and not isinstance(t, bool) and t >= 0),
                 f"long_prefill_token_threshold must be an integer >= 0, got {t!r}")

    @property
    def prefill_chunk_limit(self) -> int:
        """Tokens a prefill chunk may take while it shares the engine (0: the whole budget)."""
        t = self.long_prefill_token_threshold
        return max(1, self.max_num_batched_tokens // 4) if t is None else t


_BACKENDS = ("auto", "gloo", "nccl")


@dataclass(frozen=True)
class ParallelConfig:
    pipeline_parallel_size: int = 1
    # ranks of each stage, splitting its heads, intermediate size and vocabulary (T x P ranks in all)
    tensor_parallel_size: int = 1
    # layers of each stage, e.g. (10, 10, 10) or "10,10,10"; None: as even as possible, extra
    # layers going to the first stages (the last one also runs the LM head)
    pp_layer_partition: tuple[int, ...] | str | None = None
    stage_timeout: float = 30.0          # seconds a stage may take to answer before it counts as dead
    startup_timeout: float = 600.0       # seconds the stages may take to start and load their weights
    distributed_backend: str = "auto"    # activations between stages: auto = nccl on CUDA, gloo on CPU
    # TP on GPUs: small sums through the one-host symmetric-memory all-reduce, NCCL's otherwise
    # (runtime/one_host_all_reduce.py). Opt-in: a second TP engine in one process has hung in its
    # set-up (RESULTS.md, TP = 2)
    custom_all_reduce: bool = False
    threads_per_stage: int | None = None  # CPU threads of each stage; None: torch's default for PP = 1,
                                          # cores / PP for PP > 1
    # debug: every message checked against its receiver's expectation, per-channel and draft-trace
    # reports compared at shutdown (I3, I4); slower. PIPESPEC_CHECK_COLLECTIVES=1 sets the default.
    check_collectives: bool = field(default_factory=lambda: _env_flag(CHECK_COLLECTIVES_ENV))

    def __post_init__(self):
        p = self.pipeline_parallel_size
        _require(isinstance(p, int) and not isinstance(p, bool) and p >= 1,
                 f"pipeline_parallel_size must be an integer >= 1, got {p!r}")
        t = self.tensor_parallel_size
        _require(isinstance(t, int) and not isinstance(t, bool) and t >= 1,
                 f"tensor_parallel_size must be an integer >= 1, got {t!r}")
        part = self.pp_layer_partition
        if part is not None:
            if isinstance(part, str):
                try:
                    part = tuple(int(x) for x in part.replace(" ", "").split(",") if x)
                except ValueError:
                    raise ValueError(f"pp_layer_partition must be comma-separated layer counts like "
                                     f"'10,10,10', got {self.pp_layer_partition!r}") from None
            else:
                part = tuple(part)
            _require(all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in part),
                     f"pp_layer_partition must be layer counts >= 1, got {self.pp_layer_partition!r}")
            _require(len(part) == p, f"pp_layer_partition {','.join(map(str, part))} has {len(part)} "
                                     f"stages, but pipeline_parallel_size is {p}")
            object.__setattr__(self, "pp_layer_partition", part)
        _require(self.stage_timeout > 0, f"stage_timeout must be > 0 seconds, got {self.stage_timeout}")
        _require(self.startup_timeout > 0, f"startup_timeout must be > 0 seconds, got {self.startup_timeout}")
        _require(self.distributed_backend in _BACKENDS,
                 f"distributed_backend must be one of {_BACKENDS}, got {self.distributed_backend!r}")
        _require(self.threads_per_stage is None or (isinstance(self.threads_per_stage, int)
                                                    and self.threads_per_stage >= 1),
                 f"threads_per_stage must be an integer >= 1, got {self.threads_per_stage!r}")

    @property
    def world_size(self) -> int:
        """Ranks in all: T per stage, P stages."""
        return self.pipeline_parallel_size * self.tensor_parallel_size

    def layer_ranges(self, num_layers: int) -> list[tuple[int, int]]:
        """[start, end) of each stage's layers, checked against the model's layer count."""
        p = self.pipeline_parallel_size
        if self.pp_layer_partition is None:
            _require(p <= num_layers, f"pipeline_parallel_size={p} exceeds the model's {num_layers} layers")
            counts = [num_layers // p + (1 if i < num_layers % p else 0) for i in range(p)]
        else:
            counts = list(self.pp_layer_partition)
            _require(sum(counts) == num_layers,
                     f"pp_layer_partition {','.join(map(str, counts))} covers {sum(counts)} layers, "
                     f"but the model has {num_layers}")
        starts = [sum(counts[:i]) for i in range(p)]
        return [(s, s + n) for s, n in zip(starts, counts)]


@dataclass(frozen=True)
class SpeculativeConfig:
    """`speculative_config={"method": "mtp", "num_speculative_tokens": K, "model": PATH}` (vLLM's keys),
    plus `"adaptive": true`: the driver picks each step's K in 0..num_speculative_tokens from the
    acceptance and step costs it measures (engine/adaptive_k.py); without it K is fixed (vLLM's meaning)."""

    method: str = "mtp"
    num_speculative_tokens: int = 1   # K; with adaptive, the largest K a step may use
    model: str | None = None          # a head file; None: the checkpoint's own MTP layers or the bundled head
    adaptive: bool = False
    # drafting over a draft vocabulary (speculative/draft_vocab.py): a file holding one (a head file, or
    # one `pipespec draft-vocab` wrote; None: the head file's own where it holds one, TP = 1; "full": the
    # whole vocabulary), and how many of its tokens (None: all)
    draft_vocab: str | None = None
    draft_vocab_size: int | None = None
    # adaptive only, for tests and benchmarks: the steps' K in turn (repeating) instead of measuring
    k_sequence: tuple[int, ...] | None = None

    def __post_init__(self):
        _require(self.method == "mtp", f"speculative_config.method must be 'mtp', got {self.method!r}")
        k = self.num_speculative_tokens
        if self.adaptive is True and (not isinstance(k, int) or isinstance(k, bool) or k < 1):
            raise ValueError(f"speculative_config.adaptive needs speculation: num_speculative_tokens is the largest "
                             f"K a step may use and must be an integer in 1..8, got {k!r}")
        _require(isinstance(k, int) and not isinstance(k, bool) and 1 <= k <= 8,
                 f"speculative_config.num_speculative_tokens must be an integer in 1..8, got {k!r}")
        _require(isinstance(self.adaptive, bool),
                 f"speculative_config.adaptive must be true or false, got {self.adaptive!r}")
        _require(self.draft_vocab is None or (isinstance(self.draft_vocab, str) and self.draft_vocab),
                 f"speculative_config.draft_vocab must be a file's path, got {self.draft_vocab!r}")
        n = self.draft_vocab_size
        _require(not (self.draft_vocab == "full" and n is not None),
                 "speculative_config.draft_vocab 'full' drafts over the whole vocabulary; draft_vocab_size "
                 "takes the first tokens of a draft vocabulary, so give one or the other")
        _require(n is None or (isinstance(n, int) and not isinstance(n, bool) and n >= 1),
                 f"speculative_config.draft_vocab_size must be a positive integer (or absent: the whole "
                 f"vocabulary), got {n!r}")
        seq = self.k_sequence
        if seq is not None:
            _require(self.adaptive, "speculative_config.k_sequence forces the steps' K of adaptive K; "
                                    "set \"adaptive\": true with it")
            _require(isinstance(seq, (list, tuple)) and len(seq) > 0
                     and all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= k for x in seq),
                     f"speculative_config.k_sequence must be a non-empty list of integers in 0..{k}, got {seq!r}")
            object.__setattr__(self, "k_sequence", tuple(seq))

    @property
    def drafts_over_a_vocabulary(self) -> bool:
        """A draft vocabulary asked for by name or size (the head's own is also used by default)."""
        return self.draft_vocab not in (None, "full") or self.draft_vocab_size is not None

    @classmethod
    def parse(cls, value) -> "SpeculativeConfig | None":
        """From None, a SpeculativeConfig, a dict or a JSON string (the CLI's form)."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            import json
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict or JSON object, got {type(value).__name__}")
        unknown = set(value) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"speculative_config has unknown keys {sorted(unknown)}; "
                             "known: " + ", ".join(f.name for f in dataclasses.fields(cls)))
        return cls(**value)


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    speculative: SpeculativeConfig | None = None

    def __post_init__(self):
        if self.speculative is not None and self.speculative.drafts_over_a_vocabulary:
            _require(self.parallel.tensor_parallel_size == 1,
                     "speculative_config.draft_vocab / draft_vocab_size need tensor_parallel_size 1 (with TP the "
                     "LM head's vocabulary is split across the ranks)")
        if self.scheduler.async_scheduling:
            _require(self.parallel.world_size == 1,
                     "async_scheduling needs one stage (pipeline_parallel_size = tensor_parallel_size = 1): "
                     "a pipeline already overlaps its micro-batches")

    @property
    def num_spec_tokens(self) -> int:
        return self.speculative.num_speculative_tokens if self.speculative else 0

    def async_scheduling_on(self, device_type: str) -> bool:
        """Whether the driver schedules step n + 1 while a stage on a `device_type` device runs step n: asked for,
        or by default on a GPU (where the step runs asynchronously to the host), where it applies."""
        asked = self.scheduler.async_scheduling
        applies = self.parallel.world_size == 1
        return applies and (asked if asked is not None else device_type == "cuda")

    @classmethod
    def from_kwargs(cls, speculative_config=None, **kwargs) -> "EngineConfig":
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
        return cls(**{name: klass(**values[name]) for name, klass in parts.items()},
                   speculative=SpeculativeConfig.parse(speculative_config))
