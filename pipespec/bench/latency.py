"""`pipespec bench latency`: time to generate one batch of fixed-length requests, end to end.

As vLLM's: `--batch-size` prompts of `--input-len` random tokens each generate `--output-len` tokens
(EOS ignored, temperature 1); after `--num-iters-warmup` untimed runs, `--num-iters` timed runs give
the mean latency and its percentiles.
"""
from __future__ import annotations

import argparse
import time

from pipespec.bench import report
from pipespec.bench import random_token_prompts
from pipespec.bench.stats import describe, speculation, speculation_line

PERCENTILES = (10, 25, 50, 75, 90, 99)


def add_args(p: argparse.ArgumentParser) -> None:
    b = p.add_argument_group("benchmark")
    b.add_argument("--input-len", type=int, default=32, help="prompt tokens per request")
    b.add_argument("--output-len", type=int, default=128, help="generated tokens per request")
    b.add_argument("--batch-size", type=int, default=8, help="requests in the batch")
    b.add_argument("--num-iters-warmup", type=int, default=2, help="untimed runs first")
    b.add_argument("--num-iters", type=int, default=10, help="timed runs")
    b.add_argument("--seed", type=int, default=0, help="seed of the prompts and of the engine's sampling")
    b.add_argument("--output-json", default=None, help="also write the results to this JSON file")


def run(args: argparse.Namespace) -> int:
    from pipespec import LLM, SamplingParams
    from pipespec.engine.args import engine_kwargs

    for name in ("input_len", "output_len", "batch_size", "num_iters"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    params = SamplingParams(temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=args.output_len)
    with LLM(seed=args.seed, **engine_kwargs(args)) as llm:
        prompts = [{"prompt_token_ids": ids} for ids in
                   random_token_prompts(args.batch_size, args.input_len, llm.engine.arch.vocab_size, args.seed)]

        def once() -> float:
            t0 = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            return time.perf_counter() - t0

        for _ in range(args.num_iters_warmup):
            once()
        before = llm.stats().get("spec_decode")
        latencies = [once() for _ in range(args.num_iters)]
        spec = speculation(before, llm.stats().get("spec_decode"))
    summary = describe(latencies, PERCENTILES)
    lines = [f"Avg latency: {summary['mean']:.4f} seconds"]
    lines += [f"{q}% percentile latency: {summary[f'p{q}']:.4f} seconds" for q in PERCENTILES]
    results = {"input_len": args.input_len, "output_len": args.output_len, "batch_size": args.batch_size,
               "num_iters": args.num_iters, "avg_latency": summary["mean"], "latencies": latencies,
               "percentiles": {str(q): summary[f"p{q}"] for q in PERCENTILES}}
    if spec is not None:
        results["speculative_decoding"] = spec
        lines += speculation_line(spec)
    report(lines, results, args.output_json)
    return 0
