"""Pipeline parallelism on CPU: throughput of PP = 2 (one thread per stage) over PP = 1 (one thread).

Both engines live side by side and the runs alternate (PP=1, PP=2, PP=1, ...) so that a change in
the machine's background load hits both alike; with `--wait-idle S` each run first waits (up to S
seconds) for the CPUs to be idle. Each run generates `--max-tokens` greedy tokens (EOS ignored) for
each of N concurrent prompts of 16 to 64 tokens, for each N of `--num-requests`; throughput is
generated tokens per second, median over `--runs`.

For PP = 2 it reports each stage's busy fraction: the share of the run's wall time the stage spent
running its layers (and, in brackets, the CPU time of that work: lower when another process took the
core). Stage 0 runs in the driver process, which also schedules and detokenizes, and waits for
results the rest of the time ("driver waiting"). For PP = 1 it reports the process's CPU share.

The machine may be shared: a run counts as "clean" when every compute thread got at least 90% of a
core while it worked (CPU time over busy wall time). The summary gives the median of the clean runs
and, for comparison, the speedup over all runs.

Decode on CPU streams every weight once per forward pass, so a micro-batch of half the requests
costs a stage more than half of a full batch: the speedup grows with the number of concurrent
requests (about 1.5x at most for 32, 1.7x for 64 or more on this model, from single-stage timings).

    python benchmarks/cpu_pipeline.py --wait-idle 60 --append-results     # the RESULTS.md figures
    python benchmarks/cpu_pipeline.py --num-requests 64 --pp-layer-partition even --runs 3
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from pipespec import LLM, SamplingParams

RESULTS = Path(__file__).with_name("RESULTS.md")
CLEAN = 0.9       # a run is clean when its compute threads got this share of a core while working

_WORDS = ("the quick brown fox jumps over a lazy dog while seven bright stars rise above the quiet "
          "harbour and old sailors count the ships returning home before the storm").split()


def make_prompts(n: int, tokenizer) -> list[dict]:
    """n prompts of 16 to 64 tokens, all different."""
    prompts = []
    for i in range(n):
        length = 16 + (i * 37) % 49
        words = [_WORDS[(i * 7 + j * 3) % len(_WORDS)] for j in range(length)]
        ids = tokenizer.encode(f"Request {i}: " + " ".join(words))[:length]
        prompts.append({"prompt_token_ids": ids})
    return prompts


def _cpu_times() -> tuple[float, float]:
    with open("/proc/stat") as f:
        values = [float(x) for x in f.readline().split()[1:]]
    return values[3] + values[4], sum(values)          # idle + iowait, total


def idle_fraction(seconds: float = 1.0) -> float:
    idle0, total0 = _cpu_times()
    time.sleep(seconds)
    idle1, total1 = _cpu_times()
    return (idle1 - idle0) / max(total1 - total0, 1e-9)


def wait_idle(limit: float, threshold: float = 0.9) -> float:
    """Wait up to `limit` seconds for the CPUs to be at least `threshold` idle; returns the idle share."""
    deadline = time.monotonic() + limit
    idle = idle_fraction()
    while idle < threshold and time.monotonic() < deadline:
        idle = idle_fraction()
    return idle


def one_run(llm: LLM, prompts, params) -> dict:
    executor = llm.engine.executor
    pipeline = hasattr(executor, "stats")
    before = executor.stats() if pipeline else None
    t0, c0 = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    run = {"wall": wall, "tokens": sum(len(o.outputs[0].token_ids) for o in outs)}
    if pipeline:
        after = executor.stats()
        run["busy"] = [(a["busy_s"] - b["busy_s"]) / wall for a, b in zip(after, before)]
        run["cpu"] = [(a["cpu_s"] - b["cpu_s"]) / wall for a, b in zip(after, before)]
        run["waiting"] = (after[0]["wait_s"] - before[0]["wait_s"]) / wall
        run["clean"] = all(c >= CLEAN * b for b, c in zip(run["busy"], run["cpu"]))
    else:                       # one process with one compute thread
        run["cpu"] = [cpu / wall]
        run["clean"] = run["cpu"][0] >= CLEAN
    return run


def _summary(runs: dict[int, list[dict]]) -> dict:
    rate = {pp: [r["tokens"] / r["wall"] for r in runs[pp]] for pp in runs}
    clean = {pp: [r["tokens"] / r["wall"] for r in runs[pp] if r["clean"]] for pp in runs}
    med = lambda xs: statistics.median(xs) if xs else float("nan")   # noqa: E731
    pp2 = [r for r in runs[2] if r["clean"]] or runs[2]                # busy fractions: clean runs if any
    return {"all": (med(rate[1]), med(rate[2])), "clean": (med(clean[1]), med(clean[2])),
            "n_clean": (len(clean[1]), len(clean[2])),
            "busy": [med([r["busy"][i] for r in pp2]) for i in range(2)],
            "cpu": [med([r["cpu"][i] for r in pp2]) for i in range(2)],
            "waiting": med([r["waiting"] for r in pp2])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    ap.add_argument("--num-requests", default="128,64,32",
                    help="concurrent requests, one measurement per comma-separated value")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--runs", type=int, default=5,
                    help="runs of each engine; on a shared machine, clean runs of each (see --max-runs)")
    ap.add_argument("--max-runs", type=int, default=None,
                    help="keep alternating until --runs clean runs of each, at most this many (default: --runs)")
    ap.add_argument("--pp-layer-partition", default="17,13",
                    help="PP=2 split of the 30 layers (the last stage also runs the LM head); 'even': 15,15")
    ap.add_argument("--max-num-batched-tokens", type=int, default=256)
    ap.add_argument("--wait-idle", type=float, default=0.0, metavar="S",
                    help="before each run, wait up to S seconds for the CPUs to be idle")
    ap.add_argument("--append-results", action="store_true", help=f"append a section to {RESULTS}")
    args = ap.parse_args()
    counts = [int(x) for x in args.num_requests.split(",")]

    most = max(counts)
    blocks = most * -(-(64 + args.max_tokens) // 16) + 64
    common = dict(dtype="float32", device="cpu", max_model_len=512, num_kv_blocks=blocks, max_num_seqs=most,
                  max_num_batched_tokens=args.max_num_batched_tokens, threads_per_stage=1)
    partition = None if args.pp_layer_partition == "even" else args.pp_layer_partition
    pp1 = LLM(model=args.model, pipeline_parallel_size=1, **common)
    pp2 = LLM(model=args.model, pipeline_parallel_size=2, pp_layer_partition=partition, **common)
    assert torch.get_num_threads() == 1
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in pp1.generate(make_prompts(most, pp1.get_tokenizer()), warm, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in pp2.generate(make_prompts(most, pp1.get_tokenizer()), warm, use_tqdm=False)]
    assert ref == got, "PP=2 and PP=1 disagree"

    results, idles = {}, []
    for n in counts:
        prompts = make_prompts(n, pp1.get_tokenizer())
        runs: dict[int, list[dict]] = {1: [], 2: []}
        for i in range(max(args.max_runs or args.runs, args.runs)):
            if args.max_runs and all(sum(r["clean"] for r in runs[pp]) >= args.runs for pp in runs):
                break
            for pp, llm in ((1, pp1), (2, pp2)):
                idle = wait_idle(args.wait_idle) if args.wait_idle > 0 else float("nan")
                idles.append(idle)
                run = one_run(llm, prompts, params)
                runs[pp].append(run)
                rate = run["tokens"] / run["wall"]
                if pp == 2:
                    extra = (", stage busy " + " / ".join(f"{b:.0%} (CPU {c:.0%})" for b, c in zip(run["busy"], run["cpu"]))
                             + f", driver waiting {run['waiting']:.0%}")
                else:
                    extra = f", process CPU {run['cpu'][0]:.0%}"
                print(f"{n} requests, run {i}: PP={pp} {run['tokens']} tokens in {run['wall']:.2f}s = {rate:.1f} tok/s"
                      f"{extra} (CPUs {idle:.0%} idle before){'' if run['clean'] else ' [contended]'}", flush=True)
        results[n] = (runs, _summary(runs))
        sm = results[n][1]
        print(f"== {n} requests: all runs PP=1 {sm['all'][0]:.1f}, PP=2 {sm['all'][1]:.1f} tok/s "
              f"({sm['all'][1] / sm['all'][0]:.2f}x); clean runs {sm['n_clean']} PP=1 {sm['clean'][0]:.1f}, "
              f"PP=2 {sm['clean'][1]:.1f} tok/s ({sm['clean'][1] / sm['clean'][0]:.2f}x); stage busy "
              f"{sm['busy'][0]:.0%} / {sm['busy'][1]:.0%}, driver waiting {sm['waiting']:.0%}", flush=True)
    split = "/".join(str(b - a) for a, b in pp2.engine.layer_ranges)
    pp1.shutdown()
    pp2.shutdown()

    if args.append_results:
        cmd = (f"python benchmarks/cpu_pipeline.py --num-requests {args.num_requests} --max-tokens "
               f"{args.max_tokens} --runs {args.runs}" + (f" --max-runs {args.max_runs}" if args.max_runs else "")
               + f" --pp-layer-partition {args.pp_layer_partition} "
               f"--max-num-batched-tokens {args.max_num_batched_tokens}"
               + (f" --wait-idle {args.wait_idle:g}" if args.wait_idle else "") + " --append-results")
        rows = []
        for n, (runs, sm) in results.items():
            rows.append(f"| {n} | {sm['clean'][0]:.1f} | {sm['clean'][1]:.1f} | **{sm['clean'][1] / sm['clean'][0]:.2f}x** "
                        f"| {sm['all'][1] / sm['all'][0]:.2f}x | {sm['busy'][0]:.0%} / {sm['busy'][1]:.0%} "
                        f"| {sm['waiting']:.0%} | {_runs(runs[1])} | {_runs(runs[2])} |")
        clean_note = (f", repeated (at most {args.max_runs} times) until {args.runs} of each were clean"
                      if args.max_runs else "")
        known = [x for x in idles if x == x]
        machine_load = (f"CPUs {min(known):.0%}-{max(known):.0%} idle just before the runs" if known
                        else "background load not measured")
        section = f"""
## Pipeline parallelism on CPU: PP=2 vs PP=1 (SmolLM2-135M, fp32, one thread per stage)

- Command: `{cmd}`
- Machine: {platform.machine()}, {os.cpu_count()} cores ({_cpu_name()}), torch {torch.__version__}; shared
  with other jobs ({machine_load})
- Date: {datetime.date.today().isoformat()}
- Workload: N concurrent requests, prompts of 16-64 tokens, {args.max_tokens} greedy tokens each (EOS
  ignored), step budget {args.max_num_batched_tokens} tokens; PP=2 splits the 30 layers {split} (the last stage
  also runs the LM head); runs alternate PP=1 / PP=2, {args.runs} of each{clean_note}

| N | PP=1 tok/s | PP=2 tok/s | speedup | (all runs) | stage busy 0 / 1 | driver waiting | PP=1 runs | PP=2 runs |
|---|---|---|---|---|---|---|---|---|
{chr(10).join(rows)}

Throughputs are medians over clean runs, those where every compute thread got at least {CLEAN:.0%} of a
core while it worked (runs marked * in the last columns; "all runs" gives the speedup of the medians
over every run). Perfect pipelining gives 2x. Stage busy: share of wall time each stage spent running
its layers (stage 0 runs in the driver process, which waits for results the "driver waiting" share
of the time and schedules in the rest). The speedup grows with N because a CPU decode step streams
every weight once: a micro-batch of N/2 requests costs a stage more than half of a batch of N.
"""
        with open(RESULTS, "a") as f:      # others append their own sections: never rewrite the file
            if f.tell() == 0:
                f.write("# Benchmark results\n")
            f.write(section)
        print(f"appended to {RESULTS}")


def _runs(runs: list[dict]) -> str:
    return ", ".join(f"{r['tokens'] / r['wall']:.1f}{'*' if r['clean'] else ''}" for r in runs)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


if __name__ == "__main__":
    main()
