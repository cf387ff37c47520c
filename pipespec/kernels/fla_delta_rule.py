"""fla-core's chunked gated delta rule (Triton), for Gated DeltaNet prefill chunks on a GPU.

fla-core is an optional pure-Python wheel (`pip install fla-core einops`); without it prefill runs
the PyTorch recurrence. The caller passes the step's lines padded to one length: padded rows get a
zero decay exponent and a zero write strength (g = 0, beta = 0), which leaves the state exactly as
it was, so each line's final state is the state after its last real row.
"""
from __future__ import annotations

import functools
import importlib.util

import torch


@functools.cache
def fla_available() -> bool:
    return importlib.util.find_spec("fla") is not None and importlib.util.find_spec("einops") is not None


def chunked_delta_rule(q, k, v, g, beta, state, valid):
    """q, k [B, L, H, Dk] (L2-normalised, q already scaled); v [B, L, H, Dv]; g, beta [B, L, H];
    state float32 [B, H, Dk, Dv]; valid bool [B, L]. Returns (o float32 [B, L, H, Dv], final state)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    keep = valid[..., None]
    g = torch.where(keep, g, torch.zeros((), device=g.device)).float()
    beta = torch.where(keep, beta, torch.zeros((), device=beta.device)).float()
    o, final = chunk_gated_delta_rule(q.contiguous(), k.contiguous(), v.contiguous(), g, beta, scale=1.0,
                                      initial_state=state.contiguous(), output_final_state=True)
    return o.float(), final.float()
