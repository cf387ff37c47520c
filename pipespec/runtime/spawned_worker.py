"""Process settings of a stage worker that the driver spawned (not one started by torchrun).

The driver owns its workers: it stops them with STOP, or kills them when they fail or it is
interrupted. So a worker ignores SIGINT and SIGTERM (a Ctrl-C or a `kill` sent to the whole process
group reaches the driver, which then stops the stages in order, instead of each stage dying on its
own mid-step), and it creates no multiprocessing semaphore: tqdm would make one for its progress-bar
lock, and a worker killed before exiting cleanly leaves it to the resource tracker, which then warns
of a leaked semaphore when the program ends.
"""
from __future__ import annotations

import signal
import threading


def prepare_spawned_worker() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from tqdm import tqdm
    tqdm.set_lock(threading.RLock())     # a thread lock: this process's bars are its own
