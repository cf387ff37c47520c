"""The command line, run as a user runs it: a separate Python process wherever the run gets as far as
an engine; the refusals decided from the arguments alone go through the same entry point in this
process (`python -m pipespec` is `sys.exit(main())`; a process each cost more than the check)."""
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


def run_main(capsys, *args: str) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `pipespec ARGS` run through cli.main in this process."""
    from pipespec.cli import main
    try:
        code = main(list(args))
    except SystemExit as e:                 # argparse's own refusals and --help
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


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
    rate = re.search(r"### (\d+) tokens generated in ([\d.]+) s: ([\d.]+) tokens/s", out)
    assert rate and int(rate.group(1)) == n and float(rate.group(3)) > 0, out


@pytest.mark.parametrize("flag,value,field", [("--temperature", "-1", "temperature"),
                                              ("--top-p", "1.5", "top_p"),
                                              ("--max-tokens", "0", "max_tokens")])
def test_bad_flag_value_exits_nonzero_naming_it(flag, value, field, capsys):
    code, _, err = run_main(capsys, "generate", flag, value, "Hello")
    assert code != 0
    assert field in err
    assert "Traceback" not in err


def test_unparsable_flag_is_a_usage_error(capsys):
    code, _, err = run_main(capsys, "generate", "--max-tokens", "many", "Hello")
    assert code == 2 and "--max-tokens" in err


def test_help(capsys):
    code, out, _ = run_main(capsys, "generate", "--help")
    assert code == 0 and "--max-tokens" in out and "--temperature" in out


def test_gpu_flags_reach_the_engine():
    """--attention-backend is passed through: asking for the Triton kernels on CPU names the problem."""
    proc = run_cli("generate", "--device", "cpu", "--attention-backend", "triton", "--enforce-eager",
                   "--max-tokens", "2", "Hello", timeout=120)
    assert proc.returncode != 0
    assert "attention_backend='triton' needs a CUDA device" in proc.stderr
    assert "Traceback" not in proc.stderr


# -- vLLM's flags: accepted and applied, or refused by name with the reason (issue 48) -------------


@pytest.mark.parametrize("flag,reason", [("--enable-lora", "LoRA"), ("--data-parallel-size=2", "load balancer"),
                                         ("--ssl-keyfile", "TLS"), ("--model-impl", "own implementation")])
def test_refused_vllm_flag_exits_2_naming_it_and_why(flag, reason, capsys):
    code, _, err = run_main(capsys, "serve", flag, "x")
    assert code == 2, err
    line = err.strip()
    assert line.startswith(f"pipespec: error: {flag.split('=')[0]} is not supported: ") and reason in line, line
    assert "Traceback" not in err and len(line.splitlines()) == 1


def test_kv_cache_dtype_auto_only(capsys):
    from pipespec.cli import build_parser
    assert build_parser().parse_args(["serve", "--kv-cache-dtype", "auto"]).kv_cache_dtype == "auto"
    code, _, err = run_main(capsys, "serve", "--kv-cache-dtype", "fp8")
    assert code == 2 and "FP8 KV caches are not implemented" in err


def test_vllm_engine_flags_reach_the_engine_config():
    from pipespec.cli import build_parser
    from pipespec.config import EngineConfig
    from pipespec.engine.args import engine_kwargs
    args = build_parser().parse_args(
        ["serve", "--tokenizer", "org/tok", "--revision", "v2", "--download-dir", "/d", "--trust-remote-code",
         "--chat-template", "{{ x }}", "--no-enable-chunked-prefill", "--max-model-len", "2K",
         "--disable-log-requests", "--uvicorn-log-level", "info", "--served-model-name", "a", "b",
         "--enable-log-requests", "--disable-log-stats", "--shutdown-timeout", "2"])
    cfg = EngineConfig.from_kwargs(**engine_kwargs(args))
    m = cfg.model
    assert (m.tokenizer, m.revision, m.download_dir, m.chat_template, m.max_model_len) == \
        ("org/tok", "v2", "/d", "{{ x }}", 2048)
    assert cfg.scheduler.enable_chunked_prefill is False
    assert args.served_model_name == ["a", "b"] and args.disable_log_requests and args.shutdown_timeout == 2.0
    on = EngineConfig.from_kwargs(**engine_kwargs(build_parser().parse_args(
        ["serve", "--enable-chunked-prefill", "--num-gpu-blocks-override", "77", "--tokenizer-mode", "auto",
         "--disable-custom-all-reduce"])))
    assert on.scheduler.enable_chunked_prefill is True and on.cache.num_kv_blocks == 77
    assert on.parallel.custom_all_reduce is False


@pytest.mark.parametrize("text,value", [("4096", 4096), ("1k", 1000), ("1K", 1024), ("25.6k", 25600),
                                        ("auto", None), ("-1", None)])
def test_max_model_len_spellings(text, value):
    from pipespec.engine.args import parse_max_model_len
    assert parse_max_model_len(text) == value


def test_log_level_after_the_command():
    from pipespec.cli import build_parser
    parse = build_parser().parse_args
    assert parse(["generate", "hi"]).log_level == "INFO"
    assert parse(["--log-level", "ERROR", "generate", "hi"]).log_level == "ERROR"
    assert parse(["generate", "--log-level", "DEBUG", "hi"]).log_level == "DEBUG"
    assert parse(["serve", "--log-level", "WARNING"]).log_level == "WARNING"
    assert parse(["bench", "latency", "--log-level", "WARNING"]).log_level == "WARNING"


def test_tp_that_does_not_split_the_heads_exits_2_before_spawning():
    """The default model has 9 attention heads: -tp 2 is a bad argument, said once, by the parent."""
    proc = run_cli("--log-level", "WARNING", "generate", "-tp", "2", "--device", "cpu", "Hello", timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert lines == [f"error: tensor_parallel_size=2 does not split the model's attention heads evenly "
                     f"(num_attention_heads=9, num_key_value_heads=3); choose one of 1, 3, 9"], lines


def test_generate_default_runs_to_the_end_bounded_by_max_model_len(tiny_models):
    """No --max-tokens: past the old default of 64 tokens, up to max_model_len."""
    proc = run_cli("generate", "--model", str(tiny_models["qwen2"][0]), "--device", "cpu", "--max-model-len", "90",
                   "--ignore-eos", "Hello", timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = re.search(r"\((\d+) tokens\)\n.*### (\d+) tokens, finish_reason=length", proc.stdout, re.S)
    assert m and int(m.group(1)) + int(m.group(2)) == 90, proc.stdout[-500:]
