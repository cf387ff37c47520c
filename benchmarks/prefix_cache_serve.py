"""Prefix caching through `pipespec serve`: time to first token with the cache on and off, same run.

Two workloads, each against a server started with the cache on and one started with it off
(`--no-enable-prefix-caching`), the two servers alternating by round so drift hits both:
- multi-turn: conversations whose first turn is a long text (`--first-turn-words`, ~1 token a word),
  then `--turns` - 1 more turns, each the previous prompt plus its answer plus a new line
  (`pipespec bench serve --multi-turn`'s requests). Later turns are cached up to the last block when
  the cache is on: their TTFT against the same turns uncached is the figure (goal: <= 0.3x);
- shared system prompt: `--shared-requests` requests of a common random-token prefix
  (`--prefix-tokens`) plus a short question each, `--concurrency` at a time: TTFT and throughput, in
  the steady state of a server whose system prompt some earlier request already computed (one
  request with it goes first, unmeasured; requests sent together before any has computed the
  prefix all compute it).

Each server first answers a short warm-up request (the first steps of a process are slower).

    python benchmarks/prefix_cache_serve.py [--rounds 3] [--server-args "--max-model-len 4096"]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_load import start_server  # noqa: E402  (the benchmarks' own server starter)

from pipespec.bench.serve import random_word_lines, run_conversations, run_load, summarize  # noqa: E402


def stop(proc) -> None:
    import os
    import signal
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(30)
    except Exception:  # noqa: BLE001 - it must go either way
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def multi_turn(url: str, args, seed: int) -> dict:
    rng = random.Random(seed)
    first = random_word_lines(args.conversations, args.first_turn_words, rng)
    lines = [random_word_lines(args.turns - 1, args.line_words, rng) for _ in first]
    results, wall = asyncio.run(run_conversations(url, first, lines, args.output_tokens, max_concurrency=1))
    failed = [r.error for r in results if not r.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed: {failed[0]}")
    return {"first_turn_ttft_ms": [1000 * r.ttft for r in results if r.turn == 0],
            "later_turn_ttft_ms": [1000 * r.ttft for r in results if r.turn > 0],
            "first_turn_prompt_tokens": [r.prompt_tokens for r in results if r.turn == 0],
            "last_turn_prompt_tokens": [r.prompt_tokens for r in results if r.turn == args.turns - 1]}


def shared_prefix(url: str, args, seed: int) -> dict:
    rng = random.Random(seed)
    prefix = [rng.randrange(1000, 30000) for _ in range(args.prefix_tokens)]
    prompts = [prefix + [rng.randrange(1000, 30000) for _ in range(16)] for _ in range(args.shared_requests)]
    asyncio.run(run_load(url, [prefix + [11, 12, 13]], 1))           # an earlier request: unmeasured
    results, wall = asyncio.run(run_load(url, prompts, args.output_tokens, max_concurrency=args.concurrency))
    s = summarize(results, wall, percentiles=())
    if s["failed"]:
        raise RuntimeError(f"{s['failed']} requests failed: {s.get('errors')}")
    return {"ttft_ms": s["median_ttft_ms"], "output_tok_s": s["output_throughput"],
            "total_tok_s": s["total_token_throughput"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--server-args", default="--max-model-len 4096 --max-num-seqs 16")
    ap.add_argument("--rounds", type=int, default=3, help="rounds; each runs both workloads on both servers")
    ap.add_argument("--conversations", type=int, default=2, help="multi-turn conversations a round")
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--first-turn-words", type=int, default=2000)
    ap.add_argument("--line-words", type=int, default=24)
    ap.add_argument("--output-tokens", type=int, default=16)
    ap.add_argument("--prefix-tokens", type=int, default=1500)
    ap.add_argument("--shared-requests", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()
    servers = {}
    try:
        for name, flag in (("on", "--enable-prefix-caching"), ("off", "--no-enable-prefix-caching")):
            servers[name] = start_server(f"{args.server_args} {flag}")
        for _, url in servers.values():
            asyncio.run(run_load(url, ["A short warm-up request."] * 2, 8))
        figures = {name: {"multi_turn": [], "shared": []} for name in servers}
        for rnd in range(args.rounds):
            order = ("on", "off") if rnd % 2 == 0 else ("off", "on")
            for name in order:
                url = servers[name][1]
                # every round starts cold: its own texts, the cache reset
                assert httpx.post(f"{url}/reset_prefix_cache", timeout=30).status_code == 200
                figures[name]["multi_turn"].append(multi_turn(url, args, seed=rnd))
                figures[name]["shared"].append(shared_prefix(url, args, seed=100 + rnd))
                print(f"round {rnd} cache {name}: multi-turn later TTFT "
                      f"{statistics.median(figures[name]['multi_turn'][-1]['later_turn_ttft_ms']):.0f} ms, "
                      f"shared TTFT {figures[name]['shared'][-1]['ttft_ms']:.0f} ms", flush=True)
        stats = {name: httpx.get(f"{servers[name][1]}/metrics", timeout=30).text for name in servers}
    finally:
        for proc, _ in servers.values():
            stop(proc)

    def med(name, workload, key):
        runs = figures[name][workload]
        values = [v for run in runs for v in (run[key] if isinstance(run[key], list) else [run[key]])]
        return statistics.median(values)

    report = {"machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
              "date": time.strftime("%Y-%m-%d"), "args": vars(args)}
    for name in figures:
        report[name] = {"first_turn_ttft_ms": med(name, "multi_turn", "first_turn_ttft_ms"),
                        "later_turn_ttft_ms": med(name, "multi_turn", "later_turn_ttft_ms"),
                        "first_turn_prompt_tokens": med(name, "multi_turn", "first_turn_prompt_tokens"),
                        "last_turn_prompt_tokens": med(name, "multi_turn", "last_turn_prompt_tokens"),
                        "shared_ttft_ms": med(name, "shared", "ttft_ms"),
                        "shared_output_tok_s": med(name, "shared", "output_tok_s"),
                        "shared_total_tok_s": med(name, "shared", "total_tok_s")}
        for line in stats[name].splitlines():
            if line.startswith(("pipespec:prefix_cache_queries_total{", "pipespec:prefix_cache_hits_total{")):
                report[name][line.split("{")[0].split(":")[1]] = float(line.rsplit(" ", 1)[1])
    on, off = report["on"], report["off"]
    report["later_turn_ttft_ratio"] = on["later_turn_ttft_ms"] / off["later_turn_ttft_ms"]
    report["shared_ttft_ratio"] = on["shared_ttft_ms"] / off["shared_ttft_ms"]
    report["shared_throughput_ratio"] = on["shared_total_tok_s"] / off["shared_total_tok_s"]
    print(json.dumps(report, indent=2))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
