"""A shared system prompt through the engine itself (no HTTP): throughput and time to first token
with the prefix cache on and off, same run, engines alternating by round.

Each round: the cache is reset, one request with the shared prefix runs first (unmeasured: the
steady state of a server whose system prompt some earlier request computed), then `--requests`
requests of the prefix plus a short question of their own are added together, at most
`--max-num-seqs` running at once, and stepped to the end. TTFT is the time from adding a request to
the step that returned its first token; throughput counts prompt and generated tokens over the
wall time. Issue 45's GPU goal: shared-prompt throughput at least 2x uncached at 64 concurrent
requests.

    python benchmarks/prefix_cache_shared.py --device cuda [--requests 64] [--prefix-tokens 1500]
    python benchmarks/prefix_cache_shared.py --device cpu --requests 8 --prefix-tokens 1500
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

from pipespec import LLM, SamplingParams


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run_round(llm: LLM, prompts: list[list[int]], warm: list[int], output_tokens: int, device: str) -> dict:
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=output_tokens, ignore_eos=True)
    llm.reset_prefix_cache()
    llm.generate([{"prompt_token_ids": warm}], params, use_tqdm=False)      # the prefix, computed once
    _sync(device)
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"shared-{i}", {"prompt_token_ids": p}, params)
    first: dict[str, float] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.outputs and out.outputs[0].token_ids and out.request_id not in first:
                first[out.request_id] = time.perf_counter() - t0
    _sync(device)
    wall = time.perf_counter() - t0
    tokens = sum(len(p) for p in prompts) + output_tokens * len(prompts)
    return {"wall_s": wall, "total_tok_s": tokens / wall, "median_ttft_ms": 1000 * statistics.median(first.values())}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--prefix-tokens", type=int, default=1500)
    ap.add_argument("--question-tokens", type=int, default=16)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--speculative-config", default=None, help="JSON, as `generate` takes it")
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()
    spec = json.loads(args.speculative_config) if args.speculative_config else None
    kw = dict(device=args.device, max_num_seqs=args.max_num_seqs, speculative_config=spec,
              max_model_len=args.prefix_tokens + args.question_tokens + args.output_tokens + 64)
    if args.device == "cuda":
        kw["gpu_memory_utilization"] = 0.3
    engines = {"on": LLM(enable_prefix_caching=True, **kw), "off": LLM(enable_prefix_caching=False, **kw)}
    figures: dict[str, list[dict]] = {name: [] for name in engines}
    for rnd in range(args.rounds):
        rng = random.Random(rnd)
        prefix = [rng.randrange(1000, 30000) for _ in range(args.prefix_tokens)]
        prompts = [prefix + [rng.randrange(1000, 30000) for _ in range(args.question_tokens)]
                   for _ in range(args.requests)]
        for name in (("on", "off") if rnd % 2 == 0 else ("off", "on")):
            figures[name].append(run_round(engines[name], prompts, prefix + [11, 12, 13], args.output_tokens,
                                           args.device))
            print(f"round {rnd} cache {name}: {json.dumps({k: round(v, 3) for k, v in figures[name][-1].items()})}",
                  flush=True)
    report = {"date": time.strftime("%Y-%m-%d"), "args": vars(args),
              "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"}
    for name, runs in figures.items():
        report[name] = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
        report[name]["prefix_cache"] = engines[name].stats().get("prefix_cache")
    report["throughput_ratio"] = report["on"]["total_tok_s"] / report["off"]["total_tok_s"]
    report["ttft_ratio"] = report["on"]["median_ttft_ms"] / report["off"]["median_ttft_ms"]
    for llm in engines.values():
        llm.shutdown()
    print(json.dumps(report, indent=1))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
