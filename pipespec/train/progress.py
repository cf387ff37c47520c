"""Signs of life for `pipespec train-mtp` without a terminal (no progress bar): a heartbeat that logs
what the command is doing whenever nothing else was logged for a while, and its memory."""
from __future__ import annotations

import logging
import os
import resource
import sys
import threading
import time

logger = logging.getLogger(__name__)


def rss_bytes() -> int:
    """This process's resident memory now (its peak where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return peak_rss_bytes()


def peak_rss_bytes() -> int:
    """This process's peak resident memory so far."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024      # bytes on macOS, KiB on Linux


class _Stamp(logging.Handler):
    """Notes when the last record went out (it writes nothing)."""

    def __init__(self, beat: "Heartbeat"):
        super().__init__(logging.INFO)
        self.beat = beat

    def emit(self, record: logging.LogRecord) -> None:
        self.beat.last_log = time.monotonic()


class Heartbeat:
    """While entered, logs the status last set (with how long it has held and the memory in use)
    whenever no record of INFO or above was logged for `interval` seconds: a run whose stderr is no
    terminal shows no progress bar, and a step, a generation round or an evaluation can be long."""

    def __init__(self, interval: float, log: logging.Logger = logger):
        if interval <= 0:
            raise ValueError(f"the heartbeat interval must be > 0 seconds, got {interval}")
        self.interval, self.log = interval, log
        self.last_log = time.monotonic()
        self._status, self._since = "starting", time.monotonic()
        self._stop = threading.Event()
        self._stamp = _Stamp(self)
        self._thread = threading.Thread(target=self._run, name="train-heartbeat", daemon=True)

    def status(self, text: str) -> None:
        """What the command is doing now."""
        self._status, self._since = text, time.monotonic()

    def __enter__(self) -> "Heartbeat":
        logging.getLogger().addHandler(self._stamp)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        logging.getLogger().removeHandler(self._stamp)

    def _run(self) -> None:
        while not self._stop.wait(max(0.05, self.interval - (time.monotonic() - self.last_log))):
            now = time.monotonic()
            if now - self.last_log >= self.interval:
                self.log.info("still running: %s (for %.0f s; RSS %.2f GB)", self._status, now - self._since,
                              rss_bytes() / 1e9)
                self.last_log = now       # also when the log level hides the line: no busy loop
