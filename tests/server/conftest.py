"""A live `pipespec serve` process on a free port, shared by the server tests."""
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    def __init__(self, *args: str):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(os.devnull, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "pipespec", "--log-level", "WARNING", "serve",
                                      "--port", str(self.port), *args],
                                     stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} before answering")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError("server did not become healthy within 180 s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.log.close()


@pytest.fixture(scope="session")
def server():
    s = LiveServer("--max-num-seqs", "32", "--api-key", "sk-test", "--max-queued-requests", "64")
    yield s
    s.stop()


@pytest.fixture(scope="session")
def small_server():
    """A short context (32 tokens) so that fuzzed requests stay cheap."""
    s = LiveServer("--max-model-len", "32", "--max-num-seqs", "8")
    yield s
    s.stop()
