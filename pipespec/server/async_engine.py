"""Runs the engine loop in its own thread and lets asyncio handlers submit, stream and abort.

The engine is not thread safe, so only the engine thread touches its scheduler: handlers validate a
request in a small thread pool (tokenizing and checking a prompt is read-only, and must not stall
the event loop: a huge prompt takes seconds), then post commands to a queue; outputs come back to
each request's asyncio.Queue through `call_soon_threadsafe`. A failed engine fails every pending
request with the error, marks itself unhealthy and calls `on_dead`, so that the server can stop.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

from pipespec.engine.llm_engine import EngineDeadError, LLMEngine
from pipespec.engine.outputs import RequestOutput
from pipespec.sampling import SamplingParams

logger = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    pass


class ShuttingDownError(QueueFullError):
    """The server is stopping: new requests get 503 while the ones in flight finish."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_queued_requests: int = 256, idle_wait: float = 0.05,
                 on_dead: Callable[[str], None] | None = None, validate_threads: int = 2):
        self.engine = engine
        self.max_queued_requests = max_queued_requests
        self.on_dead = on_dead
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._posted = 0          # requests posted by handlers that the engine thread has not taken yet
        self._idle_wait = idle_wait
        self._validate = ThreadPoolExecutor(validate_threads, thread_name_prefix="pipespec-validate")
        self.error: str | None = None
        self.draining = False     # set by abort_all: the server is stopping, new requests are refused
        self.stats: dict = engine.stats()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="pipespec-engine", daemon=True)
        self._thread.start()

    @property
    def healthy(self) -> bool:
        return self.error is None and self._thread.is_alive()

    @property
    def num_waiting(self) -> int:
        """Requests not running yet: posted but not taken by the engine thread, or in the scheduler's
        queue (reading a deque's length from this thread is safe)."""
        return self._posted + len(self.engine.scheduler.waiting)

    # -- called from asyncio handlers ------------------------------------------------------

    async def run_blocking(self, fn, *args):
        """Run `fn(*args)` (tokenizing, template rendering) off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._validate, fn, *args)

    async def add_request(self, prompt, params: SamplingParams,
                          prefix: str = "req") -> tuple[list[tuple[str, asyncio.Queue]], list[int]]:
        """Validate and enqueue the prompt's request (params.n of them: `LLMEngine.make_requests`);
        each one's (id, output queue), and the prompt's ids. Raises ValueError (bad input),
        QueueFullError, EngineDeadError."""
        self._check_room()                      # before paying for tokenization
        request_id = f"{prefix}-{next(self._ids)}"
        reqs = await self.run_blocking(self.engine.make_requests, request_id, prompt, params)
        out = []
        with self._lock:
            self._check_room()
            for req in reqs:
                stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
                self._streams[req.request_id] = stream
                self._posted += 1
                out.append((req.request_id, stream.outputs))
        for req in reqs:
            self._commands.put(("add", req))
        return out, reqs[0].prompt_token_ids

    def _check_room(self) -> None:
        if self.draining:
            raise ShuttingDownError("the server is shutting down; retry on another replica or later")
        if not self.healthy:
            raise EngineDeadError(f"the engine has stopped: {self.error or 'engine thread exited'}")
        waiting = self.num_waiting
        if waiting >= self.max_queued_requests:
            raise QueueFullError(f"{waiting} requests are waiting to run, the limit is "
                                 f"{self.max_queued_requests} (--max-queued-requests); retry later")

    def abort(self, request_id: str) -> None:
        with self._lock:
            known = self._streams.pop(request_id, None) is not None
        if known:
            self._commands.put(("abort", request_id))

    def abort_all(self) -> None:
        """End every request now (the shutdown grace period ran out): each stream gets a last output
        with finish_reason "abort", and requests arriving from now on are refused. Thread safe (a
        signal handler or the event loop may call it)."""
        self.draining = True
        self._commands.put(("abort_all", None))

    async def reset_prefix_cache(self, timeout: float = 10.0) -> bool:
        """Forget the engine's cached KV blocks, in the engine thread; False while requests run."""
        if not self.healthy:
            raise EngineDeadError(f"the engine has stopped: {self.error or 'engine thread exited'}")
        with self._lock:
            busy = bool(self._streams)
        if busy or self.num_waiting:
            return False
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("reset", done))
        return await asyncio.wait_for(asyncio.wrap_future(done), timeout)

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._commands.put(("stop", None))
        self._thread.join(timeout)
        self._validate.shutdown(wait=False, cancel_futures=True)
        self.engine.shutdown()

    # -- engine thread ---------------------------------------------------------------------

    def _deliver(self, request_id: str, item) -> None:
        with self._lock:
            stream = self._streams.get(request_id)
            if stream is not None and (not isinstance(item, RequestOutput) or item.finished):
                self._streams.pop(request_id)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.outputs.put_nowait, item)

    def _apply_commands(self, block: bool) -> None:
        try:
            cmd, arg = self._commands.get(timeout=self._idle_wait) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            if cmd == "add":
                self.engine.submit(arg)
                with self._lock:              # counted as waiting by the scheduler from now on
                    self._posted -= 1
            elif cmd == "abort":
                self.engine.abort_request(arg)
            elif cmd == "abort_all":
                for request_id in list(self.engine.requests):
                    out = self.engine.abort_request(request_id)
                    if out is not None:
                        self._deliver(request_id, out)
            elif cmd == "reset":
                try:
                    arg.set_result(self.engine.reset_prefix_cache())
                except Exception as e:  # noqa: BLE001 - the caller reports it
                    arg.set_exception(e)
            try:
                cmd, arg = self._commands.get_nowait()
            except queue.Empty:
                return

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self._apply_commands(block=not self.engine.has_unfinished_requests())
                if self._stop.is_set():
                    break
                if self.engine.has_unfinished_requests():
                    for out in self.engine.step():
                        self._deliver(out.request_id, out)
                self.stats = self.engine.stats()
        except Exception as e:  # the engine is broken: fail everyone, then let the server go
            logger.exception("engine loop failed")
            self.error = f"{type(e).__name__}: {e}"
            with self._lock:
                pending = list(self._streams)
            for request_id in pending:
                self._deliver(request_id, EngineDeadError(self.error))
            if self.on_dead is not None:
                self.on_dead(self.error)
