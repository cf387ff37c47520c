"""Seeds of requests that bring none.

A request's samples are a pure function of its seed and positions, so a request with a seed draws
the same tokens whatever batch it shares. A request without one gets a seed derived from the
engine's seed and its arrival index: with an explicit engine seed a run repeats; without one
(vLLM's default) every engine starts from fresh randomness, so two runs draw different text.
"""
from __future__ import annotations

import secrets

_MIX = 0x9E3779B97F4A7C15


def engine_seed_base(engine_seed: int | None) -> int:
    return engine_seed if engine_seed is not None else secrets.randbits(63)


def unseeded_request_seed(base: int, arrival: int) -> int:
    return (base * _MIX + arrival) % 2**63
