"""Abnormal ends of `pipespec generate -pp 2`, run as a user runs it: Ctrl-C prints one line and exits
130; a killed stage exits 1 with the error; neither leaves processes or a leaked semaphore behind."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from pipespec.runtime.launch import pid_alive
from tests.helpers import sigint_as_in_a_terminal, stage_worker_pids
from tests.live_server import REPO, pipespec_env

pytestmark = pytest.mark.serial      # process ends within deadlines: not beside other tests

LEAK = "leaked semaphore"


class Generate:
    """`python -m pipespec generate -pp 2` with a long generation, its stderr collected as it comes."""

    def __init__(self):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pipespec", "generate", "-pp", "2", "--max-model-len", "4096",
             "--max-tokens", "4000", "--ignore-eos", "Tell me a long story"],
            cwd=REPO, env=pipespec_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True, preexec_fn=sigint_as_in_a_terminal)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stderr), daemon=True)
        self._reader.start()

    def wait_generating(self, timeout: float = 60) -> list[int]:
        """Once the engine is ready and has been generating for a moment: the stage workers' pids."""
        deadline = time.monotonic() + timeout
        while not any("engine ready" in line for line in self.lines):
            assert time.monotonic() < deadline and self.proc.poll() is None, "".join(self.lines)[-3000:]
            time.sleep(0.1)
        time.sleep(1.0)
        return stage_worker_pids(self.proc.pid)

    def finish(self, timeout: float = 30) -> tuple[int, str]:
        try:
            code = self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._reader.join(10)
        return code, "".join(self.lines)


def _after(text: str, marker: str) -> list[str]:
    lines = text.splitlines()
    start = max(i for i, line in enumerate(lines) if marker in line)
    return [line for line in lines[start + 1:] if line.strip()]


def _gone(pids: list[int], within: float = 10) -> bool:
    deadline = time.monotonic() + within
    while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not any(pid_alive(p) for p in pids)


def test_ctrl_c_prints_one_line_and_exits_130():
    run = Generate()
    stages = run.wait_generating()
    assert len(stages) == 1
    os.killpg(run.proc.pid, signal.SIGINT)          # what Ctrl-C in a terminal does: the whole group
    code, err = run.finish()
    assert code == 130, err[-3000:]
    assert _after(err, "engine ready") == ["interrupted"], err[-3000:]
    assert "Traceback" not in err and LEAK not in err
    assert _gone(stages)


def test_killed_stage_exits_1_without_a_leaked_semaphore():
    run = Generate()
    stages = run.wait_generating()
    os.kill(stages[0], signal.SIGKILL)
    code, err = run.finish()
    assert code == 1, err[-3000:]
    assert "error: pipeline failure" in err and "killed by SIGKILL" in err
    assert "Traceback" not in err and LEAK not in err, err[-3000:]
