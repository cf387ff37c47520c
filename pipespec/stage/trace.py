"""The I4 debug trace: per step, the draft ids the first stage embedded and the last stage verified.

On with the collective check (`check_collectives`). Each stage digests the draft rows of the plan it
ran; the driver compares the first stage's digests with the last stage's (`runtime.symmetry`), so a
plan whose drafts did not reach stage 0 (the original PP + MTP bug: it embedded zeros) is caught by
name, not only through lossless output.
"""
from __future__ import annotations

import hashlib

from pipespec.layout import StepLayout


class DraftTrace:
    def __init__(self):
        self.embedded: dict[int, str] = {}
        self.verified: dict[int, str] = {}

    def record(self, step_id: int, layout: StepLayout, embeds: bool, verifies: bool) -> None:
        """`layout` on the host. A step without drafts has nothing to record."""
        if not layout.num_spec_tokens or not bool((layout.num_drafts > 0).any()):
            return
        ids = layout.draft_rows_of_input()
        digest = hashlib.sha1(ids.numpy().tobytes()).hexdigest()[:16] + f"/{int((ids >= 0).sum())}"
        if embeds:
            self.embedded[step_id] = digest
        if verifies:
            self.verified[step_id] = digest

    def report(self) -> dict:
        return {"embedded": {str(k): v for k, v in self.embedded.items()},
                "verified": {str(k): v for k, v in self.verified.items()}}
