"""Summaries shared by the bench commands."""
from __future__ import annotations

import statistics


def percentile(values: list[float], q: float) -> float:
    """q-th percentile (0-100), linear between the closest ranks (numpy's default)."""
    if not values:
        return float("nan")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def describe(values: list[float], percentiles: tuple[float, ...], scale: float = 1.0) -> dict:
    """mean, median and the asked percentiles of `values` times `scale`."""
    if not values:
        return {"mean": None, "median": None, **{f"p{q:g}": None for q in percentiles}}
    out = {"mean": statistics.fmean(values) * scale, "median": statistics.median(values) * scale}
    out.update({f"p{q:g}": percentile(values, q) * scale for q in percentiles})
    return out


def parse_percentiles(text: str) -> tuple[float, ...]:
    try:
        qs = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"--metric-percentiles takes numbers like 50,90,99, got {text!r}") from None
    if not qs or any(not 0 <= q <= 100 for q in qs):
        raise ValueError(f"--metric-percentiles must be numbers in 0..100, got {text!r}")
    return qs


def speculation(before: dict | None, after: dict | None) -> dict | None:
    """Speculative decoding between two `llm.stats()["spec_decode"]` readings (the timed runs only):
    drafts, accepted tokens, mean acceptance length (tokens a request gains per step) and the draft
    acceptance rate. None without speculation."""
    if not after:
        return None
    before = before or {}
    drafts, draft_tokens, accepted = (after[k] - before.get(k, 0)
                                      for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"))
    return {"num_drafts": drafts, "num_draft_tokens": draft_tokens, "num_accepted_tokens": accepted,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
            "draft_acceptance_rate": accepted / draft_tokens if draft_tokens else None}


def speculation_line(spec: dict | None) -> list[str]:
    """The report's line on speculation (none without it)."""
    if spec is None:
        return []
    if not spec["num_drafts"]:
        return ["Speculative decoding: no drafts in the timed runs (adaptive K chose K = 0)"]
    return [f"Speculative decoding: mean acceptance length {spec['mean_acceptance_length']:.2f}, draft acceptance "
            f"rate {100 * spec['draft_acceptance_rate']:.1f}% ({spec['num_drafts']} drafts)"]
