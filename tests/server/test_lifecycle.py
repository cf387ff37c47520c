"""How a `serve -pp 2` process ends, with real processes and a real client: SIGTERM stops it cleanly
(exit 0, no ERROR logged, stages gone); a dead stage fails what is in flight, then the process exits
non-zero so that a supervisor restarts it."""
from __future__ import annotations

import json
import os
import signal
import time

import httpx
import pytest

from pipespec.runtime.launch import pid_alive
from tests.live_server import LiveServer

pytestmark = pytest.mark.serial      # process ends within deadlines: not beside other tests

PP2 = ("-pp", "2", "--max-model-len", "2048", "--max-num-seqs", "4")


def _gone(pids: list[int], within: float = 10) -> bool:
    deadline = time.monotonic() + within
    while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not any(pid_alive(p) for p in pids)


@pytest.mark.parametrize("to", ["process", "group"])
def test_sigterm_stops_a_pp2_server_cleanly(tmp_path, to):
    """`kill PID` (to the server) and a supervisor's SIGTERM to the whole process group alike."""
    server = LiveServer(*PP2, log=tmp_path / "server.log", log_level="INFO")
    try:
        stages = server.stage_pids()
        assert len(stages) == 1
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 4}, timeout=60)
        assert r.status_code == 200
        (os.kill if to == "process" else os.killpg)(server.proc.pid, signal.SIGTERM)
        code = server.proc.wait(30)
    finally:
        server.stop()
    log = server.output()
    assert code == 0, log[-3000:]
    assert not [line for line in log.splitlines() if " ERROR " in line or "Traceback" in line], log[-3000:]
    assert "stopped by SIGTERM" in log
    assert _gone(stages)


def test_dead_engine_fails_the_stream_then_the_server_exits_nonzero(tmp_path):
    server = LiveServer(*PP2, "--stage-timeout", "10", log=tmp_path / "server.log")
    try:
        stage = server.stage_pids()[0]
        events = []
        with httpx.stream("POST", f"{server.url}/v1/completions", timeout=60,
                          json={"prompt": "Tell me a long story", "max_tokens": 1500, "ignore_eos": True,
                                "stream": True}) as r:
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[6:])
                if len(events) == 3:                      # it is streaming: kill a stage under it
                    os.kill(stage, signal.SIGKILL)
                    killed = time.monotonic()
        code = server.proc.wait(30)
        exited = time.monotonic() - killed
    finally:
        server.stop()
    log = server.output()
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert "pipeline stage 1" in error["message"] and "killed by SIGKILL" in error["message"], error
    assert code == 1, log[-3000:]
    assert exited < 15, f"the server took {exited:.1f}s to exit"
    assert "the engine died" in log


def test_stage_of_a_killed_server_leaves_without_an_error(tmp_path):
    """The driver SIGKILLed: its idle stage sees the connection close, says so and leaves (that is
    no failure of the stage, so no ERROR)."""
    server = LiveServer(*PP2, log=tmp_path / "server.log", log_level="INFO")
    try:
        stages = server.stage_pids()
        os.kill(server.proc.pid, signal.SIGKILL)
        server.proc.wait(10)
        assert _gone(stages, within=5)
    finally:
        server.stop()
    log = server.output()
    assert not [line for line in log.splitlines() if " ERROR " in line or "Traceback" in line], log[-3000:]
