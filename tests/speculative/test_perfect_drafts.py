"""`benchmarks/spec_machinery.py` as a user runs it, on the CPU with a 2-layer model: its constructed
MTP layer drafts right every time, so every step at K accepts all K drafts (acceptance length
K + 1), with steps continued before the verify step ahead returned (async scheduling: every line
moves on by K) and without."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.live_server import REPO, pipespec_env


@pytest.mark.parametrize("overlap", ["--async-scheduling", "--no-async-scheduling"])
def test_every_draft_of_a_perfect_head_is_accepted(overlap):
    proc = subprocess.run([sys.executable, "benchmarks/spec_machinery.py", "--device", "cpu", "--layers", "2",
                           "--batch", "1", "3", "--k", "1", "3", "--new-tokens", "13", "--repeats", "1", overlap],
                          cwd=REPO, env=pipespec_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [(r["batch"], r["K"]) for r in rows] == [(b, k) for b in (1, 3) for k in (0, 1, 3)]
    for r in rows:
        assert r["acceptance_length"] == r["K"] + 1, r
