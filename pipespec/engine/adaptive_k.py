"""Adaptive K: the driver picks each step's number of drafts, 0..K, from what it measures.

A step with k drafts per request yields, per request, 1 + E[accepted | k] tokens and costs cost(k)
seconds. Both are measured here:
- acceptance: per draft position j, the rate at which draft j is accepted given drafts 1..j-1 were
  (exponentially decayed counts, so it follows the text being generated);
- cost: seconds per step, per (batch-size bucket, k): the median of the last few steady decode steps
  (every request decodes with exactly k drafts: steps that mix in prefill chunks, or the first steps
  after k changed, `ScheduledBatch.steady`, cost something else). A median, because a step that other work on the machine
  slowed down would otherwise mark its k as costly for a long time.
`best_k` then takes the k with the most expected tokens per second (keeping the k in use unless
another is expected 3% faster: near-ties would flip on noise, and each change costs a transition).
Every k of a bucket is measured before its figures are trusted: the first bucket met at once, the
others once they have lasted SWEEP_AFTER steps (until then, e.g. while the last requests of a batch
finish one by one, a bucket borrows the figures of the nearest measured one). A small fraction of steps (~3%) tries another k,
the one measured longest ago, so every k's figures stay current (if acceptance or costs drift, the
choice follows; a figure taken while the engine warmed up does not stand for good) while exploring
costs little. A chosen exploration k is held for a few steps, so that some of them are steady (the
first one after a change is a transition).

A step at k = 0 still runs the MTP layer over its rows, for the KV later drafts attend to, so k = 0
costs more than plain decoding. When no k has paid for RETIRE_AFTER decisions in a row at the
smallest batch size measured, with every k measured there (on a CPU, where verifying more rows
costs about as much as it saves), the policy retires speculation for good: k = 0 from then on, and the plans say `drafting=False`, so
the last stage stops running the MTP layer. Drafts pay most at the smallest batch, so where they do
not pay there they pay nowhere; a larger batch that finds k = 0 best (a busy server) never retires
what a small one still gains from. The MTP KV of the positions that follow is never written, so
drafting could not resume well: retirement is final for the engine's life.

The cost of a step is the time between its result and the previous one: the driver's work and the
device's, overlapped or not (with PP the pipeline's throughput; async scheduling overlaps the steps
of one stage), so each K is charged its host time too; or since its submission after the engine was idle.
"""
from __future__ import annotations

import logging
import random
import statistics
from collections import deque
from typing import Sequence

logger = logging.getLogger(__name__)

MIN_SAMPLES = 3          # steady-step costs of a (bucket, k) before best_k trusts it
SWEEP_AFTER = 16         # steps at a batch size before all its k are measured (before: a neighbour's)
COST_WINDOW = 8          # the last steady-step costs of a (bucket, k) whose median is its cost
EXPLORE = 0.03           # fraction of steps that try another k than the best
HYSTERESIS = 0.03        # a k replaces the one in use only if expected this much faster: near-ties
                         # would flip on noise, and every change costs a transition step
ACCEPT_DECAY = 0.995     # per observation: acceptance follows the last few hundred drafts
ACCEPT_PRIOR = (0.5, 2.0)   # (rate, weight in observations) before anything is measured
RETIRE_AFTER = 32        # decisions in a row that k = 0 was best at the smallest batch measured, before retiring


def expected_tokens(accept: Sequence[float], k: int) -> float:
    """Tokens a request gains from a step with k drafts: the sampled one plus the expected accepted
    drafts, from accept[j] = P(draft j+1 accepted | drafts 1..j accepted)."""
    total, chain = 1.0, 1.0
    for j in range(k):
        chain *= accept[j]
        total += chain
    return total


def best_k(accept: Sequence[float], cost: Sequence[float | None], in_use: int | None = None) -> int:
    """The decision: the k in 0..len(cost)-1 with the most expected tokens per second,
    expected_tokens(k) / cost[k]. Unmeasured costs (None) are skipped; a tie goes to the smaller k
    (fewer drafts: less work for the same speed); `in_use` stays unless another k is expected
    HYSTERESIS faster."""
    speed = {k: expected_tokens(accept, k) / c for k, c in enumerate(cost) if c}
    if not speed:
        return 0
    best = max(speed, key=speed.get)
    return in_use if in_use in speed and speed[in_use] >= (1 - HYSTERESIS) * speed[best] else best


def bucket(num_reqs: int) -> int:
    """Batch sizes that cost about the same share a bucket: the next power of two."""
    return 1 << max(num_reqs - 1, 0).bit_length()


class AdaptiveK:
    def __init__(self, num_spec_tokens: int, num_micro_batches: int = 1, seed: int = 0):
        self.num_spec_tokens = num_spec_tokens
        self.hold = 2 * num_micro_batches + 2     # steps an explored k is kept (each micro-batch turns over)
        self._reached = [0.0] * num_spec_tokens             # decayed counts: draft j was verified (1..j-1 accepted)
        self._accepted = [0.0] * num_spec_tokens            # ... and accepted
        self._costs: dict[int, list[deque]] = {}     # bucket -> per k, the last steady-step seconds
        self._visits: dict[int, int] = {}            # bucket -> steps chosen for it
        self._measured_at: dict[int, list[int]] = {}  # bucket -> per k, the choice count at its last cost
        self._rng = random.Random(seed)
        self._held, self._hold_left = 0, 0
        self._in_use: int | None = None           # the last k chosen as the best (not explored)
        self._zero_run = 0                        # decisions in a row, on measured costs, that k = 0 was best
        self.retired = False                      # speculation retired for good (module docstring)
        self.k_steps = [0] * (num_spec_tokens + 1)          # how often each k was chosen (stats, /metrics)

    # -- what it measures ----------------------------------------------------------------------

    def acceptance(self) -> list[float]:
        rate, weight = ACCEPT_PRIOR
        return [(a + rate * weight) / (r + weight) for a, r in zip(self._accepted, self._reached)]

    def record_acceptance(self, num_drafts: int, num_accepted: int) -> None:
        """One request's verification: drafts 1..num_accepted accepted, the next (if any) rejected."""
        for j in range(min(num_drafts, num_accepted + 1)):
            self._reached[j] = ACCEPT_DECAY * self._reached[j] + 1
            self._accepted[j] = ACCEPT_DECAY * self._accepted[j] + (j < num_accepted)

    def record_step(self, num_reqs: int, k: int, seconds: float) -> None:
        """A steady decode step of num_reqs requests with k drafts each took `seconds`."""
        b = bucket(num_reqs)
        self._window(b)[k].append(seconds)
        self._measured_at.setdefault(b, [-1] * (self.num_spec_tokens + 1))[k] = sum(self.k_steps)

    def _window(self, b: int) -> list[deque]:
        return self._costs.setdefault(b, [deque(maxlen=COST_WINDOW) for _ in range(self.num_spec_tokens + 1)])

    def costs(self, b: int) -> list[float | None]:
        """Seconds per steady step of bucket b for each k (None: fewer than MIN_SAMPLES measured)."""
        return [statistics.median(w) if len(w) >= MIN_SAMPLES else None for w in self._window(b)]

    # -- the choice ----------------------------------------------------------------------------

    def choose(self, num_reqs: int) -> int:
        k = 0 if self.retired else self._choose(bucket(num_reqs))
        self.k_steps[k] += 1
        return k

    def drafting(self) -> bool:
        """Whether the step about to be planned runs the drafter (`StepPlan.drafting`)."""
        return not self.retired

    def _note_best(self, b: int, best: int, measured: bool) -> None:
        """Count the decisions in a row that found k = 0 best on the smallest measured batch size's
        own costs; retire speculation after RETIRE_AFTER of them."""
        smallest = measured and b == min(m for m in self._costs if None not in self.costs(m))
        self._zero_run = self._zero_run + 1 if best == 0 and smallest else 0
        if self._zero_run >= RETIRE_AFTER and not self.retired:
            self.retired = True
            logger.info("adaptive K: no K > 0 paid in %d decisions in a row (acceptance %s); speculation is "
                        "off for the rest of this engine's life and the MTP layer stops running", RETIRE_AFTER,
                        [round(a, 2) for a in self.acceptance()])

    def _choose(self, b: int) -> int:
        if self._hold_left > 0:
            self._hold_left -= 1
            return self._held
        self._visits[b] = self._visits.get(b, 0) + 1
        costs = self.costs(b)
        unmeasured = [k for k, c in enumerate(costs) if c is None]
        if unmeasured:
            near = self._nearest_measured(b)
            if near is None or self._visits[b] > SWEEP_AFTER:
                # measure every k of this batch size, the largest (most drafts) first
                return self._hold_k(unmeasured[-1])
            costs = self.costs(near)       # a batch size met in passing borrows its neighbour's figures
        best = self._in_use = best_k(self.acceptance(), costs, self._in_use)
        self._note_best(b, best, measured=not unmeasured)
        if self._rng.random() < EXPLORE / self.hold:     # each exploration holds its k `hold` steps
            at = self._measured_at.get(b, [-1] * (self.num_spec_tokens + 1))
            return self._hold_k(min((k for k in range(self.num_spec_tokens + 1) if k != best), key=lambda k: at[k]))
        return best

    def _nearest_measured(self, b: int) -> int | None:
        """The bucket nearest b (in factors of two) whose every k is measured."""
        full = [m for m in self._costs if None not in self.costs(m)]
        return min(full, key=lambda m: (abs(m.bit_length() - b.bit_length()), m)) if full else None

    def _hold_k(self, k: int) -> int:
        self._held, self._hold_left = k, self.hold - 1
        return k

    def as_dict(self) -> dict:
        return {"k_steps": list(self.k_steps), "retired": self.retired, "acceptance": [round(a, 4) for a in self.acceptance()],
                "step_seconds": {b: [None if c is None else round(c, 6) for c in self.costs(b)]
                                 for b in sorted(self._costs)}}


class KSequence(AdaptiveK):
    """`k_sequence`: the steps' K in turn, repeating (tests, benchmarks); measures like AdaptiveK."""

    def __init__(self, sequence: Sequence[int], num_spec_tokens: int, num_micro_batches: int = 1):
        super().__init__(num_spec_tokens, num_micro_batches)
        self.sequence, self._next = tuple(sequence), 0

    def _choose(self, b: int) -> int:
        k = self.sequence[self._next % len(self.sequence)]
        self._next += 1
        return k


def make_policy(spec, num_micro_batches: int) -> AdaptiveK | None:
    """The policy a speculative config asks for; None: K fixed at the config's."""
    if spec is None or not spec.adaptive:
        return None
    if spec.k_sequence is not None:
        return KSequence(spec.k_sequence, spec.num_speculative_tokens, num_micro_batches)
    return AdaptiveK(spec.num_speculative_tokens, num_micro_batches)
