"""`pipespec bench latency | throughput | serve`, run as a user runs them, with tiny sizes."""
from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from pipespec.bench.stats import percentile
from tests.live_server import REPO, LiveServer, metric, pipespec_env

ENGINE = ["--device", "cpu", "--max-model-len", "256", "--num-kv-blocks", "64", "--threads-per-stage", "1"]


def bench(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "pipespec", "--log-level", "WARNING", "bench", *args], cwd=REPO,
                          env=pipespec_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_latency(tmp_path):
    out = tmp_path / "latency.json"
    proc = bench("latency", *ENGINE, "--input-len", "8", "--output-len", "4", "--batch-size", "2",
                 "--num-iters-warmup", "1", "--num-iters", "2", "--output-json", str(out))
    result = json.loads(out.read_text())
    assert len(result["latencies"]) == 2 and all(x > 0 for x in result["latencies"])
    assert result["avg_latency"] == pytest.approx(sum(result["latencies"]) / 2)
    assert min(result["latencies"]) <= result["percentiles"]["50"] <= max(result["latencies"])
    assert f"Avg latency: {result['avg_latency']:.4f} seconds" in proc.stdout
    assert "99% percentile latency" in proc.stdout
    assert "speculative_decoding" not in result and "Speculative decoding" not in proc.stdout


def test_throughput_with_mtp_reports_acceptance(tmp_path):
    out = tmp_path / "throughput.json"
    proc = bench("throughput", *ENGINE, "--input-len", "8", "--output-len", "8", "--num-prompts", "3",
                 "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 2}', "--output-json", str(out))
    spec = json.loads(out.read_text())["speculative_decoding"]
    assert spec["num_drafts"] > 0 and spec["num_draft_tokens"] == 2 * spec["num_drafts"]
    assert spec["mean_acceptance_length"] == pytest.approx(1 + spec["num_accepted_tokens"] / spec["num_drafts"])
    assert 1.0 <= spec["mean_acceptance_length"] <= 3.0
    assert f"mean acceptance length {spec['mean_acceptance_length']:.2f}" in proc.stdout


def test_throughput(tmp_path):
    out = tmp_path / "throughput.json"
    proc = bench("throughput", *ENGINE, "--input-len", "8", "--output-len", "5", "--num-prompts", "6",
                 "--output-json", str(out))
    result = json.loads(out.read_text())
    assert result["num_requests"] == 6 and result["total_output_tokens"] == 6 * 5
    assert result["total_num_tokens"] == 6 * (8 + 5)
    assert result["output_tokens_per_second"] == pytest.approx(30 / result["elapsed_time"])
    assert "Throughput:" in proc.stdout and "requests/s" in proc.stdout


@pytest.fixture(scope="module")
def server():
    """One live server for the `bench serve` tests (its start costs more than either test's requests)."""
    s = LiveServer("--max-num-seqs", "8", "--max-model-len", "512", "--api-key", "sk-bench")
    yield s
    s.stop()


def test_serve_against_a_live_server(tmp_path, server):
    out = tmp_path / "serve.json"
    proc = bench("serve", "--base-url", server.url, "--api-key", "sk-bench", "--num-prompts", "6",
                 "--random-input-len", "16", "--random-output-len", "5", "--max-concurrency", "3",
                 "--request-rate", "20", "--metric-percentiles", "50,99", "--output-json", str(out))
    r = json.loads(out.read_text())
    assert r["completed"] == 6 and r["failed"] == 0
    assert r["total_input_tokens"] == 6 * 16 and r["total_output_tokens"] == 6 * 5
    assert 0 < r["median_ttft_ms"] <= r["p99_ttft_ms"] <= r["median_e2el_ms"] * 2
    assert r["mean_tpot_ms"] > 0 and r["mean_itl_ms"] > 0
    assert "Successful requests:             6" in proc.stdout and "P99 TTFT (ms):" in proc.stdout


def test_serve_reports_failures_without_crashing(capsys):
    """Nothing listens there: every request fails, the summary says why, the exit status is 1. (The
    command's own entry point in this process: a process would cost more than the check.)"""
    from pipespec.cli import main
    from tests.live_server import free_port

    code = main(["bench", "serve", "--port", str(free_port()), "--num-prompts", "2", "--random-input-len", "4",
                 "--random-output-len", "2"])
    out = capsys.readouterr().out
    assert code == 1, out
    assert "Failed requests:                 2" in out and "ConnectError" in out


def test_percentile_matches_linear_interpolation():
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([5.0], 99) == 5.0
    assert percentile([0.0, 10.0], 90) == 9.0


def test_serve_shared_prefix_and_multi_turn(tmp_path, server):
    hits_before = metric(httpx.get(f"{server.url}/metrics").text, "pipespec:prefix_cache_hits_total")
    out = tmp_path / "prefix.json"
    bench("serve", "--base-url", server.url, "--api-key", "sk-bench", "--num-prompts", "3", "--random-prefix-len",
          "40", "--random-input-len", "8", "--random-output-len", "3", "--output-json", str(out))
    r = json.loads(out.read_text())
    assert r["completed"] == 3 and r["total_input_tokens"] == 3 * (40 + 8) and r["random_prefix_len"] == 40
    out = tmp_path / "turns.json"
    proc = bench("serve", "--base-url", server.url, "--api-key", "sk-bench", "--num-prompts", "2", "--multi-turn",
                 "3", "--random-input-len", "10", "--random-output-len", "4", "--max-concurrency", "2",
                 "--output-json", str(out))
    metrics = httpx.get(f"{server.url}/metrics").text
    r = json.loads(out.read_text())
    assert r["completed"] == 2 * 3 and r["failed"] == 0 and r["multi_turn"] == 3
    assert r["median_ttft_first_turn_ms"] > 0 and r["median_ttft_later_turns_ms"] > 0
    # each turn resends the last one: more input than 6 single lines
    assert r["total_input_tokens"] > 6 * 10 * 2
    assert "Median TTFT, later turns (ms):" in proc.stdout
    # (the hits of these runs: the server is shared with the test above)
    assert metric(metrics, "pipespec:prefix_cache_hits_total") > hits_before
