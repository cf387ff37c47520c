"""`pipespec train-mtp` as a user meets it, on the default model and the CPU, with small budgets:
every budget bounds what its name says, the plan is logged first, missing data and heads that would
slow decoding down are said plainly, and no table is printed over 0 positions."""
import gzip
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pipespec.train.payoff import draft_cost_ratio, payoff

CHECK_SET = Path(__file__).parent / "data" / "smollm2_mtp_check.json"
SMALL = ["--device", "cpu", "--batch-size", "2", "--seq-len", "32", "--steps", "2", "--text-tokens", "2000",
         "--log-every", "1000", "--checkpoint-every", "100000"]


def _run(tmp_path, *flags, timeout=120):
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[2]), TQDM_DISABLE="1")
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pipespec", "train-mtp", "--out", str(tmp_path / "head.safetensors"),
                           *SMALL, *flags], capture_output=True, text=True, env=env, timeout=timeout)
    return proc, time.monotonic() - t0


def _main(capsys, caplog, *argv: str) -> tuple[int, str, str, str]:
    """`pipespec ARGV` through its own entry point in this process, for the runs that end before any
    engine starts (a process each cost more than the check; tests/cli runs the command as a process):
    (exit code, stdout, stderr, INFO log)."""
    import logging
    from pipespec.cli import main
    caplog.set_level(logging.INFO)
    try:
        code = main(list(argv))
    except SystemExit as e:                 # argparse's own refusals
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err, caplog.text


@pytest.mark.serial
def test_gen_time_bounds_all_generation_and_the_plan_predicts_the_total(tmp_path):
    # 64 held-out prompts of up to 64 tokens at 4 at once take minutes on this CPU: only the budget
    # can end generation in seconds
    proc, wall = _run(tmp_path, "--gen-time", "4", "--heldout-prompts", "64", "--gen-batch", "4",
                      "--gen-max-tokens", "64", "--max-time", "1")
    assert proc.returncode == 0, proc.stderr
    log = proc.stderr
    plan = re.search(r"plan: generation <= 4 s \(--gen-time\): held-out answers <= 1 s .*?expect about (\d+) s",
                     log)
    assert plan, log
    assert log.index("plan:") < log.index("engine ready")            # logged before anything runs
    gen = float(re.search(r"generation took ([\d.]+) s of 4 s", log).group(1))
    assert gen < 4 + 5, log                                          # the deadline, plus one engine step
    assert "held-out answers:" in log and "the time budget cut" in log
    assert wall < 2 * int(plan.group(1)), (wall, plan.group(0))


def test_no_chat_answers_warns_names_the_flag_and_prints_no_empty_table(tmp_path):
    # held-out answers but no chat answers (as when --gen-time ran out on the held-out answers)
    # (in a gzipped data cache, as one carried between machines would be)
    # (two held-out answers: the final evaluation's target pass is most of the command's time)
    check = json.loads(CHECK_SET.read_text())
    heldout = check[:2]
    cache = tmp_path / "data.json.gz"
    data = {"chat": [], "text": [{"ids": h["ids"][:32], "start": 0} for h in check], "heldout": heldout}
    cache.write_bytes(gzip.compress(json.dumps(data).encode()))
    proc, _ = _run(tmp_path, "--data-cache", str(cache), "--max-time", "1", "--gen-time", "60")
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"WARNING .*0 chat answers .*raise --gen-time", proc.stderr), proc.stderr
    out = proc.stdout
    assert "held-out (2 self-generated answers to unseen prompts):\n| step |" in out, out   # measured
    assert re.search(r"training answers \(first 0.*\): nothing measured \(0 positions\): there are no chat "
                     r"answers in the training set; raise --gen-time", out), out
    assert out.count("| step |") == 1                                 # no table over 0 positions
    # one second of training leaves a head far below what pays: said, with what to change
    assert re.search(r"WARNING: this head would make decoding slower: its held-out step-1 agreement is "
                     r"[\d.]+%, .*must exceed \d+% to pay\. Train longer \(--max-time", out), out


def test_init_head_trains_on_from_a_head_file(tmp_path):
    # the bundled head, trained on at a learning rate of 0: the file written is the bundled head, and
    # it measures what the bundled head recorded on the same answers
    from safetensors.torch import load_file
    from pipespec.heads import bundled_head_path
    from pipespec.model.mtp import read_mtp_metadata

    # (and --draft-vocab: the 64 tokens most frequent in the training answers, written beside it)
    from pipespec.train.data import Sample, most_frequent_tokens

    cache = tmp_path / "data.json.gz"
    heldout = json.loads(CHECK_SET.read_text())
    # training answers: two of the held-out ones (each set the command evaluates costs a target pass)
    chat = heldout[:2]
    data = {"chat": chat, "text": [{"ids": h["ids"][:32], "start": 0} for h in heldout], "heldout": heldout}
    cache.write_bytes(gzip.compress(json.dumps(data).encode()))
    proc, _ = _run(tmp_path, "--data-cache", str(cache), "--init-head", "bundled", "--lr", "0", "--steps", "3",
                   "--max-time", "1", "--draft-vocab", "64")
    assert proc.returncode == 0, proc.stderr
    written, bundled = load_file(tmp_path / "head.safetensors"), load_file(bundled_head_path())
    vocab = written.pop("draft_vocab")
    bundled.pop("draft_vocab", None)                  # the bundled head's own list (16,384 tokens)
    assert written.keys() == bundled.keys() and all(torch.equal(written[k], bundled[k]) for k in bundled)
    answers = [Sample(tuple(h["ids"]), h["start"]) for h in chat]
    assert torch.equal(vocab, most_frequent_tokens(answers, 49152, 64))
    assert "held-out, drafting over the draft vocabulary (64 most frequent answer tokens" in proc.stdout
    meta = read_mtp_metadata(tmp_path / "head.safetensors")
    assert json.loads(meta["pipespec.train"])["init"] == f"head file {bundled_head_path()}"
    recorded = json.loads(read_mtp_metadata(bundled_head_path())["pipespec.eval_check"])[0]
    got = re.search(r"held-out \(8 .*?\n.*?\n.*?\n\| 1 \| (\d+) \| ([\d.]+)%", proc.stdout, re.S)
    assert got and int(got.group(1)) == recorded["positions"], proc.stdout
    assert abs(float(got.group(2)) / 100 - recorded["agreement"]) <= 0.02, (got.group(0), recorded)


def test_init_head_and_draft_vocab_refuse_bad_flags_before_anything_runs(tmp_path, capsys, caplog):
    def run(*flags):
        return _main(capsys, caplog, "train-mtp", "--out", str(tmp_path / "head.safetensors"), *SMALL, *flags)
    code, _, err, _ = run("--init-head", "bundled", "--block-intermediate", "3072", "--gen-time", "0")
    assert code == 2 and "--init-head takes the head's weights and width from its file" in err
    code, _, err, log = run("--init-head", str(tmp_path / "none.safetensors"), "--gen-time", "0")
    assert code == 2 and "none.safetensors: no such file" in err, err
    assert "engine ready" not in log and "read the training data" not in log
    code, _, err, _ = run("--draft-vocab", "50000", "--gen-time", "0")
    assert code == 2 and "--draft-vocab must be in 1..49152" in err, err
    # text windows but no chat answers (from a data cache: building windows of text takes seconds)
    cache = tmp_path / "text_only.json"
    cache.write_text(json.dumps({"chat": [], "heldout": [], "text": [{"ids": h["ids"][:32], "start": 0}
                                                                     for h in json.loads(CHECK_SET.read_text())]}))
    code, _, err, log = run("--draft-vocab", "64", "--gen-time", "0", "--data-cache", str(cache))
    assert code == 2 and "--draft-vocab counts the tokens of the training answers, and there are none" \
        in err, err
    assert "plan:" in log and "engine ready" not in log      # (the log is seen: the plan came first)
    assert "0 chat answers (8 text windows only)" in log


def test_nothing_to_train_on_is_a_clear_error(tmp_path, capsys, caplog):
    code, _, err, log = _main(capsys, caplog, "train-mtp", "--out", str(tmp_path / "head.safetensors"), *SMALL,
                              "--gen-time", "0", "--text-tokens", "0")
    assert code == 2, err
    assert "error: no training data: 0 chat answers and 0 text windows; raise --gen-time" in err
    assert "plan:" in log and "engine ready" not in log               # --gen-time 0: no generation at all


def test_payoff_model_on_synthetic_tables():
    # SmolLM2-135M's shapes: 30 layers of 3.54M weights, a 4.2M MTP layer, a 28.3M LM head
    d = draft_cost_ratio(106_202_880, 4_205_376, 28_311_552)
    assert 0.2 < d < 0.3
    low = payoff([1.01, 1.01], d)                   # what the 60-second head measured
    assert not low.pays and low.best_k == 1 and low.speedup < 0.85
    good = payoff([1.8, 2.4, 2.85], d)
    assert good.pays and good.best_k == 3 and good.speedup == pytest.approx(2.85 / (1 + 3 * d))
    assert not payoff([1 + d * 0.99], d).pays and payoff([1 + d * 1.01], d).pays   # the K = 1 threshold is d


def _limit_memory():
    import resource
    resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))      # the defaults took 19.7 GB


@pytest.mark.serial
def test_cpu_defaults_fit_the_budget_the_memory_planned_and_log_without_a_terminal(tmp_path):
    # issue 48: the accelerator's defaults on a CPU (one 100 s step of 48 x 320 tokens, 19.7 GB) ran
    # --max-time 60 for 103 s and logged nothing for minutes. No --batch-size/--seq-len/--warmup here:
    # the CPU's defaults, under a 6 GB address-space limit, stderr a pipe (no terminal)
    check = json.loads(CHECK_SET.read_text())
    heldout = [{"ids": h["ids"][:64], "start": h["start"]} for h in check[:2]]    # a short final evaluation
    cache = tmp_path / "data.json"
    cache.write_text(json.dumps({"chat": check, "text": [{"ids": h["ids"][:48], "start": 0} for h in check],
                                 "heldout": heldout}))
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[2]), TQDM_DISABLE="1")
    budget, interval = 15, 5
    proc = subprocess.run([sys.executable, "-m", "pipespec", "train-mtp", "--out", str(tmp_path / "head.safetensors"),
                           "--device", "cpu", "--data-cache", str(cache), "--max-time", str(budget),
                           "--log-interval", str(interval), "--checkpoint-every", "100000"],
                          capture_output=True, text=True, env=env, timeout=150, preexec_fn=_limit_memory)
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = proc.stderr
    plan = re.search(r"plan: .*steps of (\d+) x (\d+) tokens on cpu .*memory: about ([\d.]+) GB of RAM", log)
    assert plan and int(plan.group(1)) * int(plan.group(2)) <= 1024, log
    planned = float(plan.group(3))
    # the budget: no step started that would end past it (within one step's length of it at worst)
    first = float(re.search(r"the first step took ([\d.]+) s: about \d+ steps fit", log).group(1))
    ended = re.search(rf"training ended after (\d+) steps in ([\d.]+) s of {budget} s: .*warm-up was (\d+) steps", log)
    assert ended and float(ended.group(2)) <= budget + first, log
    assert int(ended.group(1)) > int(ended.group(3)) or int(ended.group(1)) == 1, log    # past its warm-up
    # memory: under what the plan said, and under 4 GB
    peak = re.search(r"peak RSS ([\d.]+) GB \(planned ([\d.]+) GB\)", proc.stdout)
    assert peak and float(peak.group(1)) <= planned < 4.0, (proc.stdout, planned)
    # a log line at least every `interval` seconds (give or take the heartbeat's wake-up), plan to end
    stamps = [time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")) + int(m.group(2)) / 1000
              for m in re.finditer(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) ", log, re.M)]
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    assert len(stamps) > 5 and max(gaps) <= interval + 2.0, (gaps, log)
    assert "still running: training: step" in log


def test_eval_mtp_warns_about_a_head_that_would_slow_decoding(tmp_path, default_source, capsys, caplog):
    # an untrained head (random weights): train-mtp's warning, in the same words
    from pipespec.model.mtp import DeepSeekMTP, save_mtp

    torch.manual_seed(0)
    save_mtp(tmp_path / "random.safetensors", DeepSeekMTP(default_source.arch), default_source.name,
             torch.bfloat16, base_arch=default_source.arch)
    samples = tmp_path / "samples.json"
    samples.write_text(json.dumps([{"ids": h["ids"][:80], "start": h["start"]}
                                   for h in json.loads(CHECK_SET.read_text())[:4]]))
    code, out, err, _ = _main(capsys, caplog, "eval-mtp", "--head", str(tmp_path / "random.safetensors"),
                              "--device", "cpu", "--data", str(samples), "--steps", "2")
    assert code == 0, err
    assert re.search(r"WARNING: this head would make decoding slower: its held-out step-1 agreement is "
                     r"[\d.]+%, .*must exceed \d+% to pay\. Train it longer", out), out


def test_eval_mtp_reads_the_split_of_its_prompt_set_from_a_data_cache(tmp_path, default_source, capsys, caplog):
    check = json.loads(CHECK_SET.read_text())
    cache = tmp_path / "data.json.gz"
    cache.write_bytes(gzip.compress(json.dumps(
        {"chat": [], "text": [], "heldout": [dict(h, ids=h["ids"][:60]) for h in check[:3]],
         "heldout_kinds": [dict(h, ids=h["ids"][:60]) for h in check[3:5]]}).encode()))
    for prompt_set, count in (("heldout", 3), ("kinds", 2)):
        code, out, err, _ = _main(capsys, caplog, "eval-mtp", "--device", "cpu", "--data", str(cache),
                                  "--prompt-set", prompt_set, "--steps", "1")
        assert code == 0 and f": {count} samples, teacher-forced" in out, (prompt_set, out, err)
    code, out, err, log = _main(capsys, caplog, "eval-mtp", "--device", "cpu", "--data", str(cache),
                                "--prompt-set", "everyday")
    assert code != 0 and "--prompt-set everyday is answered here, not read from a data cache: drop --data" \
        in err + log, (err, log)
