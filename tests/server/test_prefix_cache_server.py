"""Prefix caching through the live server: hits counted in the Prometheus metrics, and the
`POST /reset_prefix_cache` route (409 while requests run)."""
import threading
import time

import httpx
import pytest

from tests.live_server import metric

PROMPT = ("A long shared system prompt for a support bot that answers questions about trains, "
          "timetables, delays and refunds, politely and briefly. " * 3)


def _metrics(server, settled=lambda text: True) -> str:
    for _ in range(100):               # the engine thread refreshes its stats after each loop
        text = httpx.get(f"{server.url}/metrics").text
        if settled(text):
            return text
        time.sleep(0.05)
    return text


@pytest.mark.serial
def test_hits_are_counted_and_the_cache_can_be_reset(server, client):
    model = client.models.list().data[0].id
    idle = lambda t: metric(t, "pipespec:num_requests_running") == 0 and metric(t, "pipespec:num_requests_waiting") == 0
    for _ in range(100):
        if httpx.post(f"{server.url}/reset_prefix_cache").status_code == 200:
            break                      # (other tests' requests may still be ending)
        time.sleep(0.1)
    before = _metrics(server, idle)
    q0, h0 = metric(before, "pipespec:prefix_cache_queries_total"), metric(before, "pipespec:prefix_cache_hits_total")
    for question in ("When is the next train?", "Can I get a refund?"):
        client.completions.create(model=model, prompt=PROMPT + question, max_tokens=2, temperature=0)
    after = _metrics(server, lambda t: metric(t, "pipespec:prefix_cache_hits_total") > h0)
    assert metric(after, "pipespec:prefix_cache_queries_total") > q0
    assert metric(after, "pipespec:prefix_cache_hits_total") - h0 >= 32, "the second prompt reuses the first's"

    # while a request runs the reset is refused (the request is a stream, closed once that is seen: the
    # server aborts it rather than running its 200 tokens)
    done, seen = threading.Event(), threading.Event()

    def long_request():
        try:
            stream = client.completions.create(model=model, prompt="Count slowly:", max_tokens=200, temperature=0,
                                               stream=True, extra_body={"ignore_eos": True})
            for _ in stream:
                if seen.is_set():
                    break
            stream.close()
        finally:
            done.set()
    thread = threading.Thread(target=long_request)
    thread.start()
    try:
        _metrics(server, lambda t: metric(t, "pipespec:num_requests_running") > 0)
        r = httpx.post(f"{server.url}/reset_prefix_cache")
        assert r.status_code == 409 and "running" in r.json()["error"]["message"]
    finally:
        seen.set()
        assert done.wait(120)
        thread.join(10)
    _metrics(server, idle)
    r = httpx.post(f"{server.url}/reset_prefix_cache")
    assert r.status_code == 200, r.text
    hits = metric(_metrics(server), "pipespec:prefix_cache_hits_total")
    client.completions.create(model=model, prompt=PROMPT + "When is the next train?", max_tokens=2, temperature=0)
    queries = metric(after, "pipespec:prefix_cache_queries_total")
    text = _metrics(server, lambda t: metric(t, "pipespec:prefix_cache_queries_total") > queries + 40)
    assert metric(text, "pipespec:prefix_cache_hits_total") == hits, "nothing is cached after a reset"
