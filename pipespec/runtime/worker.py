"""The stage worker (every rank but the driver's): receive a plan, receive the activations, run the
stage, send on.

With tensor parallelism (T ranks a stage, rank = stage * T + tp_rank) every rank of a stage runs the
same `Stage.step` on the same plan; their collectives happen inside the step (`pipespec/parallel.py`).
Every rank receives each plan from the driver itself (T x P - 1 small gloo messages a step: simpler
than a broadcast inside each stage, and the driver never waits on them); activations go from TP rank
t of stage s to TP rank t of stage s + 1 (all ranks of a stage hold the same full activations after
their all-reduce); only TP rank 0 of the last stage returns the result row (the others computed the
same row and drop it).

Startup, through the store: say hello, join the ctrl group, build the stage (load its weights),
post a status (KV blocks it can hold, or the error that stopped it), wait for the driver's verdict
(the KV block count, or -1 to stop), join its stage's TP group (T > 1), allocate the KV cache (CUDA
graphs are captured there, collectives included), say ready, join the data group.

Then the loop. The wait for the next plan is unbounded (idle is not failure) but ends at once if the
driver goes away (its connections close); every other wait is bounded by the stage timeout. A
worker exits when the driver says STOP, on any error (posted to the store for the driver to report),
or when its parent process is gone. It ignores SIGINT: Ctrl-C reaches the driver, which stops it.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Callable

import torch

from pipespec.runtime import launch, symmetry
from pipespec.plan import activation_shape
from pipespec.runtime.one_host_all_reduce import OneHostAllReduce
from pipespec.runtime.step import run_stage_step
from pipespec.runtime.transport import (HEADER_LEN, IDLE_TIMEOUT, Link, Op, SendQueue, StageError, library_text,
                                        payload_len, unpack_plan)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerSettings:
    """What every rank must agree on; built from the engine config on each rank."""

    num_stages: int                 # P: pipeline stages (ranks: P x TP, `num_ranks`)
    hidden_size: int
    num_spec_tokens: int            # K of the config: the most a plan's step may use
    stage_timeout: float
    startup_timeout: float
    backend: str                    # "auto", "gloo" or "nccl" (resolved on the stage's device)
    threads: int | None = None      # torch CPU threads of the stage
    check: bool = False             # check_collectives: descriptors, symmetry and draft-trace reports
    log_level: int = logging.WARNING
    tensor_parallel_size: int = 1   # T: ranks of each stage
    custom_all_reduce: bool = False  # TP over NCCL: the one-host all-reduce for small sums

    @property
    def num_ranks(self) -> int:
        return self.num_stages * self.tensor_parallel_size

    def stage_of(self, rank: int) -> int:
        return rank // self.tensor_parallel_size

    def tp_rank_of(self, rank: int) -> int:
        return rank % self.tensor_parallel_size

    def rank_name(self, rank: int) -> str:
        """"pipeline stage 1" (T = 1) or "pipeline stage 1 TP rank 0 (rank 2)"."""
        if self.tensor_parallel_size == 1:
            return f"pipeline stage {rank}"
        return f"pipeline stage {self.stage_of(rank)} TP rank {self.tp_rank_of(rank)} (rank {rank})"


def key(kind: str, rank: int, nonce: int | None = None) -> str:
    return f"{kind}/{rank}" if nonce is None else f"{kind}/{nonce}/{rank}"


def join_tp_group(store, rank: int, stage, settings: WorkerSettings) -> symmetry.SymmetryRecorder | None:
    """Create this rank's stage TP group and attach it to the stage's `tp` (T > 1); with the
    symmetry check on, a recorder of the group's collectives (returned, for `debug_report`)."""
    if settings.tensor_parallel_size == 1:
        return None
    backend = launch.resolve_backend(settings.backend, stage.device.type)
    pg = launch.tp_group(store, settings.stage_of(rank), settings.tp_rank_of(rank), settings.tensor_parallel_size,
                         backend, stage.device, settings.stage_timeout)
    recorder = symmetry.SymmetryRecorder(rank) if settings.check else None
    check = None if recorder is None else symmetry.CollectiveChecker(
        recorder, pg, f"tp{settings.stage_of(rank)}", settings.tp_rank_of(rank), settings.tensor_parallel_size,
        stage.device)
    fast = None
    if backend == "nccl" and settings.custom_all_reduce:
        fast = OneHostAllReduce.create(store, pg, settings.stage_of(rank), settings.tp_rank_of(rank),
                                       settings.tensor_parallel_size, stage.device, stage.dtype)
    stage.tp.attach(pg, check, fast)
    return recorder


def debug_report(link: Link, stage, tp_recorder: symmetry.SymmetryRecorder | None = None) -> dict:
    """What this rank reports to the symmetry check: its messages, its TP group's collectives and,
    where the stage keeps one, its draft trace (I4)."""
    report = link.recorder.report() if link.check else {}
    if tp_recorder is not None:
        report.update(tp_recorder.report())
    trace = getattr(stage, "trace", None)
    if trace is not None:
        report["drafts"] = trace.report()
    return report


def stage_status(stage, rank: int) -> dict:
    """What a stage reports after loading: KV blocks (and state snapshots) it can hold and the size
    of what it loaded."""
    params = sum(p.numel() for m in vars(stage).values() if isinstance(m, torch.nn.Module)
                 for p in m.parameters())
    sizes = stage.available_cache()
    return {"ok": True, "rank": rank, "pid": os.getpid(), "kv_blocks": int(sizes.kv_blocks),
            "state_snapshots": sizes.state_snapshots,
            "num_params": int(params), "device": str(stage.device), "dtype": str(stage.dtype)}


def error_text(exc: BaseException) -> str:
    """One line: the exception's type and message (a torch.distributed library's message cut to its
    fact: no source-file prefix, no generic advice) and where it was raised."""
    message = str(exc)
    if message.startswith("[") and ("gloo" in message or "This is typically" in message):
        message = library_text(exc).split(": ", 1)[1]
    text = f"{type(exc).__name__}: {message}"
    tb = traceback.extract_tb(exc.__traceback__)
    if tb:
        frame = tb[-1]
        text += f" (at {os.path.basename(frame.filename)}:{frame.lineno} in {frame.name})"
    return text


# -- entry points ---------------------------------------------------------------------------------


def spawn_entry(rank: int, host: str, port: int, make_stage: Callable, settings: WorkerSettings,
                environ: dict[str, str], driver: int) -> None:
    """Target of a worker process the driver (pid `driver`) started, from the fork server, whose
    environment is the driver's as of the server's start: `environ` is the driver's now."""
    os.environ.clear()
    os.environ.update(environ)
    prepare_spawned_worker()
    _configure_logging(settings.log_level)
    _exit_with_driver(driver)
    try:
        store = launch.connect_store(host, port, settings.startup_timeout)
    except Exception as e:  # the driver is gone before we could even reach it
        logger.error("stage %d could not reach the driver's store: %s", rank, e)
        sys.exit(1)
    sys.exit(run_worker(rank, store, make_stage, settings))


def run_torchrun_worker(make_stage: Callable, settings: WorkerSettings) -> int:
    """A rank > 0 started by torchrun: serve until the driver (rank 0) says stop."""
    env = launch.torchrun_env()
    if env is None or env.rank == 0:
        raise RuntimeError("run_torchrun_worker is for ranks > 0 of a torchrun launch")
    if env.world_size != settings.num_ranks:
        raise ValueError(f"torchrun started {env.world_size} processes, but pipeline_parallel_size x "
                         f"tensor_parallel_size is {settings.num_stages} x {settings.tensor_parallel_size}; "
                         "they must be equal")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    store = launch.torchrun_store(env, settings.startup_timeout)
    return run_worker(env.rank, store, make_stage, settings)


def run_worker(rank: int, store, make_stage: Callable, settings: WorkerSettings) -> int:
    """Startup handshake, then the stage loop; returns the process exit code."""
    try:
        store.set(key("hello", rank), str(os.getpid()))
        ctrl = launch.ctrl_group(store, rank, settings.num_ranks, settings.stage_timeout)
        if settings.threads:
            torch.set_num_threads(settings.threads)
        try:
            stage = make_stage()
            status = stage_status(stage, rank)
        except Exception as e:
            logger.error("stage %d failed while loading: %s", rank, e)
            store.set(key("status", rank), json.dumps({"ok": False, "rank": rank, "error": error_text(e)}))
            store.get("num_blocks")                       # stay until the driver has read it
            return 1
        store.set(key("status", rank), json.dumps(status))
        sizes = json.loads(store.get("num_blocks"))      # waits for the driver (startup timeout)
        if sizes == -1:                                   # another stage failed: stop quietly
            return 0
        tp_recorder = join_tp_group(store, rank, stage, settings)
        stage.allocate_kv_cache(*sizes)
        store.set(key("ready", rank), "1")
        backend = launch.resolve_backend(settings.backend, stage.device.type)
        data = launch.data_group(store, rank, settings.num_ranks, backend, stage.device,
                                 settings.stage_timeout)
        link = Link(rank, ctrl, data, stage.device, check=settings.check)
        serve(rank, link, stage, settings, store, tp_recorder)
        stage.close()                 # its graphs, then its TP group: never the other way round
        return 0
    except BaseException as e:   # noqa: BLE001 - everything ends here, reported to the driver
        text = error_text(e)
        logger.error("stage %d failed: %s", rank, text)
        try:
            store.set(key("error", rank), text)
        except Exception:
            pass
        return 1


@torch.inference_mode()
def serve(rank: int, link: Link, stage, settings: WorkerSettings, store,
          tp_recorder: symmetry.SymmetryRecorder | None = None) -> None:
    """The stage loop of rank > 0 (the driver runs stage 0's TP rank 0 itself)."""
    p, t = settings.num_stages, settings.tensor_parallel_size
    first, last = settings.stage_of(rank) == 0, settings.stage_of(rank) == p - 1
    returns_result = last and settings.tp_rank_of(rank) == 0
    timeout = settings.stage_timeout
    sends = SendQueue(depth=p, timeout=timeout)
    busy = cpu = 0.0
    steps, started = 0, time.perf_counter()
    while True:
        header = next_plan_header(link, rank)
        if header is None:
            return
        op = int(header[0])
        if op == Op.STOP:
            sends.drain()
            return
        if op == Op.SYMMETRY:
            store.set(key("symmetry", rank, int(header[1])), json.dumps(debug_report(link, stage, tp_recorder)))
            continue
        if op == Op.STATS:
            stats = {"busy_s": busy, "cpu_s": cpu, "steps": steps, "wall_s": time.perf_counter() - started}
            store.set(key("stats", rank, int(header[1])), json.dumps(stats))
            continue
        if op != Op.PLAN:
            raise StageError(f"unknown op {op} in a plan header")
        payload = link.recv((payload_len(header),), torch.int64, 0, "plan.payload", timeout)
        plan = unpack_plan(header, payload)     # on the host: the stage moves what it needs
        acts = None if first else link.recv(activation_shape(plan, settings.hidden_size), stage.dtype,
                                            rank - t, "activations", timeout)
        t0, c0 = time.perf_counter(), time.thread_time()
        out = run_stage_step(stage, rank, last, plan, acts, settings.hidden_size, settings.num_spec_tokens)
        if returns_result:
            sends.add(link.send(out.cpu(), 0, "result"))
        elif not last:
            sends.add(link.send(out, rank + t, "activations"))
        busy += time.perf_counter() - t0
        cpu += time.thread_time() - c0
        steps += 1


# -- process hygiene ------------------------------------------------------------------------------


def _configure_logging(level: int) -> None:
    if not logging.getLogger().handlers:
        logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s")


def _exit_with_driver(driver: int, interval: float = 0.5) -> None:
    """Exit when the driver is gone (even if it was SIGKILLed mid-step). Not our parent: that is
    multiprocessing's fork server, which a SIGTERM to the process group ends before the driver has
    stopped its stages in order."""
    def watch():
        while True:
            time.sleep(interval)
            if not launch.pid_alive(driver):
                os._exit(1)

    threading.Thread(target=watch, name="pipespec-driver-watch", daemon=True).start()


def next_plan_header(link: Link, rank: int) -> torch.Tensor | None:
    """The next plan header from the driver; None if the driver has gone. The wait is unbounded (idle
    is not failure) and ends at once if the driver's connection closes: the driver going away while
    a stage idles is how every stage ends when the driver process was killed, so the worker logs a
    warning and leaves instead of reporting an error of its own."""
    try:
        return link.recv((HEADER_LEN,), torch.int64, 0, "plan.header", IDLE_TIMEOUT)
    except StageError as e:
        logger.warning("stage %d: the driver went away while the stage was idle (%s); leaving", rank, e)
        return None


def prepare_spawned_worker() -> None:
    """Process settings of a stage worker the driver spawned (not one started by torchrun). The driver
    owns its workers: it stops them with STOP, or kills them when they fail or it is interrupted. So
    a worker ignores SIGINT and SIGTERM (a Ctrl-C or a `kill` of the whole process group reaches the
    driver, which then stops the stages in order, instead of each stage dying on its own mid-step),
    and creates no multiprocessing semaphore: tqdm would make one for its progress-bar lock, and a
    worker killed before exiting cleanly leaves it to the resource tracker, which then warns of a
    leaked semaphore when the program ends."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from tqdm import tqdm
    tqdm.set_lock(threading.RLock())     # a thread lock: this process's bars are its own
