"""How many KV blocks a stage can hold: from the config on CPU, from measured memory on GPU."""
from __future__ import annotations

import torch

from pipespec.config import EngineConfig
from pipespec.model.arch import ArchConfig

CPU_DEFAULT_KV_BYTES = 1 << 30
NO_KV_BOUND = 1 << 40       # a stage without paged caches; the engine takes the least over stages


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


def available_kv_blocks(config: EngineConfig, arch: ArchConfig, device: torch.device, weight_bytes: int,
                        bytes_per_block: int) -> int:
    cache = config.cache
    if cache.num_kv_blocks is not None:
        return cache.num_kv_blocks
    if bytes_per_block == 0:        # no paged cache here (linear-attention layers only): no bound
        return NO_KV_BOUND
    if device.type == "cuda" and cache.kv_cache_memory is None:
        # this engine may fill `gpu_memory_utilization` of the card with its weights, activations
        # and KV cache, and never more than is free (other engines or processes keep theirs)
        torch.cuda.empty_cache()   # memory cached from earlier engines is not in use
        free, total = torch.cuda.mem_get_info(device)
        reserve = activation_reserve(arch, config)
        budget = min(total * cache.gpu_memory_utilization - weight_bytes - reserve, free - reserve)
        return max(int(budget // bytes_per_block), 0)
    return max(int((cache.kv_cache_memory or CPU_DEFAULT_KV_BYTES) // bytes_per_block), 1)
