"""The command line, run as a user runs it: a separate Python process."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def run_cli(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    return subprocess.run([sys.executable, "-m", "pipespec", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_generate_prints_a_completion():
    proc = run_cli("generate", "--max-tokens", "8", "Hello")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert out.startswith("### prompt: 'Hello'"), out
    m = re.search(r"tokens\)\n(.*)\n### (\d+) tokens, finish_reason=(\w+)\n", out, re.S)
    assert m, out
    text, n, reason = m.group(1), int(m.group(2)), m.group(3)
    assert 1 <= n <= 8 and reason in ("length", "stop") and (reason == "stop" or n == 8)
    assert text.strip(), f"empty completion in {out!r}"


@pytest.mark.parametrize("flag,value,field", [("--temperature", "-1", "temperature"),
                                              ("--top-p", "1.5", "top_p"),
                                              ("--max-tokens", "0", "max_tokens")])
def test_bad_flag_value_exits_nonzero_naming_it(flag, value, field):
    proc = run_cli("generate", flag, value, "Hello", timeout=120)
    assert proc.returncode != 0
    assert field in proc.stderr
    assert "Traceback" not in proc.stderr


def test_unparsable_flag_is_a_usage_error():
    proc = run_cli("generate", "--max-tokens", "many", "Hello", timeout=120)
    assert proc.returncode == 2 and "--max-tokens" in proc.stderr


def test_help():
    proc = run_cli("generate", "--help", timeout=120)
    assert proc.returncode == 0 and "--max-tokens" in proc.stdout and "--temperature" in proc.stdout


def test_gpu_flags_reach_the_engine():
    """--attention-backend is passed through: asking for the Triton kernels on CPU names the problem."""
    proc = run_cli("generate", "--device", "cpu", "--attention-backend", "triton", "--enforce-eager",
                   "--max-tokens", "2", "Hello", timeout=120)
    assert proc.returncode != 0
    assert "attention_backend='triton' needs a CUDA device" in proc.stderr
    assert "Traceback" not in proc.stderr
