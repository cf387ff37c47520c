"""Helpers shared by test modules (fixtures live in conftest.py)."""
from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import os

import torch

from pipespec.engine.request import Request
from pipespec.engine.scheduler import Scheduler
from pipespec.sampling import SamplingParams

# Triton kernels run on CPU under the Triton interpreter (TRITON_INTERPRET=1 with triton installed):
# how the kernels are developed without a GPU. Tests marked gpu(interpret=True) run there too.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None


def make_request(request_id: str, prompt_ids: list[int], max_tokens: int = 16,
                 params: SamplingParams | None = None, seed: int = 0, arrival: int = 0,
                 eos_ids: frozenset[int] = frozenset()) -> Request:
    params = params or SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return Request(request_id, None, list(prompt_ids), params, seed, max_tokens, eos_ids)


@torch.inference_mode()
def engine_logits(llm, token_ids: list[int], chunk: int | None = None) -> torch.Tensor:
    """float32 logits at every position of `token_ids`, through the engine's own stage.

    The prompt is scheduled by a private Scheduler (its own block allocator over the engine's KV
    cache, which must hold no live request; the engine's prefix cache is reset) with a step budget of `chunk` tokens, so a chunk smaller
    than the prompt feeds it in several plans, each attending to the KV cache the earlier ones wrote.
    """
    eng = llm.engine
    assert not eng.has_unfinished_requests()
    # the private scheduler writes blocks the engine's prefix cache may name: forget them
    assert eng.reset_prefix_cache()
    cfg = dataclasses.replace(eng.config.scheduler, max_num_batched_tokens=chunk or len(token_ids),
                              enable_chunked_prefill=True)
    sched = Scheduler(cfg, eng.config.cache.block_size, eng.scheduler.allocator.num_blocks, eng.max_model_len)
    req = make_request("logits", token_ids, max_tokens=1)
    sched.add(req)
    stage = eng.executor.stage
    rows, num_plans = [], 0
    while req.num_computed_tokens < len(token_ids):
        batch = sched.schedule()
        plan = batch.plan
        assert plan.positions.tolist() == list(range(req.num_computed_tokens,
                                                     req.num_computed_tokens + plan.num_tokens))
        hidden, residual = stage.forward(plan)
        assert residual is None
        rows.append(stage.model.compute_logits(hidden).float())
        sched.complete(batch)
        num_plans += 1
    expected_plans = -(-len(token_ids) // (chunk or len(token_ids)))
    assert num_plans == expected_plans
    sched.finish(req, "length")
    return torch.cat(rows)


@torch.inference_mode()
def hf_logits(model, token_ids: list[int]) -> torch.Tensor:
    ids = torch.tensor([token_ids])
    return model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0].float()


@torch.inference_mode()
def hf_greedy(model, token_ids: list[int], new_tokens: int) -> list[int]:
    """Plain greedy decoding with transformers' KV cache, never stopping at EOS (like ignore_eos)."""
    # transformers renamed past_key_values to cache (5.x); use whichever this version takes
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = model(input_ids=torch.tensor([token_ids]), use_cache=True)
    generated = []
    for _ in range(new_tokens):
        nxt = int(out.logits[0, -1].argmax())
        generated.append(nxt)
        out = model(input_ids=torch.tensor([[nxt]]), use_cache=True, **{name: getattr(out, name)})
    return generated


def sigint_as_in_a_terminal() -> None:
    """`preexec_fn` for a child a test will Ctrl-C: SIGINT back to its default. A test suite started
    as a background job inherits SIGINT ignored, and a Python started so never raises
    KeyboardInterrupt; a program run from a terminal always does."""
    import signal
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _live_processes() -> dict[int, tuple[int, bytes]]:
    """pid -> (parent pid, command line) of every live process (zombies left out)."""
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmdline = f.read()
            except OSError:
                continue
            if fields[0] not in ("Z", "X"):
                out[int(entry)] = (int(fields[1]), cmdline)
    return out


def _multiprocessing_helpers(live: dict[int, tuple[int, bytes]], pid: int) -> set[int]:
    """`pid`'s fork server and resource tracker (one each per process, started by its first engine
    and meant to live as long). The workers the server forks carry its command line too, but they are
    not `pid`'s children."""
    return {p for p, (parent, cmd) in live.items() if parent == pid and (
        b"multiprocessing.forkserver" in cmd or b"multiprocessing.resource_tracker" in cmd)}


def started_processes(pid: int) -> set[int]:
    """The live processes `pid` started: its children and the stage workers its fork server forked
    (`runtime.launch.spawn_context`), not the server and the resource tracker themselves."""
    live = _live_processes()
    helpers = _multiprocessing_helpers(live, pid)
    return {p for p, (parent, _) in live.items() if (parent == pid and p not in helpers) or parent in helpers}


def stage_worker_pids(pid: int) -> list[int]:
    """Pids of the stage workers process `pid` started (children of its fork server)."""
    live = _live_processes()
    helpers = _multiprocessing_helpers(live, pid)
    return sorted(p for p, (parent, _) in live.items() if parent in helpers)
