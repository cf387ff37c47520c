"""Synthetic prompts of exact token lengths (vLLM's "random" dataset): random token ids."""
from __future__ import annotations

import random


def random_token_prompts(num: int, length: int, vocab_size: int, seed: int = 0,
                         low: int = 0) -> list[list[int]]:
    """`num` prompts of `length` ids drawn uniformly from [low, vocab_size), reproducible by seed."""
    if length < 1:
        raise ValueError(f"input length must be >= 1, got {length}")
    if not 0 <= low < vocab_size:
        raise ValueError(f"token id range [{low}, {vocab_size}) is empty")
    rng = random.Random(seed)
    return [[rng.randrange(low, vocab_size) for _ in range(length)] for _ in range(num)]
