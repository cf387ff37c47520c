"""How many KV blocks (and linear-attention state snapshots) a stage can hold: from the config on
CPU, from measured memory on GPU."""
from __future__ import annotations

import torch

from pipespec.config import EngineConfig
from pipespec.model.arch import ArchConfig

CPU_DEFAULT_KV_BYTES = 1 << 30
NO_KV_BOUND = 1 << 40       # a stage without paged caches; the engine takes the least over stages
# share of a stage's cache memory its prefix-cache state snapshots get when their count is not given
# (a Qwen3.5-35B-A3B snapshot weighs as much as ~3,100 tokens of its KV: RESULTS.md)
SNAPSHOT_SHARE = 0.1


def activation_reserve(arch: ArchConfig, config: EngineConfig) -> int:
    """Bytes for the activations of the largest step: hidden, MLP intermediate and logits rows, with
    slack."""
    tokens = config.scheduler.max_num_batched_tokens
    per_token = (4 * arch.hidden_size + 3 * arch.intermediate_size
                 + (arch.num_heads + 2 * arch.num_kv_heads) * arch.head_dim) * 4
    k = config.num_spec_tokens
    rows = k + 1
    if config.speculative is not None and config.speculative.adaptive:
        # a graph set per K in 0..K keeps its logits allocated: (K+1)(K+2)/2 rows per request in all
        rows = (k + 1) * (k + 2) // 2
    logits = config.scheduler.max_num_seqs * rows * arch.vocab_size * 4 * 4
    return 2 * (tokens * per_token + logits) + (256 << 20)


def cache_budget(config: EngineConfig, arch: ArchConfig, device: torch.device, fixed_bytes: int) -> float | None:
    """Bytes a stage's caches may take besides `fixed_bytes` (weights, state slots); None when the
    config gives the block count."""
    cache = config.cache
    if cache.num_kv_blocks is not None:
        return None
    if device.type == "cuda" and cache.kv_cache_memory is None:
        # this engine may fill `gpu_memory_utilization` of the card with its weights, activations
        # and KV cache, and never more than is free (other engines or processes keep theirs)
        torch.cuda.empty_cache()   # memory cached from earlier engines is not in use
        free, total = torch.cuda.mem_get_info(device)
        reserve = activation_reserve(arch, config)
        return max(min(total * cache.gpu_memory_utilization - fixed_bytes - reserve, free - reserve), 0)
    return float(cache.kv_cache_memory or CPU_DEFAULT_KV_BYTES)


def available_kv_blocks(config: EngineConfig, device: torch.device, budget: float | None, bytes_per_block: int) -> int:
    """KV blocks that fit in `budget` bytes (`cache_budget`)."""
    if budget is None:
        return config.cache.num_kv_blocks
    if bytes_per_block == 0:        # no paged cache here (linear-attention layers only): no bound
        return NO_KV_BOUND
    measured = device.type == "cuda" and config.cache.kv_cache_memory is None
    return max(int(budget // bytes_per_block), 0 if measured else 1)


def available_snapshots(config: EngineConfig, budget: float | None, bytes_per_snapshot: int,
                        bytes_per_block: int) -> int:
    """Prefix-cache snapshots of a stage's linear-attention states: the count asked for, else
    SNAPSHOT_SHARE of `budget` (never more than there are KV blocks for their prefixes), else
    (the block count given) one per request the scheduler may run."""
    asked = config.cache.prefix_cache_state_snapshots
    if asked is not None:
        return asked
    if budget is None:
        return config.scheduler.max_num_seqs
    n = int(SNAPSHOT_SHARE * budget // bytes_per_snapshot)
    return min(n, int(budget // bytes_per_block)) if bytes_per_block else n
