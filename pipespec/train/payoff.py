"""Whether a head's measured agreement would make decoding faster: a simple cost model.

At batch 1 a decode step is bound by the weights it reads. A target step reads every decoder layer
plus the LM head; a draft step reads the MTP layer plus the LM head again. So, relative to a target
step, one draft costs

    d = (MTP layer + LM head) / (target decoder layers + LM head)        (weights read)

and verifying the drafts is free (1 + K rows read the same weights as one). With K drafts a step then
yields L_K tokens (the acceptance length: `evaluate.py`'s greedy walk) for 1 + K*d of the time:

    speedup(K) = L_K / (1 + K*d)

Speculation pays when the best K gives a speedup above 1; for K = 1 (L_1 = 1 + the share of steps
whose draft is accepted) that is L_1 - 1 > d.
This is the most favourable case: at larger batches verify rows cost real time too, so the bar is
higher there (the engine's adaptive K measures that instead of assuming it).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Payoff:
    draft_cost: float          # d: one draft step relative to one target step
    best_k: int
    speedup: float             # speedup(best_k)

    @property
    def pays(self) -> bool:
        return self.speedup > 1.0


def draft_cost_ratio(target_layer_params: int, mtp_params: int, head_params: int) -> float:
    """d above, from parameter counts (the LM head counted once in each)."""
    return (mtp_params + head_params) / (target_layer_params + head_params)


def payoff(acceptance_lengths: list[float], draft_cost: float) -> Payoff:
    """The best K >= 1 of the model above for measured acceptance lengths [L_1, L_2, ...]."""
    speedups = [length / (1 + k * draft_cost) for k, length in enumerate(acceptance_lengths, 1)]
    best = max(range(len(speedups)), key=speedups.__getitem__)
    return Payoff(draft_cost, best + 1, speedups[best])
