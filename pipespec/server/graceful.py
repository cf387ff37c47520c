"""uvicorn's Server, minus the signal it re-raises after a graceful shutdown.

uvicorn shuts down on SIGTERM or SIGINT, then raises the same signal again with the default handler,
which kills the process before `pipespec serve` stops its pipeline stages (they then see the driver
vanish, and the process exits -15 instead of 0). This server only records the signal; the caller
stops the engine and exits normally.
"""
from __future__ import annotations

import contextlib
import signal
import threading

import uvicorn

_HANDLED = (signal.SIGINT, signal.SIGTERM)


class GracefulServer(uvicorn.Server):
    stop_signal: int | None = None

    def handle_exit(self, sig: int, frame) -> None:
        if self.stop_signal is None:
            self.stop_signal = sig
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True          # a second Ctrl-C: stop waiting for open requests
        self.should_exit = True

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in _HANDLED}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
