"""`pipespec bench throughput`: offline throughput over many requests submitted at once.

As vLLM's (random dataset): `--num-prompts` prompts of `--input-len` random tokens, `--output-len`
tokens each (EOS ignored), one `generate` call; reports requests/s, total tokens/s and output tokens/s.
"""
from __future__ import annotations

import argparse
import time

from pipespec.bench import report
from pipespec.bench import random_token_prompts
from pipespec.bench.stats import speculation, speculation_line


def add_args(p: argparse.ArgumentParser) -> None:
    b = p.add_argument_group("benchmark")
    b.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    b.add_argument("--output-len", type=int, default=128, help="generated tokens per request")
    b.add_argument("--num-prompts", type=int, default=100, help="requests")
    b.add_argument("--seed", type=int, default=0, help="seed of the prompts and of the engine's sampling")
    b.add_argument("--output-json", default=None, help="also write the results to this JSON file")


def run(args: argparse.Namespace) -> int:
    from pipespec import LLM, SamplingParams
    from pipespec.engine.args import engine_kwargs

    for name in ("input_len", "output_len", "num_prompts"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    params = SamplingParams(temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=args.output_len)
    with LLM(seed=args.seed, **engine_kwargs(args)) as llm:
        prompts = [{"prompt_token_ids": ids} for ids in
                   random_token_prompts(args.num_prompts, args.input_len, llm.engine.arch.vocab_size, args.seed)]
        before = llm.stats().get("spec_decode")
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        spec = speculation(before, llm.stats().get("spec_decode"))
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    results = {"input_len": args.input_len, "output_len": args.output_len, "num_requests": len(outs),
               "elapsed_time": elapsed, "total_num_tokens": prompt_tokens + output_tokens,
               "total_output_tokens": output_tokens, "requests_per_second": len(outs) / elapsed,
               "tokens_per_second": (prompt_tokens + output_tokens) / elapsed,
               "output_tokens_per_second": output_tokens / elapsed}
    lines = [f"Throughput: {results['requests_per_second']:.2f} requests/s, "
             f"{results['tokens_per_second']:.2f} total tokens/s, "
             f"{results['output_tokens_per_second']:.2f} output tokens/s "
             f"({len(outs)} requests in {elapsed:.2f} s)"]
    if spec is not None:
        results["speculative_decoding"] = spec
        lines += speculation_line(spec)
    report(lines, results, args.output_json)
    return 0
