"""The time budgets of `pipespec train-mtp`: what each flag bounds, and the plan logged at start.

`--gen-time` bounds all generation: the held-out answers get `HELDOUT_SHARE` of it, the training
answers what is left of it afterwards (so at least the rest). Both are hard deadlines (answers under
way are cut where they are). `--max-time` bounds the training loop. What no flag bounds (loading,
tokenizing text, the final teacher-forced evaluation) is named in the plan with its size, so the
command's total time follows from its flags.
"""
from __future__ import annotations

from dataclasses import dataclass

# held-out answers are only measured on, the training answers are learned from: most of the
# generation time goes to the latter
HELDOUT_SHARE = 0.25
# loading the engine and the target, and the final evaluation of a few hundred answers, on a CPU
LOAD_AND_EVAL_SECONDS = 15.0
# the final evaluation re-reads the held-out answers and as many training answers with the target
# and K head steps: seconds of it per second of held-out generation (measured on a CPU, issue 48)
EVAL_PER_HELDOUT_SECOND = 2.0


@dataclass(frozen=True)
class GenBudget:
    total: float | None                 # --gen-time; None: unbounded

    @property
    def heldout(self) -> float | None:
        return None if self.total is None else HELDOUT_SHARE * self.total

    def deadlines(self, start: float) -> tuple[float | None, float | None]:
        """(held-out deadline, training-answers deadline) as time.monotonic() instants."""
        if self.total is None:
            return None, None
        return start + self.heldout, start + self.total


def plan_text(args, cached: str | None = None, step: str | None = None) -> str:
    """One paragraph: every phase of the command with the flag that bounds it (`cached`: the data
    file that replaces generation, if any; `step`: the training step's size and memory)."""
    g = GenBudget(args.gen_time)
    if cached is not None:
        gen = f"generation: none (reading {cached})"
    elif g.total is None:
        gen = (f"generation: unbounded (--gen-time not set): {args.heldout_prompts} held-out answers, then "
               f"the training prompts at temperatures {args.gen_temperatures}, up to {args.gen_max_tokens} tokens each")
    else:
        gen = (f"generation <= {g.total:g} s (--gen-time): held-out answers <= {g.heldout:g} s "
               f"({HELDOUT_SHARE:.0%}, at most {args.heldout_prompts}), then training answers until "
               f"{g.total:g} s")
    if args.max_time is not None:
        train = f"training <= {args.max_time:g} s (--max-time; or {args.tokens:,} tokens, if sooner)"
    else:
        train = f"training: {args.tokens:,} tokens, no time limit (--max-time sets one)"
    if step:
        train += f" in {step}"
    if args.eval_every:
        train += f", plus a 64-answer evaluation every {args.eval_every} steps (--eval-every; not in --max-time)"
    text = (f"text windows: {args.text_tokens:,} tokens from this machine's Python (--text-tokens; ~10 s per "
            f"million on a CPU core)" if args.text_tokens else "text windows: none")
    bounded = (cached is not None or g.total is not None) and args.max_time is not None
    total = (f"expect about {expected_seconds(args, cached is not None):.0f} s in all" if bounded
             else "no bound on the total: set --gen-time and --max-time for one")
    return (f"plan: {gen}; {text}; {train}; then a teacher-forced evaluation over the held-out answers and as "
            f"many training answers; plus model loading: {total} (~{eval_seconds(args, cached is not None):.0f} s "
            f"of it loading and evaluating)")


def eval_seconds(args, cached: bool = False) -> float:
    """Loading and the final evaluation: a fixed allowance, plus time in proportion to the held-out
    answers' generation (the evaluation re-reads them and as many training answers)."""
    heldout = 0.0 if cached else (GenBudget(args.gen_time).heldout or 0.0)
    return LOAD_AND_EVAL_SECONDS + EVAL_PER_HELDOUT_SECOND * heldout


def expected_seconds(args, cached: bool = False) -> float:
    """The bounded phases summed, plus an allowance for loading and evaluation."""
    gen = 0.0 if cached else (args.gen_time or 0.0)
    text = 10.0 * (args.text_tokens or 0) / 1e6
    return gen + text + (args.max_time or 0.0) + eval_seconds(args, cached)
