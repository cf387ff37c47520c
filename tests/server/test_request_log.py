"""The request line and the periodic stats line: their content, and the stats thread's timing."""
from __future__ import annotations

import logging
import time

import pytest

from pipespec.server.request_log import StatsLogger, format_stats, log_request


def test_request_line(caplog):
    with caplog.at_level(logging.INFO, logger="pipespec.server.requests"):
        log_request("cmpl-7", 12, 40, "length", 1.234)
        log_request("cmpl-8", 3, 1, "abort", 0.5, error="pipeline failure: stage 1 died")
    first, second = caplog.records
    assert first.levelno == logging.INFO
    assert first.getMessage() == "request cmpl-7: 12 prompt tokens, 40 generated, finish_reason=length, 1.23 s"
    assert second.levelno == logging.WARNING and "cmpl-8 failed" in second.getMessage()
    assert "stage 1 died" in second.getMessage()


def test_stats_line_without_a_prefix_cache():
    line = format_stats(2.0, 100, 50, {"num_running": 3, "kv_cache_usage": 0.125}, 2, None)
    assert line == ("prompt 50.0 tokens/s, generation 25.0 tokens/s, running 3 reqs, waiting 2 reqs, "
                    "KV cache usage 12.5%")


def test_stats_line_with_a_prefix_cache():
    before = {"queries": 10, "hits": 2, "hit_rate": 0.2, "cached_blocks": 4}
    now = {"queries": 20, "hits": 10, "hit_rate": 0.5, "cached_blocks": 9}
    stats = {"num_running": 0, "kv_cache_usage": 0.0, "prefix_cache": now}
    assert format_stats(1.0, 0, 0, stats, 0, before).endswith("prefix cache hit rate 80.0%")   # 8 / 10 lately
    assert format_stats(1.0, 0, 0, stats, 0, now).endswith("prefix cache hit rate 50.0%")      # no lookups: overall


def test_stats_logger_writes_while_busy_and_is_quiet_when_idle(caplog):
    state = {"prompt": 0.0, "gen": 0.0, "running": 1}

    def read():
        return state["prompt"], state["gen"], {"num_running": state["running"], "kv_cache_usage": 0.5}, 0

    stats = StatsLogger(0.1, read)
    with caplog.at_level(logging.INFO, logger="pipespec.server.stats"):
        stats.start()
        state["prompt"], state["gen"] = 20.0, 10.0
        time.sleep(0.35)
        busy = len(caplog.records)
        state["running"] = 0                  # idle and nothing new: no more lines
        time.sleep(0.25)
        settled = len(caplog.records)
        time.sleep(0.3)
        stats.stop()
    assert busy >= 2 and "running 1 reqs" in caplog.records[0].getMessage()
    assert "KV cache usage 50.0%" in caplog.records[0].getMessage()
    assert len(caplog.records) == settled
    assert not stats._thread.is_alive()


def test_stats_interval_must_be_positive():
    with pytest.raises(ValueError, match="--log-stats-interval"):
        StatsLogger(0, lambda: (0, 0, {}, 0))
