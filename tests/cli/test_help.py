"""`pipespec --help`, `--version` and every command's help, as a user runs them."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

import pipespec
from tests.live_server import REPO, pipespec_env


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipespec", *args], cwd=REPO, env=pipespec_env(),
                          capture_output=True, text=True, timeout=60)


def test_version():
    proc = cli("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"pipespec {pipespec.__version__}"


def test_top_level_help_lists_every_command():
    proc = cli("--help")
    assert proc.returncode == 0
    for command in ("generate", "serve", "bench", "train-mtp", "eval-mtp", "draft-vocab"):
        assert command in proc.stdout
    assert "join as they land" not in proc.stdout


def help_text(capsys, *args: str) -> str:
    """What `pipespec ARGS --help` prints (the parser alone: no need for a process per command)."""
    from pipespec.cli import build_parser

    with pytest.raises(SystemExit) as done:
        build_parser().parse_args([*args, "--help"])
    assert done.value.code == 0
    return capsys.readouterr().out


def test_help_shows_defaults(capsys):
    text = help_text(capsys, "generate")
    out = " ".join(text[text.index("\n\n"):].split())     # past the usage lines, line wrapping undone
    for flag, default in (("--max-tokens", "until the model ends its answer, bounded by --max-model-len"),
                          ("--max-num-batched-tokens", "1024"), ("--block-size", "16"),
                          ("--max-num-seqs", "64"), ("--temperature", "0.0"), ("--dtype", "auto")):
        # the flag's own entry: no other flag between it and its "(default: ...)"
        m = re.search(re.escape(flag) + r" \S+ (?:(?! --).)*?\(default: ([^)]*)\)", out)
        assert m and m.group(1) == default, (flag, out[:2000])
    serve = " ".join(help_text(capsys, "serve").split())
    assert "--port PORT port to listen on (default: 8000)" in serve
    assert "--max-request-body-bytes" in serve and "(default: 8388608)" in serve
    for kind in ("latency", "throughput", "serve"):
        assert "(default:" in help_text(capsys, "bench", kind)
