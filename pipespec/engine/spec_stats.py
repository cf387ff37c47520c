"""Counters of speculative decoding, named as vLLM names them."""
from __future__ import annotations


class SpecDecodeStats:
    def __init__(self, num_spec_tokens: int, k_policy=None):
        """`k_policy`: adaptive K's policy, whose choices (steps per K) are reported too."""
        self.num_spec_tokens = num_spec_tokens
        self.k_policy = k_policy
        self.num_drafts = 0                 # verification rounds (request-steps with drafts)
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_position = [0] * num_spec_tokens
        self.drafts_per_position = [0] * num_spec_tokens
        self._interval_start: float | None = None

    def log_due(self, now: float, every: float) -> bool:
        """True once per `every` seconds of speculative decoding: the clock starts at the first call
        (the engine's first step), so the first summary covers `every` seconds of work, not a single step."""
        if self._interval_start is None:
            self._interval_start = now
            return False
        if now - self._interval_start < every:
            return False
        self._interval_start = now
        return True

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for j in range(num_draft_tokens):
            self.drafts_per_position[j] += 1
        for j in range(num_accepted):
            self.accepted_per_position[j] += 1

    def as_dict(self) -> dict:
        drafts = max(self.num_drafts, 1)
        adaptive = {} if self.k_policy is None else {"adaptive_k": self.k_policy.as_dict()}
        return adaptive | {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "accepted_per_position": list(self.accepted_per_position),
            "mean_acceptance_length": 1 + self.num_accepted_tokens / drafts,
            "acceptance_rate_per_position": [a / max(n, 1) for a, n in
                                             zip(self.accepted_per_position, self.drafts_per_position)],
            "draft_acceptance_rate": self.num_accepted_tokens / max(self.num_draft_tokens, 1),
        }

    def summary(self) -> str:
        d = self.as_dict()
        rates = ", ".join(f"{r:.2f}" for r in d["acceptance_rate_per_position"])
        text = (f"speculative decoding: {d['num_drafts']} drafts, {d['num_draft_tokens']} draft tokens, "
                f"{d['num_accepted_tokens']} accepted, mean acceptance length {d['mean_acceptance_length']:.2f}, "
                f"per-position acceptance [{rates}]")
        if self.k_policy is not None:
            steps = self.k_policy.k_steps
            share = ", ".join(f"{k}: {100 * n / max(sum(steps), 1):.0f}%" for k, n in enumerate(steps))
            text += f"; adaptive K, steps per K [{share}]"
        return text
