"""Stopping `serve` while requests run, with a real server process and real clients: within the
grace period (--shutdown-timeout) requests finish by themselves; after it every open stream gets a
last chunk with finish_reason "abort" and [DONE], a plain request its answer so far; the process
exits 0 in bounded time with no traceback in its log."""
from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import openai
import pytest

from tests.live_server import LiveServer

pytestmark = pytest.mark.serial      # exit times are measured: not beside other tests

LONG = dict(max_tokens=1500, extra_body={"ignore_eos": True})


def _clean(log: str) -> None:
    bad = [line for line in log.splitlines()
           if " ERROR " in line or "Traceback" in line or "CancelledError" in line]
    assert not bad, log[-4000:]


def test_sigterm_ends_open_streams_with_abort_and_done(tmp_path):
    server = LiveServer("--shutdown-timeout", "1", "--max-num-seqs", "4", log=tmp_path / "server.log",
                        log_level="INFO")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
    started = threading.Barrier(4, timeout=120)
    chat_chunks, raw_events, plain, errors = [], [], [], []

    def chat_stream():
        try:
            stream = client.chat.completions.create(
                messages=[{"role": "user", "content": "Tell me a long story."}], model=_model(server),
                stream=True, **LONG)
            for chunk in stream:
                chat_chunks.append(chunk)
                if len(chat_chunks) == 3:
                    started.wait()
        except Exception as e:      # noqa: BLE001 (reported below)
            errors.append(("chat", repr(e)))

    def raw_stream():
        try:
            with httpx.stream("POST", f"{server.url}/v1/completions", timeout=120,
                              json={"prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": True,
                                    "stream": True}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        raw_events.append(line[6:])
                        if len(raw_events) == 3:
                            started.wait()
        except Exception as e:      # noqa: BLE001
            errors.append(("raw", repr(e)))

    def non_streaming():
        try:
            threading.Timer(1.0, started.wait).start()      # it has no chunks to wait for
            plain.append(client.completions.create(model=_model(server), prompt="The history of Rome",
                                                   **LONG))
        except Exception as e:      # noqa: BLE001
            errors.append(("plain", repr(e)))

    threads = [threading.Thread(target=f) for f in (chat_stream, raw_stream, non_streaming)]
    try:
        for t in threads:
            t.start()
        started.wait()
        time.sleep(0.5)
        server.proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        code = server.proc.wait(30)
        exit_time = time.monotonic() - signalled
        for t in threads:
            t.join(30)
    finally:
        server.stop()
    log = server.output()
    assert not errors, errors
    assert code == 0, log[-3000:]
    assert exit_time < 1 + 5, f"exited {exit_time:.1f}s after SIGTERM with --shutdown-timeout 1"
    # the chat stream (official client): its last chunk says abort, the stream ended normally
    assert len(chat_chunks) > 3
    assert chat_chunks[-1].choices[0].finish_reason == "abort", chat_chunks[-1]
    assert all(c.choices[0].finish_reason is None for c in chat_chunks[:-1])
    # the raw stream: the abort chunk, then [DONE]
    assert raw_events[-1] == "[DONE]", raw_events[-3:]
    assert json.loads(raw_events[-2])["choices"][0]["finish_reason"] == "abort", raw_events[-2]
    # the plain request: its answer so far
    assert plain and plain[0].choices[0].finish_reason == "abort"
    assert 0 < plain[0].usage.completion_tokens < 1500 and plain[0].choices[0].text
    _clean(log)
    assert "stopped by SIGTERM" in log
    print(f"\nshutdown: chat {len(chat_chunks)} chunks, raw {len(raw_events)} events, plain "
          f"{plain[0].usage.completion_tokens} tokens; exit 0 after {exit_time:.2f}s")


def _stream_and_signal(tmp_path, grace: str, max_tokens: int, signals: dict[int, int]):
    """A server with `--shutdown-timeout grace` streams one completion; after the n-th event it is
    sent signals[n]. (events, exit code, seconds from the first signal to the exit, log)."""
    server = LiveServer("--shutdown-timeout", grace, log=tmp_path / "server.log", log_level="INFO")
    events, signalled = [], None
    try:
        with httpx.stream("POST", f"{server.url}/v1/completions", timeout=120,
                          json={"prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True,
                                "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) in signals:
                        server.proc.send_signal(signals[len(events)])
                        signalled = signalled or time.monotonic()
        code = server.proc.wait(60)
        exit_time = time.monotonic() - signalled
    finally:
        server.stop()
    return events, code, exit_time, server.output()


def test_request_finishing_within_the_grace_period_ends_naturally(tmp_path):
    events, code, exit_time, log = _stream_and_signal(tmp_path, "60", 24, {2: signal.SIGTERM})
    assert code == 0, log[-3000:]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
    assert exit_time < 30, f"the server waited {exit_time:.1f}s, not just until its last request ended"
    _clean(log)


def test_requests_after_the_signal_are_refused_or_not_accepted(tmp_path):
    """A new connection after SIGTERM finds the port closed (uvicorn stopped accepting)."""
    server = LiveServer("--shutdown-timeout", "3", log=tmp_path / "server.log", log_level="INFO")
    try:
        with httpx.stream("POST", f"{server.url}/v1/completions", timeout=120,
                          json={"prompt": "Hi", "max_tokens": 1500, "ignore_eos": True, "stream": True}) as r:
            it = r.iter_lines()
            next(it)
            server.proc.send_signal(signal.SIGTERM)
            time.sleep(0.5)
            with pytest.raises(httpx.ConnectError):
                httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=5)
            rest = [line for line in it if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        assert server.proc.wait(30) == 0
    finally:
        server.stop()
    _clean(server.output())


def _model(server: LiveServer) -> str:
    return httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]["id"]


def test_second_ctrl_c_aborts_at_once(tmp_path):
    events, code, exit_time, log = _stream_and_signal(tmp_path, "120", 1500, {2: signal.SIGINT, 6: signal.SIGINT})
    assert code == 0, log[-3000:]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["choices"][0]["finish_reason"] == "abort"
    assert exit_time < 30, f"{exit_time:.1f}s: the second Ctrl-C did not cut the 120 s grace period short"
    _clean(log)
