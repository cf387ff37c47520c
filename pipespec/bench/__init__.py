"""`pipespec bench latency | throughput | serve`: measure the engine as vLLM's bench commands do.

latency     one batch of fixed input/output lengths, timed over iterations (offline engine)
throughput  many requests at once, tokens per second (offline engine)
serve       a load generator against a running OpenAI-compatible server: TTFT, TPOT, ITL
"""
from __future__ import annotations

import datetime
import json
import platform
import random
from pathlib import Path


def report(lines: list[str], results: dict, output_json: str | None) -> None:
    print("\n".join(lines), flush=True)
    if output_json:
        record = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
                  "machine": f"{platform.machine()} {platform.processor() or ''}".strip(), **results}
        Path(output_json).write_text(json.dumps(record, indent=1) + "\n")


def random_token_prompts(num: int, length: int, vocab_size: int, seed: int = 0,
                         low: int = 0) -> list[list[int]]:
    """`num` prompts of `length` ids drawn uniformly from [low, vocab_size), reproducible by seed."""
    if length < 1:
        raise ValueError(f"input length must be >= 1, got {length}")
    if not 0 <= low < vocab_size:
        raise ValueError(f"token id range [{low}, {vocab_size}) is empty")
    rng = random.Random(seed)
    return [[rng.randrange(low, vocab_size) for _ in range(length)] for _ in range(num)]
