"""A real `python -m pipespec serve` process on a free port, running the code beside these tests."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.helpers import stage_worker_pids

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pipespec_env() -> dict:
    """Environment in which `python -m pipespec` imports this checkout (not another install)."""
    path = os.environ.get("PYTHONPATH")
    return dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{path}" if path else str(REPO),
                TOKENIZERS_PARALLELISM="false")


class LiveServer:
    """`log`: a file to receive the server's stdout and stderr (default: discarded)."""

    def __init__(self, *args: str, log: Path | None = None, log_level: str = "WARNING", startup: float = 180):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log
        self.log = open(log if log is not None else os.devnull, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "pipespec", "--log-level", log_level, "serve",
                                      "--port", str(self.port), *args],
                                     cwd=REPO, env=pipespec_env(), stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.monotonic() + startup
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} before answering"
                                   + (f":\n{self.output()[-3000:]}" if log is not None else ""))
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server did not become healthy within {startup:g} s")

    def output(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return self.log_path.read_text() if self.log_path is not None else ""

    def stage_pids(self) -> list[int]:
        """Pids of the pipeline stages the server started."""
        return stage_worker_pids(self.proc.pid)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.log.close()


def metric(text: str, name: str) -> float:
    """The value of metric `name` in a /metrics page (its first sample)."""
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"metric {name} not found")
