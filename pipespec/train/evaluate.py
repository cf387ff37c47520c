"""Teacher-forced agreement of an MTP head with its target, per chained step.

Row t of step k agrees when the head's top-1 token for x_{t+k+1} equals the target's. Only rows
whose predicted token lies in the answer part of a sample count. On text the target generated
greedily, the target's top-1 is the next token itself, so step-k agreement is what a speculative
engine drafting k tokens would see accepted at draft k, given that drafts 1..k-1 were accepted;
`chain` is the fraction of rows where drafts 1..k are all accepted.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pipespec.train.data import Sample, collate
from pipespec.train.forward import chained_mtp, step_mask, target_pass


@dataclass
class StepAgreement:
    step: int
    positions: int
    agree: int
    chain_positions: int = 0
    chain_agree: int = 0

    @property
    def rate(self) -> float:
        return self.agree / max(self.positions, 1)

    @property
    def chain_rate(self) -> float:
        return self.chain_agree / max(self.chain_positions, 1)


@torch.no_grad()
def agreement(mtp, target, samples: list[Sample], num_steps: int, device, batch_size: int = 16,
              answer_only: bool = True) -> list[StepAgreement]:
    device = torch.device(device)
    results = [StepAgreement(k, 0, 0) for k in range(1, num_steps + 1)]
    order = sorted(samples, key=lambda s: len(s.ids))            # little padding per batch
    head = target.head_weight()
    for i in range(0, len(order), batch_size):
        ids, lens, starts = (x.to(device) for x in collate(order[i:i + batch_size]))
        n = ids.shape[1]
        if n < 3:
            continue
        hidden, logits = target_pass(target, ids)
        outs = chained_mtp(mtp, target, ids, hidden, num_steps)
        chain_ok = None
        for k, out in enumerate(outs, 1):
            mask = step_mask(lens, starts if answer_only else None, n, k)
            teacher = torch.zeros_like(mask, dtype=torch.int64)
            teacher[:, :n - k] = logits[:, k:].argmax(-1)
            student = mtp.compute_logits(out, head).argmax(-1)
            ok = student == teacher
            chain_ok = ok if chain_ok is None else chain_ok & ok
            r = results[k - 1]
            r.positions += int(mask.sum())
            r.agree += int((ok & mask).sum())
            r.chain_positions += int(mask.sum())
            r.chain_agree += int((chain_ok & mask).sum())
    return results


def format_table(results: list[StepAgreement]) -> str:
    lines = ["| step | positions | agreement | chain (drafts 1..k all accepted) |",
             "|---:|---:|---:|---:|"]
    for r in results:
        lines.append(f"| {r.step} | {r.positions} | {100 * r.rate:.1f}% | {100 * r.chain_rate:.1f}% |")
    expected = 1 + sum(r.chain_rate for r in results)
    lines.append(f"\nexpected tokens per target step with K={len(results)} drafts "
                 f"(greedy, from the chain column): {expected:.2f}")
    return "\n".join(lines)


def report(title: str, results: list[StepAgreement], empty_reason: str) -> str:
    """The titled table, or, when nothing was measured, one line saying so and why: a table over
    0 positions reads like a result and is none."""
    if not any(r.positions for r in results):
        return f"\n{title}: nothing measured (0 positions): {empty_reason}"
    return f"\n{title}:\n{format_table(results)}"


def as_dict(results: list[StepAgreement]) -> list[dict]:
    return [{"step": r.step, "positions": r.positions, "agreement": round(r.rate, 4),
             "chain": round(r.chain_rate, 4)} for r in results]
