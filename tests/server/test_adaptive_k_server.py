"""`pipespec serve` with adaptive K: the flag is accepted and /metrics counts the steps per chosen K."""
import re

import httpx

from tests.live_server import LiveServer


def test_serve_with_adaptive_k_reports_steps_per_k():
    server = LiveServer("--device", "cpu", "--max-model-len", "512", "--speculative-config",
                        '{"method": "mtp", "num_speculative_tokens": 2, "adaptive": true}')
    try:
        r = httpx.post(f"{server.url}/v1/completions", timeout=120,
                       json={"model": httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"],
                             "prompt": "The capital of France is", "max_tokens": 24, "temperature": 0,
                             "ignore_eos": True})
        assert r.status_code == 200, r.text
        metrics = httpx.get(f"{server.url}/metrics").text
    finally:
        server.stop()
    steps = {int(k): float(v) for k, v in
             re.findall(r'pipespec:spec_decode_steps_per_k_total\{k="(\d)",model_name="[^"]*"\} ([\d.]+)', metrics)}
    assert set(steps) <= {0, 1, 2} and sum(steps.values()) >= 10, metrics[-2000:]
