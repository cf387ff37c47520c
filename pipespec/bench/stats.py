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
