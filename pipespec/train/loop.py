"""The MTP training loop: a frozen target, K chained steps, soft targets from the target itself.

Each batch costs one teacher-forced pass of the target (no grad), which gives the inputs (h_t,
x_{t+1}) and the targets (the target's distribution for x_{t+k+1} at step k). The loss is the
cross-entropy of the head's distribution against the target's (equal to the KL divergence up to
the target's entropy), step k weighted by `step_weight ** (k - 1)`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from pipespec.train.data import Batcher
from pipespec.train.forward import chained_mtp, step_mask, target_pass
from pipespec.train.progress import peak_rss_bytes, rss_bytes
from pipespec.train.sizing import auto_warmup, expected_steps

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainConfig:
    num_steps: int = 3                # K: chained MTP steps trained (and evaluated)
    tokens: int = 20_000_000          # training tokens (batch rows x sequence length, summed over steps)
    batch_size: int = 48
    seq_len: int = 320
    lr: float = 1e-3
    min_lr_ratio: float = 0.05
    warmup: int | None = None         # None: a share of the steps the run is expected to take
    weight_decay: float = 0.0
    step_weight: float = 0.8
    grad_clip: float = 1.0
    seed: int = 0
    max_time: float | None = None     # seconds of training; the LR schedule follows time as well
    log_every: int = 50
    log_interval: float | None = None  # seconds: also log when the last progress line is this old
    eval_every: int = 0               # steps between calls of train()'s `evaluate` (0: never)
    checkpoint: str | None = None     # path of the resumable training state
    checkpoint_every: int = 500

    def __post_init__(self):
        if self.num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {self.num_steps}")
        if self.seq_len < self.num_steps + 2:
            raise ValueError(f"seq_len must be >= num_steps + 2, got {self.seq_len}")

    @property
    def total_steps(self) -> int:
        return max(1, self.tokens // (self.batch_size * self.seq_len))


def lr_at(cfg: TrainConfig, step: int, elapsed: float, warmup: int | None = None) -> float:
    """Linear warm-up, then cosine decay over the run's progress: the larger of the step fraction
    and (with max_time) the time fraction, so the schedule ends whichever limit comes first.
    `warmup`: the steps of warm-up when cfg.warmup is None (train() estimates them)."""
    progress = step / cfg.total_steps
    if cfg.max_time:
        progress = max(progress, elapsed / cfg.max_time)
    warm_steps = cfg.warmup if cfg.warmup is not None else (warmup or auto_warmup(cfg.total_steps))
    warm = min(1.0, (step + 1) / max(warm_steps, 1))
    cosine = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return cfg.lr * warm * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)


def _autocast(device: torch.device):
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def batch_loss(mtp, target, ids: torch.Tensor, lens: torch.Tensor, num_steps: int, step_weight: float):
    """(weighted loss, per-step list of (rows, agreeing rows, CE sum, KL sum)) for one batch."""
    hidden, logits = target_pass(target, ids)
    n = ids.shape[1]
    with _autocast(ids.device):
        outs = chained_mtp(mtp, target, ids, hidden, num_steps)
    head = target.head_weight()
    with torch.no_grad():
        teacher_logp = F.log_softmax(logits.float(), dim=-1)       # [B, N, V], shared by every step
        del logits
    total = torch.zeros((), device=ids.device)
    stats = []
    for k, out in enumerate(outs, 1):
        mask = step_mask(lens, None, n, k)
        rows = int(mask.sum())
        if rows == 0:
            stats.append((0, 0, 0.0, 0.0))
            continue
        with torch.no_grad():
            logp = teacher_logp[:, k:][mask[:, :n - k]]               # z_{t+k}: predicts x_{t+k+1}
            p = logp.exp()
            entropy = -(p * logp).sum()
        with _autocast(ids.device):
            student = mtp.compute_logits(out[mask], head)
        student = student.float()
        ce = F.cross_entropy(student, p, reduction="sum")
        with torch.no_grad():
            agree = int((student.argmax(-1) == logp.argmax(-1)).sum())
        del logp
        total = total + (step_weight ** (k - 1)) * ce / rows
        stats.append((rows, agree, float(ce.detach()), float(ce.detach() - entropy)))
    return total, stats


def _save_state(path: str, mtp, opt, step: int, elapsed: float, cfg: TrainConfig) -> None:
    tmp = f"{path}.tmp"
    torch.save({"mtp": mtp.state_dict(), "opt": opt.state_dict(), "step": step, "elapsed": elapsed,
                "config": dataclasses.asdict(cfg)}, tmp)
    os.replace(tmp, path)


def _load_state(path: str, mtp, opt, cfg: TrainConfig) -> tuple[int, float]:
    state = torch.load(path, map_location="cpu", weights_only=True)
    old = state["config"]
    for key in ("num_steps", "batch_size", "seq_len", "seed"):
        if old[key] != getattr(cfg, key):
            raise ValueError(f"checkpoint {path} was made with {key}={old[key]}, this run has "
                             f"{key}={getattr(cfg, key)}; resume with the same settings")
    mtp.load_state_dict(state["mtp"])
    opt.load_state_dict(state["opt"])
    return int(state["step"]), float(state["elapsed"])


def train(mtp, target, batcher: Batcher, cfg: TrainConfig, device, resume: bool = False,
          on_checkpoint: Callable[[int], None] | None = None,
          evaluate: Callable[[int], None] | None = None,
          status: Callable[[str], None] | None = None) -> dict:
    """Train `mtp` (float32 master weights) against the frozen `target`; returns a summary.

    With `resume` and an existing `cfg.checkpoint`, continues from it (same data order, same
    schedule). `on_checkpoint(step)` runs after each checkpoint (e.g. to write the head file);
    `evaluate(step)` every `cfg.eval_every` steps (its time does not count against `max_time`);
    `status(text)` is told what the loop is doing before each step (for a heartbeat log).

    With `max_time`, no step starts that would end past it at the recent steps' pace, so the loop
    ends within the budget unless a step runs slower than those before it. With `cfg.warmup`
    None, warm-up is a share of the steps the run is expected to take, estimated from the first
    step's time.
    """
    device = torch.device(device)
    target.requires_grad_(False)
    mtp.train()
    params = [p for p in mtp.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay,
                            fused=device.type == "cuda")
    step, elapsed = 0, 0.0
    if resume and cfg.checkpoint and Path(cfg.checkpoint).exists():
        step, elapsed = _load_state(cfg.checkpoint, mtp, opt, cfg)
        logger.info("resumed from %s at step %d (%.0f s trained)", cfg.checkpoint, step, elapsed)
    window = [[0, 0, 0.0, 0.0] for _ in range(cfg.num_steps)]
    window_loss, window_steps, window_tokens = 0.0, 0, 0
    bar = tqdm(total=cfg.total_steps, initial=step, desc="Training MTP", unit="step", disable=None)
    t_start = time.perf_counter() - elapsed
    t_window = time.perf_counter()
    durations: list[float] = []          # this process's steps, in seconds (evaluation excluded)
    expected = expected_steps(cfg.total_steps, None, None)
    warmup = cfg.warmup if cfg.warmup is not None else auto_warmup(expected)
    last = "no step finished yet"
    budget = f" of {cfg.max_time:g} s" if cfg.max_time else ""
    ended = f"{cfg.tokens:,} tokens done"
    while step < cfg.total_steps:
        pace = sum(durations[-3:]) / len(durations[-3:]) if durations else 0.0
        if cfg.max_time and (elapsed >= cfg.max_time or (pace and elapsed + pace > cfg.max_time)):
            ended = (f"the next step would end past --max-time {cfg.max_time:g} s (steps take ~{pace:.1f} s)"
                     if elapsed < cfg.max_time else f"--max-time {cfg.max_time:g} s reached")
            break
        if status:
            status(f"training: step {step + 1} of ~{expected} under way ({last}; {elapsed:.0f} s{budget})")
        t_step = time.perf_counter()
        ids, lens, _ = batcher.batch(step)
        ids, lens = ids.to(device, non_blocking=True), lens.to(device, non_blocking=True)
        lr = lr_at(cfg, step, elapsed, warmup)
        for group in opt.param_groups:
            group["lr"] = lr
        loss, stats = batch_loss(mtp, target, ids, lens, cfg.num_steps, cfg.step_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.grad_clip:
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        step += 1
        durations.append(time.perf_counter() - t_step)
        elapsed = time.perf_counter() - t_start
        if cfg.max_time:
            expected = expected_steps(cfg.total_steps, cfg.max_time, sum(durations[-3:]) / len(durations[-3:]),
                                      step, elapsed)
            if len(durations) == 1:
                if cfg.warmup is None:
                    warmup = auto_warmup(expected)
                logger.info("the first step took %.1f s: about %d steps fit in --max-time %g s; warm-up %d steps%s",
                            durations[0], expected, cfg.max_time, warmup,
                            "" if cfg.warmup is None else " (--warmup)")
        for w, s in zip(window, stats):
            for i in range(4):
                w[i] += s[i]
        window_loss += float(loss.detach())
        window_steps += 1
        window_tokens += int(lens.sum())
        bar.update(1)
        last = f"last loss {float(loss.detach()):.3f}, step-1 agreement {stats[0][1] / max(stats[0][0], 1):.3f}"
        overdue = cfg.log_interval is not None and time.perf_counter() - t_window >= cfg.log_interval
        if step % cfg.log_every == 0 or step == cfg.total_steps or overdue:
            agree = [w[1] / max(w[0], 1) for w in window]
            kl = [w[3] / max(w[0], 1) for w in window]
            dt = time.perf_counter() - t_window
            bar.set_postfix(loss=f"{window_loss / window_steps:.3f}", agree1=f"{agree[0]:.3f}")
            logger.info("step %d/~%d  loss %.4f  KL %s  agreement %s  lr %.2e  %.0f tok/s  %.0f s%s  RSS %.2f GB",
                        step, expected, window_loss / window_steps,
                        " ".join(f"{x:.3f}" for x in kl), " ".join(f"{x:.3f}" for x in agree), lr,
                        window_tokens / max(dt, 1e-9), elapsed, budget, rss_bytes() / 1e9)
            window = [[0, 0, 0.0, 0.0] for _ in range(cfg.num_steps)]
            window_loss, window_steps, window_tokens, t_window = 0.0, 0, 0, time.perf_counter()
        if evaluate and cfg.eval_every and step % cfg.eval_every == 0:
            t_eval = time.perf_counter()
            mtp.eval()
            if status:
                status(f"training: evaluating at step {step}")
            evaluate(step)
            mtp.train()
            t_start += time.perf_counter() - t_eval
        if cfg.checkpoint and step % cfg.checkpoint_every == 0:
            _save_state(cfg.checkpoint, mtp, opt, step, elapsed, cfg)
            if on_checkpoint:
                on_checkpoint(step)
    bar.close()
    logger.info("training ended after %d steps in %.1f s%s: %s; warm-up was %d steps; peak RSS %.2f GB",
                step, elapsed, budget, ended, warmup, peak_rss_bytes() / 1e9)
    if cfg.checkpoint:
        _save_state(cfg.checkpoint, mtp, opt, step, elapsed, cfg)
    mtp.eval()
    return {"steps": step, "tokens": step * cfg.batch_size * cfg.seq_len, "seconds": round(elapsed, 1),
            "warmup": warmup}
