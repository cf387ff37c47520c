"""uvicorn's Server, with pipespec's shutdown: a grace period for what is in flight, then an answer
for everyone, and no signal re-raised at the end.

On SIGTERM or Ctrl-C the server stops accepting connections and lets the requests in flight run for
`shutdown_timeout` seconds. Those still running then are aborted through `on_deadline` (the engine
ends each with finish_reason "abort": a stream gets its last chunk and `[DONE]`, a plain request its
answer so far), so that every response completes by itself and uvicorn never has to cancel a
handler (which would cut the streams off and log CancelledError tracebacks). uvicorn's own cancel
is kept as a backstop, `BACKSTOP` seconds later. A second Ctrl-C aborts at once, a third stops
waiting altogether.

uvicorn re-raises the signal with the default handler after its shutdown, which would kill the
process before `pipespec serve` stops its pipeline stages (they would see the driver vanish, and
the process would exit -15 instead of 0). This server only records the signal; the caller stops the
engine and exits normally.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
from typing import Callable

import uvicorn

logger = logging.getLogger(__name__)

_HANDLED = (signal.SIGINT, signal.SIGTERM)
BACKSTOP = 5.0     # seconds past the grace period before uvicorn cancels what is still open


class GracefulServer(uvicorn.Server):
    stop_signal: int | None = None

    def __init__(self, config: uvicorn.Config, shutdown_timeout: float = 5.0,
                 on_deadline: Callable[[], None] | None = None):
        if shutdown_timeout < 0:
            raise ValueError(f"--shutdown-timeout must be >= 0 seconds, got {shutdown_timeout:g}")
        config.timeout_graceful_shutdown = int(shutdown_timeout + BACKSTOP + 0.999)
        super().__init__(config)
        self.shutdown_timeout = shutdown_timeout
        self.on_deadline = on_deadline
        self._deadline_called = False

    def handle_exit(self, sig: int, frame) -> None:
        if self.stop_signal is None:
            self.stop_signal = sig
        if self.should_exit and sig == signal.SIGINT:
            if self._deadline_called:
                self.force_exit = True      # a third Ctrl-C: stop waiting for anything
            self._deadline()                # a second Ctrl-C: answer the open requests now
        self.should_exit = True

    def _deadline(self) -> None:
        if not self._deadline_called and self.on_deadline is not None:
            self._deadline_called = True
            self.on_deadline()

    async def shutdown(self, sockets=None) -> None:
        open_connections = len(self.server_state.connections)
        if open_connections:
            logger.info("shutting down: %d connection(s) open, %g s to finish (--shutdown-timeout)",
                        open_connections, self.shutdown_timeout)
        timer = asyncio.get_running_loop().call_later(self.shutdown_timeout, self._deadline)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()

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
