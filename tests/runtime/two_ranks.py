"""Run a function as two real processes (ranks 0 and 1) sharing a TCP store, and collect what each
puts on the queue as (rank, report); a rank silent past the timeout fails the test, and no process
is left behind."""
from __future__ import annotations

import queue

from pipespec.runtime import launch


def run_two_ranks(target, *args, timeout: float = 60) -> dict:
    """`target(rank, port, *args, out)` puts (rank, report) on `out`; {rank: report}."""
    store, _, port = launch.host_store(timeout)
    ctx = launch.spawn_context()
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, port, *args, out), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        return dict(out.get(timeout=timeout) for _ in procs)
    except queue.Empty:
        raise AssertionError(f"a rank did not answer within {timeout:g} s") from None
    finally:
        for p in procs:
            p.join(10)
            if p.exitcode is None:
                p.kill()
        del store
