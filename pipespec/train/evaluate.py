"""Teacher-forced agreement of an MTP head with its target, per chained step.

Row t of step k agrees when the head's top-1 token for x_{t+k+1} equals the target's. Only rows
whose predicted token lies in the answer part of a sample count. On text the target generated
greedily, the target's top-1 is the next token itself, so step-k agreement is what a speculative
engine drafting k tokens would see accepted at draft k, given that drafts 1..k-1 were accepted;
`chain` is the fraction of rows where drafts 1..k are all accepted.

The mean of 1 + chain_1 + ... + chain_K over rows overstates what an engine drafting K tokens gets:
the engine does not draft from every row, only from the row after each step's last accepted token,
and since misses cluster (hard stretches of text), steps start at hard rows more often than a
uniform average assumes. So each sample is also walked as a greedy engine walks it (draft from
the first answer row, accept the run of drafts the head got right, jump past them and the target's
own token, draft again): `walk_length` is its tokens per step at K = step, what the engine's
acceptance length measures.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pipespec.speculative.draft_vocab import DraftVocab
from pipespec.train.data import Sample, collate
from pipespec.train.forward import chained_mtp, step_mask, target_pass


@dataclass
class StepAgreement:
    step: int
    positions: int
    agree: int
    chain_positions: int = 0
    chain_agree: int = 0
    walk_steps: int = 0         # the greedy walk at K = step: steps taken, tokens they yielded
    walk_tokens: int = 0

    @property
    def rate(self) -> float:
        return self.agree / max(self.positions, 1)

    @property
    def chain_rate(self) -> float:
        return self.chain_agree / max(self.chain_positions, 1)

    @property
    def walk_length(self) -> float:
        """Tokens a step with K = step drafts, as a greedy engine decoding these answers would see."""
        return self.walk_tokens / max(self.walk_steps, 1)


def walk(runs: list[int], start: int, length: int, k: int) -> tuple[int, int]:
    """(steps, tokens) of a greedy engine drafting `k` tokens a step over one sample: `runs[t]` is how
    many drafts in a row the head gets right from row t (the row whose target output is token t + 1);
    the first draft comes from row start - 1, which yields the first answer token."""
    steps = tokens = 0
    t = start - 1
    while t + 2 < length:                      # a step's drafts have a token left to predict
        accepted = min(runs[t], k, length - t - 2)    # no draft past the answer's end
        gained = accepted + (1 if t + accepted + 2 < length else 0)   # and the target's own next token
        steps, tokens = steps + 1, tokens + gained
        t += accepted + 1
    return steps, tokens


def batches(samples: list[Sample], batch_size: int, max_tokens: int | None = None) -> list[list[Sample]]:
    """The samples by length (little padding), at most `batch_size` a batch and, with `max_tokens`,
    at most that many padded tokens (but at least one sample): memory follows from the tokens,
    every [tokens, V] logits tensor being the largest thing a batch holds."""
    order = sorted(samples, key=lambda s: len(s.ids))
    out: list[list[Sample]] = []
    for s in order:
        last = out[-1] if out else None
        if last is not None and len(last) < batch_size and (
                max_tokens is None or (len(last) + 1) * len(s.ids) <= max_tokens):
            last.append(s)
        else:
            out.append([s])
    return out


def agreement(mtp, target, samples: list[Sample], num_steps: int, device, batch_size: int = 16,
              answer_only: bool = True, vocab: DraftVocab | None = None,
              max_tokens: int | None = None) -> list[StepAgreement]:
    """Per step k = 1..num_steps; `vocab`: the head drafts over a draft vocabulary's tokens only;
    `max_tokens`: padded tokens a batch at most (bounds memory, see `batches`)."""
    return agreements(mtp, target, samples, num_steps, device, [vocab], batch_size, answer_only, max_tokens)[0]


@torch.no_grad()
def agreements(mtp, target, samples: list[Sample], num_steps: int, device, vocabs: list[DraftVocab | None],
               batch_size: int = 16, answer_only: bool = True,
               max_tokens: int | None = None) -> list[list[StepAgreement]]:
    """`agreement` drafting over each of `vocabs` (None: every token), from one target pass and one
    chained head pass a batch: only the head's LM head and argmax differ between them."""
    device = torch.device(device)
    per_vocab = [[StepAgreement(k, 0, 0) for k in range(1, num_steps + 1)] for _ in vocabs]
    head = target.head_weight()
    for group in batches(samples, batch_size, max_tokens):
        ids, lens, starts = (x.to(device) for x in collate(group))
        n = ids.shape[1]
        if n < 3:
            continue
        hidden, logits = target_pass(target, ids)
        top = logits.argmax(-1)                   # the logits themselves are not needed past here
        del logits
        outs = chained_mtp(mtp, target, ids, hidden, num_steps)
        masks, teachers = [], []
        for k in range(1, num_steps + 1):
            masks.append(step_mask(lens, starts if answer_only else None, n, k))
            teachers.append(torch.zeros_like(masks[-1], dtype=torch.int64))
            teachers[-1][:, :n - k] = top[:, k:]
        for vocab, results in zip(vocabs, per_vocab):
            chain_ok = None
            runs = torch.zeros(ids.shape[0], n - 1, dtype=torch.int64, device=device)
            for out, mask, teacher, r in zip(outs, masks, teachers, results):
                student = mtp.compute_logits(out, head, vocab=vocab).argmax(-1)
                if vocab is not None:
                    student = vocab.tokens(student)
                ok = student == teacher
                chain_ok = ok if chain_ok is None else chain_ok & ok
                r.positions += int(mask.sum())
                r.agree += int((ok & mask).sum())
                r.chain_positions += int(mask.sum())
                r.chain_agree += int((chain_ok & mask).sum())
                runs += chain_ok & mask              # chain_ok is cumulative: the sum is the run length
            for row, length, start in zip(runs.tolist(), lens.tolist(), starts.tolist()):
                for r in results:     # (not answer_only: the walk starts at the first row)
                    steps, tokens = walk(row, max(start, 1) if answer_only else 1, length, r.step)
                    r.walk_steps += steps
                    r.walk_tokens += tokens
    return per_vocab


def format_table(results: list[StepAgreement]) -> str:
    lines = ["| step | positions | agreement | chain (drafts 1..k all accepted) | tokens a step at K = step |",
             "|---:|---:|---:|---:|---:|"]
    for r in results:
        lines.append(f"| {r.step} | {r.positions} | {100 * r.rate:.1f}% | {100 * r.chain_rate:.1f}% "
                     f"| {r.walk_length:.2f} |")
    lines.append(f"\nexpected tokens per target step with K={len(results)} drafts (greedy, walking the answers as "
                 f"the engine does): {results[-1].walk_length:.2f} (the chain column's mean over every row: "
                 f"{1 + sum(r.chain_rate for r in results):.2f})")
    return "\n".join(lines)


def report(title: str, results: list[StepAgreement], empty_reason: str) -> str:
    """The titled table, or, when nothing was measured, one line saying so and why: a table over
    0 positions reads like a result and is none."""
    if not any(r.positions for r in results):
        return f"\n{title}: nothing measured (0 positions): {empty_reason}"
    return f"\n{title}:\n{format_table(results)}"


def as_dict(results: list[StepAgreement]) -> list[dict]:
    return [{"step": r.step, "positions": r.positions, "agreement": round(r.rate, 4),
             "chain": round(r.chain_rate, 4), "tokens_per_step": round(r.walk_length, 4)} for r in results]
