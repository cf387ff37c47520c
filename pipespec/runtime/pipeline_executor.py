"""PipelineExecutor: P stages of T ranks each in T x P processes, up to P micro-batches in flight.

The driver process runs stage 0 (its TP rank 0) itself; PP = 1 with TP > 1 runs here too, the
driver's stage then being the last one (its result is at hand after the step). `submit(plan)` sends
the plan to every worker (every rank gets every plan; `worker.py` says who sends what to whom), runs
stage 0 and sends its activations to stage 1, then returns: while the workers carry that
micro-batch on, the driver schedules and runs stage 0 of the next. `receive` waits (bounded) for the
oldest micro-batch's StepResult from the last stage.

Any failure (a stage that raises, dies or stays silent past the stage timeout) is final: the
executor marks itself failed, collects what it can learn (errors the workers posted, exit codes),
and raises StageError naming the stage; `shutdown` then stops every process it started, killing
those that do not leave in time. Nothing is left running, whatever happened.
"""
from __future__ import annotations

import atexit
import functools
import json
import logging
import os
import signal
import time
import weakref
from collections import deque
from typing import Callable

import torch

from pipespec.plan import CacheSizes, StepPlan, StepResult, least_over_stages, plan_result_shape
from pipespec.runtime import launch
from pipespec.runtime.executor import Executor, release_device_memory
from pipespec.runtime.symmetry import CollectiveMismatch, compare_reports
from pipespec.runtime.step import run_stage_step
from pipespec.runtime.transport import Link, Op, StageError, control_header, library_text, pack_plan
from pipespec.runtime.worker import (WorkerSettings, debug_report, error_text, join_tp_group, key, spawn_entry,
                                     stage_status)

logger = logging.getLogger(__name__)

_POLL = 0.02
_STOP_GRACE = 5.0      # seconds a healthy worker gets to leave after STOP
_KILL_GRACE = 2.0      # seconds between terminate and kill


class PipelineExecutor(Executor):
    """Stage 0 in this process, stages 1..P-1 in workers (spawned here, or started by torchrun)."""

    def __init__(self, stage_factories: list[Callable | None], settings: WorkerSettings,
                 torchrun: launch.TorchrunEnv | None = None):
        """`stage_factories[r]` builds stage r (picklable for r > 0 when spawning; with torchrun
        only `stage_factories[0]` is used, each rank builds its own)."""
        p, n = settings.num_stages, settings.num_ranks
        if n < 2:
            raise ValueError("PipelineExecutor needs at least 2 ranks; use LocalExecutor for one")
        if len(stage_factories) != n:
            raise ValueError(f"{len(stage_factories)} stage factories for {n} ranks")
        self.max_in_flight = p
        self.settings = settings
        self.num_spec_tokens = settings.num_spec_tokens
        self.timeout = settings.stage_timeout
        self.torchrun = torchrun
        self.stage = None
        self.link: Link | None = None
        self.procs: list = []                 # spawned worker processes (index r-1 is rank r)
        self._tp_recorder = None
        self.stage_info: list[dict] = []      # status of every stage after loading
        self._in_flight: deque[tuple[int, StepPlan, list]] = deque()   # step id, plan, sends
        self._ready: dict[int, torch.Tensor] = {}   # results of a driver stage that is the last
        self._failed: str | None = None
        self._closed = False
        self._nonce = 0
        self._busy = self._cpu = self._waiting = 0.0
        self._steps = 0
        self._started = time.perf_counter()
        self._finalizer = self._at_exit = None
        self._threads_before = None
        self.store = self._ctrl = None
        try:
            self._start(stage_factories)
        except StageError as e:
            self._failed = str(e)
            self.shutdown()
            raise
        except Exception as e:
            self._failed = error_text(e)
            self.shutdown()
            raise StageError(f"pipeline startup failed: {error_text(e)}") from e
        except BaseException:
            self._failed = "interrupted during startup"
            self.shutdown()
            raise

    # -- startup --------------------------------------------------------------------------------

    def _start(self, factories: list[Callable | None]) -> None:
        s = self.settings
        p = s.num_ranks
        if self.torchrun is None:
            self.store, host, port = launch.host_store(s.startup_timeout)
            ctx = launch.spawn_context()
            for rank in range(1, p):
                name = (f"pipespec-stage{rank}" if s.tensor_parallel_size == 1
                        else f"pipespec-stage{s.stage_of(rank)}-tp{s.tp_rank_of(rank)}")
                proc = ctx.Process(target=spawn_entry, name=name, daemon=True,
                                   args=(rank, host, port, factories[rank], s, dict(os.environ), os.getpid()))
                proc.start()
                self.procs.append(proc)
            self._finalizer = weakref.finalize(self, _reap, list(self.procs))   # if never shut down
            logger.info("started %d stage workers (pids %s), store on %s:%d", p - 1,
                        [pr.pid for pr in self.procs], host, port)
        else:
            self.store = launch.torchrun_store(self.torchrun, s.startup_timeout)
        # a program that exits without shutdown() still stops its stages politely
        self._at_exit = functools.partial(_shutdown_at_exit, weakref.ref(self))
        atexit.register(self._at_exit)
        self._wait_keys("hello", s.startup_timeout, "start")
        ctrl = launch.ctrl_group(self.store, 0, p, self.timeout)
        if s.threads:
            self._threads_before = torch.get_num_threads()
            torch.set_num_threads(s.threads)
        try:
            self.stage = factories[0]()
            status0 = stage_status(self.stage, 0)
        except Exception as e:
            self.store.set("num_blocks", "-1")
            raise StageError(f"pipeline stage 0 failed while loading: {error_text(e)}") from e
        statuses = [status0] + [json.loads(v) for v in self._wait_keys("status", s.startup_timeout, "load")]
        bad = [st for st in statuses if not st["ok"]]
        if bad:
            self.store.set("num_blocks", "-1")
            raise StageError("; ".join(f"{s.rank_name(st['rank'])} failed while loading: {st['error']}"
                                       for st in bad))
        self.stage_info = statuses
        self._ctrl = ctrl

    def _wait_keys(self, kind: str, timeout: float, what: str, nonce: int | None = None) -> list[str]:
        """Values of `kind/[nonce/]r` for every worker r, polling so a dead worker is noticed at once."""
        keys = [key(kind, r, nonce) for r in range(1, self.settings.num_ranks)]
        deadline = time.monotonic() + timeout
        while True:
            missing = [k for k in keys if not self.store.check([k])]
            if not missing:
                return [self.store.get(k).decode() for k in keys]
            for rank in range(1, self.settings.num_ranks):
                if self.store.check([key("error", rank)]):
                    raise StageError(f"{self.settings.rank_name(rank)} failed: "
                                     f"{self.store.get(key('error', rank)).decode()}")
            dead = self._dead_workers()
            if dead and all(self.store.check([k]) for k in keys):   # it answered, then left
                continue
            if dead:
                hint = ""
                if kind == "hello":
                    hint = (" (its error is printed above; note that workers are spawned, so a script "
                            "that starts an engine needs an `if __name__ == \"__main__\":` guard)")
                raise StageError(f"{dead[0]} before it could {what}{hint}")
            if time.monotonic() > deadline:
                ranks = [k.rsplit("/", 1)[1] for k in missing]
                names = ", ".join(self.settings.rank_name(int(r)) for r in ranks)
                raise StageError(f"{names} did not {what} within {timeout:g}s")
            time.sleep(_POLL)

    # -- Executor -------------------------------------------------------------------------------

    def available_cache(self) -> CacheSizes:
        return least_over_stages([CacheSizes(st["kv_blocks"], st["state_snapshots"]) for st in self.stage_info])

    def allocate_kv_cache(self, num_blocks: int, num_snapshots: int = 0) -> None:
        s = self.settings
        self.store.set("num_blocks", json.dumps([num_blocks, num_snapshots]))   # the workers allocate meanwhile
        backend = launch.resolve_backend(s.backend, self.stage.device.type)
        try:
            self._tp_recorder = join_tp_group(self.store, 0, self.stage, s)
            self.stage.allocate_kv_cache(num_blocks, num_snapshots)
            self._wait_keys("ready", s.startup_timeout, "allocate its KV cache")
            data = launch.data_group(self.store, 0, s.num_ranks, backend, self.stage.device, self.timeout)
        except StageError as e:
            self._fail(e)
        except Exception as e:
            self._fail(StageError(f"pipeline startup failed: {error_text(e)}"))
        self.link = Link(0, self._ctrl, data, self.stage.device, check=s.check)
        logger.info("pipeline of %d stages x %d TP ranks ready (backend %s, %d KV blocks each%s)", s.num_stages,
                    s.tensor_parallel_size, backend, num_blocks, ", checking collectives" if s.check else "")

    @torch.inference_mode()
    def submit(self, plan: StepPlan) -> None:
        self._check_usable()
        try:
            header, payload = pack_plan(plan)
            pending = []
            s = self.settings
            for rank in range(1, s.num_ranks):
                pending.append(self.link.send(header, rank, "plan.header"))
                pending.append(self.link.send(payload, rank, "plan.payload"))
            t0, c0 = time.perf_counter(), time.thread_time()
            last = s.num_stages == 1                  # PP = 1, TP > 1: the driver's stage is the last
            out = run_stage_step(self.stage, 0, last, plan, None, s.hidden_size, self.num_spec_tokens)
            if last:
                self._ready[plan.step_id] = out.cpu()
            else:
                pending.append(self.link.send(out, s.tensor_parallel_size, "activations"))
            self._busy += time.perf_counter() - t0
            self._cpu += time.thread_time() - c0
            self._steps += 1
            self._in_flight.append((plan.step_id, plan, pending))
        except StageError as e:
            self._fail(e)
        except Exception as e:
            self._fail(StageError(f"pipeline stage 0 failed on step {plan.step_id}: {error_text(e)}"))
        except BaseException as e:   # an interrupted submit leaves the pipeline in an unknown state
            self._failed = self._failed or f"interrupted while submitting step {plan.step_id}: {error_text(e)}"
            raise

    def receive(self, timeout: float) -> StepResult:
        self._check_usable()
        if not self._in_flight:
            raise RuntimeError("receive() with no step in flight")
        step_id, plan, pending = self._in_flight.popleft()
        t0 = time.perf_counter()
        try:
            data = self._ready.pop(step_id, None)
            if data is None:
                last_stage = (self.settings.num_stages - 1) * self.settings.tensor_parallel_size
                data = self.link.recv(plan_result_shape(plan), torch.int64,
                                      last_stage, "result", timeout)
            for p in pending:             # every message of this step has been received by now
                p.wait(timeout)
            self._waiting += time.perf_counter() - t0
        except StageError as e:
            self._fail(e)
        except Exception as e:        # e.g. gloo's "connection closed by peer" from a killed worker
            self._fail(StageError(f"pipeline failed while waiting for step {step_id}: {library_text(e)}"))
        except BaseException as e:
            self._failed = self._failed or f"interrupted while waiting for step {step_id}: {error_text(e)}"
            raise
        return StepResult.of(plan, data)

    # -- debug and measurement ------------------------------------------------------------------

    def _ask_workers(self, op: Op, kind: str) -> list[dict]:
        self._check_usable()
        if self._in_flight:
            raise RuntimeError(f"{op.name.lower()} needs a quiet pipeline; {len(self._in_flight)} steps in flight")
        self._nonce += 1
        header = control_header(op)
        header[1] = self._nonce
        try:
            for rank in range(1, self.settings.num_ranks):
                self.link.send(header, rank, "plan.header").wait(self.timeout)
            return [json.loads(v) for v in self._wait_keys(kind, self.timeout, f"answer {kind}", self._nonce)]
        except StageError as e:
            self._fail(e)

    def check_symmetry(self) -> dict:
        """Compare what every rank sent and received, channel by channel (needs the debug flag).

        Returns {rank: report}; raises CollectiveMismatch naming the channel where two ends disagree.
        """
        if not self.settings.check:
            raise RuntimeError("the symmetry check is off; start the engine with check_collectives=True "
                               "(or PIPESPEC_CHECK_COLLECTIVES=1)")
        workers = self._ask_workers(Op.SYMMETRY, "symmetry")
        reports = {0: debug_report(self.link, self.stage, self._tp_recorder)}
        reports.update({r + 1: rep for r, rep in enumerate(workers)})
        problems = compare_reports(reports)
        if problems:
            raise CollectiveMismatch("ranks disagree about their messages: " + " | ".join(problems))
        return reports

    def stats(self) -> list[dict]:
        """Per stage: seconds spent running its layers (wall `busy_s`, this thread's CPU `cpu_s`),
        steps, and wall seconds since it started. Stage 0 (the driver) also reports `wait_s`, the time
        it spent waiting for results; the rest of its time went to scheduling and bookkeeping."""
        own = {"busy_s": self._busy, "cpu_s": self._cpu, "wait_s": self._waiting, "steps": self._steps,
               "wall_s": time.perf_counter() - self._started}
        return [own] + self._ask_workers(Op.STATS, "stats")

    @property
    def failed(self) -> bool:
        return self._failed is not None

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    # -- failure and shutdown -------------------------------------------------------------------

    def _check_usable(self) -> None:
        if self._failed is not None:
            raise StageError(f"the pipeline has failed: {self._failed}")
        if self._closed:
            raise StageError("the pipeline is shut down")

    def _fail(self, err: StageError):
        """Record the failure with what the workers can tell about it; raise StageError."""
        if self._failed is None:
            detail = self._diagnose()
            # the cause first (which rank died or failed), what the driver saw of it after
            self._failed = f"{detail}; the driver saw: {err}" if detail else f"{err}"
            logger.error("pipeline failed: %s", self._failed)
        raise StageError(self._failed) from err

    def _diagnose(self, wait: float = 1.0) -> str:
        """Errors posted by workers and workers that died, waiting briefly for the evidence. A posted
        error alone does not end the wait: a worker killed outright posts nothing, and its neighbours'
        "connection lost" may be posted before its exit is seen, which would name the wrong stage."""
        deadline = time.monotonic() + wait
        while True:
            posted = {}
            for rank in range(1, self.settings.num_ranks):
                try:
                    if self.store.check([key("error", rank)]):
                        posted[rank] = self.store.get(key("error", rank)).decode()
                except Exception:
                    pass
            dead = self._dead_workers()
            if dead or time.monotonic() > deadline:
                break
            time.sleep(_POLL)
        name = self.settings.rank_name
        facts = [f"{name(r)} failed: {text}" for r, text in sorted(posted.items())]
        facts += [d for d in dead if not any(d.startswith(f"{name(r)} ") for r in posted)]
        return "; ".join(facts)

    def _dead_workers(self) -> list[str]:
        out = []
        for rank, proc in enumerate(self.procs, start=1):
            code = proc.exitcode
            if code is not None:
                how = (f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}")
                out.append(f"{self.settings.rank_name(rank)} (pid {proc.pid}) {how}")
        return out

    def shutdown(self) -> None:
        """Stop every stage: politely when healthy (draining what is in flight), else by force."""
        if self._closed:
            return
        problem = None
        healthy = self._failed is None and self.link is not None
        if healthy:
            try:
                while self._in_flight:          # let the stages finish what they hold
                    self.receive(self.timeout)
                if self.settings.check:
                    self.check_symmetry()
            except CollectiveMismatch as e:
                problem = e
            except BaseException:
                healthy = False
        self._closed = True
        if healthy:
            try:
                stop = control_header(Op.STOP)
                sends = [self.link.send(stop, rank, "plan.header") for rank in range(1, self.settings.num_ranks)]
                for s in sends:
                    s.wait(_KILL_GRACE)
            except StageError:
                healthy = False
        _reap(self.procs, _STOP_GRACE if healthy else 0.5)
        if self._finalizer is not None:
            self._finalizer.detach()
        if self._at_exit is not None:
            atexit.unregister(self._at_exit)
        if self._threads_before is not None:     # this process is the driver again, not a stage
            torch.set_num_threads(self._threads_before)
        self._in_flight.clear()
        self._ready.clear()
        if self.stage is not None:
            self.stage.close()        # its graphs, then its TP group: never the other way round
        self.link = self._ctrl = None
        self.stage = None
        self.store = None
        release_device_memory()
        if problem is not None:
            raise problem


def _shutdown_at_exit(ref) -> None:
    executor = ref()
    if executor is not None:
        try:
            executor.shutdown()
        except Exception as e:   # noqa: BLE001 - nothing left to report it to
            logger.warning("pipeline shutdown at exit: %s", e)


def _reap(procs: list, grace: float = 0.0) -> None:
    """Join worker processes; terminate, then kill, those still there after `grace` seconds."""
    deadline = time.monotonic() + grace
    for proc in procs:
        proc.join(max(deadline - time.monotonic(), 0.0))
    for proc in procs:
        if proc.exitcode is None:
            proc.terminate()
    deadline = time.monotonic() + min(_KILL_GRACE, max(grace, 0.5))
    for proc in procs:
        proc.join(max(deadline - time.monotonic(), 0.0))
    for proc in procs:
        if proc.exitcode is None:
            try:
                os.kill(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.join(_KILL_GRACE)
