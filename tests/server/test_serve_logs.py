"""What a running server writes to its log (a real server process): one line per request, the
periodic stats line, and neither when switched off; --log-level works after `serve` too."""
from __future__ import annotations

import re
import time

import httpx
import pytest

from tests.live_server import LiveServer

pytestmark = pytest.mark.serial      # waits for stats lines on a clock


def _wait_for(server: LiveServer, pattern: str, within: float = 20) -> str:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        log = server.output()
        if re.search(pattern, log):
            return log
        time.sleep(0.2)
    raise AssertionError(f"{pattern!r} not in the log:\n{server.output()[-3000:]}")


def test_request_and_stats_lines(tmp_path):
    # --log-level given after the command, over the WARNING before it
    server = LiveServer("--log-level", "INFO", "--log-stats-interval", "0.5", log=tmp_path / "server.log",
                        log_level="WARNING")
    try:
        r = httpx.post(f"{server.url}/v1/completions", timeout=120,
                       json={"prompt": "Once upon a time", "max_tokens": 12, "ignore_eos": True})
        assert r.status_code == 200
        rid = r.json()["id"]
        log = _wait_for(server, rf"request {rid}: \d+ prompt tokens, 12 generated, finish_reason=length, "
                                r"[\d.]+ s")
        # the same prompt again: its full blocks come from the prefix cache (on by default)
        r = httpx.post(f"{server.url}/v1/completions", timeout=120,
                       json={"prompt": "Once upon a time " * 8, "max_tokens": 2})
        r = httpx.post(f"{server.url}/v1/completions", timeout=120,
                       json={"prompt": "Once upon a time " * 8, "max_tokens": 2})
        assert r.status_code == 200
        log = _wait_for(server, r"INFO pipespec.server.stats: prompt [\d.]+ tokens/s, generation [\d.]+ tokens/s, "
                                r"running \d+ reqs, waiting \d+ reqs, KV cache usage [\d.]+%, "
                                r"prefix cache hit rate [1-9][\d.]*%")
    finally:
        server.stop()
    assert "engine ready" in log                  # INFO reached: --log-level after `serve` took effect
    gen_rates = [float(x) for x in re.findall(r"generation ([\d.]+) tokens/s", log)]
    assert any(rate > 0 for rate in gen_rates), log[-2000:]


def test_lines_switched_off(tmp_path):
    server = LiveServer("--disable-log-requests", "--disable-log-stats", log=tmp_path / "server.log",
                        log_level="INFO")
    try:
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 4}, timeout=120)
        assert r.status_code == 200
        time.sleep(1.0)
        log = server.output()
    finally:
        server.stop()
    assert "engine ready" in log
    assert "pipespec.server.requests" not in log and "pipespec.server.stats" not in log
