"""Starting the pipeline's processes and joining them into process groups.

Two ways in:

- spawn (one machine): the driver hosts a TCPStore on a free port (the OS picks it) and starts the
  P-1 workers itself, forked from a multiprocessing fork server (`spawn_context`);
- torchrun (one or many machines): every rank is started by torchrun, which sets RANK, WORLD_SIZE,
  LOCAL_RANK, MASTER_ADDR and MASTER_PORT; rank 0 runs the driver and stage 0.

Either way the ranks then meet in the store, and build process groups of their own (never the
global default group, so an engine coexists with whatever else the program does with
torch.distributed): `ctrl` (gloo) for plans and results, `data` (gloo or NCCL) for activations, and
with tensor parallelism one `tp` group per stage (gloo on CPU, NCCL on CUDA) for its all-reduces.

Ranks: T x P of them, rank = stage * T + tp_rank (vLLM's order), so the T ranks of a stage are
neighbours (one machine's GPUs under torchrun) and rank 0 (the driver) is stage 0's TP rank 0.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

_LOCALHOST = "127.0.0.1"


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


@dataclass(frozen=True)
class TorchrunEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    agent_store: bool           # torchrun's agent hosts the store; every rank is a client


def torchrun_env() -> TorchrunEnv | None:
    """The torchrun (or equivalent) environment of this process, or None when not launched so."""
    env = os.environ
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    world = int(env["WORLD_SIZE"])
    if world <= 1:
        return None
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in env]
    if missing:
        raise ValueError(f"RANK and WORLD_SIZE are set but {', '.join(missing)} is not; launch with "
                         "torchrun or set all of RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT")
    return TorchrunEnv(rank=int(env["RANK"]), world_size=world, local_rank=int(env.get("LOCAL_RANK", 0)),
                       local_world_size=int(env.get("LOCAL_WORLD_SIZE", 1)),
                       master_addr=env["MASTER_ADDR"], master_port=int(env["MASTER_PORT"]),
                       agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true")


def host_store(timeout: float) -> tuple[dist.Store, str, int]:
    """A store on a free local port (chosen by the OS at bind time, so no race with other engines)."""
    store = dist.TCPStore(_LOCALHOST, 0, is_master=True, timeout=_td(timeout), wait_for_workers=False)
    return store, _LOCALHOST, store.port


def connect_store(host: str, port: int, timeout: float) -> dist.Store:
    return dist.TCPStore(host, port, is_master=False, timeout=_td(timeout))


def torchrun_store(env: TorchrunEnv, timeout: float) -> dist.Store:
    is_master = env.rank == 0 and not env.agent_store
    store = dist.TCPStore(env.master_addr, env.master_port, is_master=is_master, timeout=_td(timeout),
                          wait_for_workers=False)
    run = os.environ.get("TORCHELASTIC_RUN_ID", "run")
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"pipespec/{run}/{restart}", store)


def ctrl_group(store: dist.Store, rank: int, world_size: int, timeout: float):
    """gloo group for plans and results (CPU tensors). Blocks until every rank has made it."""
    return dist.ProcessGroupGloo(dist.PrefixStore("ctrl", store), rank, world_size, _td(timeout))


def data_group(store: dist.Store, rank: int, world_size: int, backend: str, device: torch.device,
               timeout: float):
    """Group for activations: NCCL between GPUs, else gloo."""
    prefixed = dist.PrefixStore("data", store)
    if backend == "nccl":
        if device.type != "cuda":
            raise ValueError(f"the nccl backend needs CUDA stages, this stage runs on {device}")
        torch.cuda.set_device(device)
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = _td(timeout)
        return dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
    return dist.ProcessGroupGloo(prefixed, rank, world_size, _td(timeout))


def tp_group(store: dist.Store, stage: int, tp_rank: int, tp_size: int, backend: str, device: torch.device,
             timeout: float):
    """The tensor-parallel group of pipeline stage `stage`: its T ranks, this one `tp_rank`. NCCL
    on CUDA (its collectives are captured by CUDA graphs), else gloo; bounded by `timeout`."""
    prefixed = dist.PrefixStore(f"tp/{stage}", store)
    if backend == "nccl":
        torch.cuda.set_device(device)
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = _td(timeout)
        return dist.ProcessGroupNCCL(prefixed, tp_rank, tp_size, opts)
    return dist.ProcessGroupGloo(prefixed, tp_rank, tp_size, _td(timeout))


def resolve_backend(backend: str, device_type: str) -> str:
    if backend == "auto":
        return "nccl" if device_type == "cuda" else "gloo"
    if backend == "nccl" and device_type != "cuda":
        raise ValueError("distributed_backend='nccl' needs CUDA; use gloo (or auto) on CPU")
    return backend


def spawn_context():
    """Workers are forked from a fork server that imported pipespec (and torch) once, the first time
    an engine starts: a spawned worker imported them again, ~3 s of CPU each. The server is a fresh
    process that never ran a model (no CUDA context, no threads), so forking from it is safe; each
    worker takes the driver's environment as of its start (`worker.spawn_entry`)."""
    import torch.multiprocessing as mp
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["pipespec.runtime.worker"])
    return ctx


def pid_alive(pid: int) -> bool:
    """True while the process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False
