"""What `pipespec serve` writes to its log while it serves: a line per finished request (off with
--disable-log-requests) and, every --log-stats-interval seconds while there is work, one line of
throughput and occupancy (vLLM's periodic stats line: prompt and generation tokens/s, running and
waiting requests, KV cache usage, prefix-cache hit rate when the engine reports one)."""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable

logger = logging.getLogger("pipespec.server.requests")
stats_logger = logging.getLogger("pipespec.server.stats")


def log_request(request_id: str, prompt_tokens: int, generated_tokens: int, finish_reason: str,
                latency: float, error: str | None = None) -> None:
    if error is not None:
        logger.warning("request %s failed: %d prompt tokens, %d generated, %.2f s: %s", request_id,
                       prompt_tokens, generated_tokens, latency, error)
        return
    logger.info("request %s: %d prompt tokens, %d generated, finish_reason=%s, %.2f s", request_id,
                prompt_tokens, generated_tokens, finish_reason, latency)


def format_stats(window: float, prompt_tokens: float, generation_tokens: float, stats: dict,
                 num_waiting: int, prefix_before: dict | None) -> str:
    """One stats line: token rates over `window` seconds, the engine's occupancy now, and the
    prefix-cache hit rate over the window (its cumulative rate if there were no lookups)."""
    parts = [f"prompt {prompt_tokens / window:.1f} tokens/s", f"generation {generation_tokens / window:.1f} tokens/s",
             f"running {stats.get('num_running', 0)} reqs", f"waiting {num_waiting} reqs",
             f"KV cache usage {100 * stats.get('kv_cache_usage', 0.0):.1f}%"]
    prefix = stats.get("prefix_cache")
    if isinstance(prefix, dict):
        queries = prefix.get("queries", 0) - (prefix_before or {}).get("queries", 0)
        hits = prefix.get("hits", 0) - (prefix_before or {}).get("hits", 0)
        rate = hits / queries if queries > 0 else prefix.get("hit_rate", 0.0)
        parts.append(f"prefix cache hit rate {100 * rate:.1f}%")
    return ", ".join(parts)


class StatsLogger:
    """A thread that logs the stats line every `interval` seconds while requests run or wait, or
    tokens went through since the last line; quiet while the server is idle."""

    def __init__(self, interval: float, read: Callable[[], tuple[float, float, dict, int]]):
        """`read()` -> (prompt tokens so far, generated tokens so far, engine stats, waiting requests)."""
        if interval <= 0:
            raise ValueError(f"--log-stats-interval must be > 0 seconds, got {interval:g}")
        self.interval, self.read = interval, read
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pipespec-stats", daemon=True)

    def start(self) -> "StatsLogger":
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        prompt0, gen0, stats, _ = self.read()
        prefix0, t0 = stats.get("prefix_cache"), time.monotonic()
        while not self._stop.wait(self.interval):
            try:
                prompt, gen, stats, waiting = self.read()
                now = time.monotonic()
                busy = stats.get("num_running", 0) or waiting
                if busy or prompt > prompt0 or gen > gen0:
                    stats_logger.info("%s", format_stats(now - t0, prompt - prompt0, gen - gen0, stats, waiting,
                                                         prefix0))
                prompt0, gen0, prefix0, t0 = prompt, gen, stats.get("prefix_cache"), now
            except Exception:      # a stats line is never worth stopping the server for
                stats_logger.exception("could not write the stats line")
