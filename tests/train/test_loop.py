"""The training loop's time budget and warm-up (issue 48: `--max-time 60` trained 103 s, and the
warm-up of 50 steps never finished, so the head stayed at 0%)."""
import logging
import re
import time

import torch

from pipespec.model.mtp import DeepSeekMTP
from pipespec.train.data import Batcher, Sample
from pipespec.train.loop import TrainConfig, train
from tests.speculative.mtp_tiny import tiny_arch, tiny_target

ARCH = dict(vocab_size=4096, hidden_size=64, intermediate_size=128)   # a step long enough to time


def _samples(n: int, length: int, seed: int, vocab: int) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    return [Sample(tuple(torch.randint(0, vocab, (length,), generator=g).tolist()), 0) for _ in range(n)]


def _run(max_time, tokens_steps=10_000, warmup=None, batch=12, seq=96):
    target = tiny_target(tiny_arch(**ARCH), mixing=0.4)
    torch.manual_seed(0)
    head = DeepSeekMTP(target.arch)
    head.init_from_target(target)
    cfg = TrainConfig(num_steps=2, tokens=tokens_steps * batch * seq, batch_size=batch, seq_len=seq, lr=1e-3,
                      warmup=warmup, max_time=max_time, log_every=1000)
    batcher = Batcher(_samples(64, seq, 1, ARCH["vocab_size"]), [], batch, seq)
    t0 = time.perf_counter()
    summary = train(head, target, batcher, cfg, "cpu")
    return summary, time.perf_counter() - t0


def test_no_step_starts_that_would_end_past_max_time(caplog):
    # the pace of a step on this machine now
    pace, _ = _run(None, tokens_steps=3, warmup=1)
    step = pace["seconds"] / 3
    # a budget of 1.5 steps: the old loop started a second step at 1 step's time and ended at ~2
    # (now one step, or two where the first ran fast enough that two fit)
    budget = 1.5 * step
    with caplog.at_level(logging.INFO, logger="pipespec.train.loop"):
        summary, _ = _run(budget, warmup=1)
    assert summary["seconds"] <= budget + 0.25 * step, (summary, step)
    assert re.search(r"training ended after \d+ steps .*: the next step would end past --max-time", caplog.text)
    # a budget of 4.5 steps: ended within it, give or take how much the last step ran slower
    summary, _ = _run(4.5 * step, warmup=1)
    assert summary["steps"] >= 3 and summary["seconds"] <= 4.5 * step + 0.5 * step, (summary, step)


def test_warmup_is_a_share_of_the_steps_the_first_step_says_fit(caplog):
    with caplog.at_level(logging.INFO, logger="pipespec.train.loop"):
        summary, _ = _run(None, tokens_steps=30, batch=2, seq=16)
    assert summary["warmup"] == 3 and summary["steps"] == 30         # 10% of the 30 steps --tokens allows
    summary, _ = _run(None, tokens_steps=30, warmup=7, batch=2, seq=16)
    assert summary["warmup"] == 7                                   # --warmup given: kept
    # with a time budget: from the first step's time, and said in the log
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="pipespec.train.loop"):
        summary, _ = _run(2.0, batch=2, seq=16)
    got = re.search(r"the first step took [\d.]+ s: about (\d+) steps fit in --max-time 2 s; warm-up (\d+) steps",
                    caplog.text)
    assert got, caplog.text
    fit, warm = int(got.group(1)), int(got.group(2))
    assert warm == max(1, -(-fit // 10)) and summary["warmup"] == warm
    assert summary["steps"] > warm                                 # the run got past its warm-up
