"""Head-of-line blocking: time to first token of a short request that arrives behind a long prompt.

A long prompt (--long-tokens, default 8000) starts its chunked prefill; once its first step is done
a short request (--short-tokens prompt tokens, --short-max-tokens output) arrives. Reported per run:
the short request's time to first token and to its last token (from its arrival), and the long
request's time to first token (from its own arrival): what the short one gains and what the long
one pays. Greedy, EOS ignored, engine defaults otherwise (budget 1024 tokens per step).

Uses only `LLM(...).engine.add_request/step`, so the same script runs on older checkouts:
    PYTHONPATH=/path/to/old/checkout python benchmarks/hol_ttft.py      # before
    python benchmarks/hol_ttft.py                                         # after
    python benchmarks/hol_ttft.py --long-prefill-token-threshold 0        # after, limit off
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time

import torch

from pipespec import LLM, SamplingParams


def one_run(llm: LLM, long_ids: list[int], short_ids: list[int], short_max_tokens: int, tag: str) -> dict:
    eng = llm.engine
    greedy = dict(temperature=0.0, ignore_eos=True)
    t_long = time.perf_counter()
    eng.add_request(f"long-{tag}", {"prompt_token_ids": long_ids}, SamplingParams(max_tokens=4, **greedy))
    eng.step()                                             # the long prefill is under way
    t_short = time.perf_counter()
    eng.add_request(f"short-{tag}", {"prompt_token_ids": short_ids},
                    SamplingParams(max_tokens=short_max_tokens, **greedy))
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            now = time.perf_counter()
            name = out.request_id.split("-")[0]
            if out.outputs[0].token_ids and name not in first:
                first[name] = now
            if out.finished:
                done[name] = now
    return {"short_ttft_s": first["short"] - t_short, "short_done_s": done["short"] - t_short,
            "long_ttft_s": first["long"] - t_long}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--long-tokens", type=int, default=8000)
    ap.add_argument("--short-tokens", type=int, default=4)
    ap.add_argument("--short-max-tokens", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: steady on a shared machine)")
    ap.add_argument("--long-prefill-token-threshold", type=int, default=None,
                    help="passed to the engine when given (checkouts before it lack the setting)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    kwargs = dict(device="cpu", dtype="float32")
    if args.long_prefill_token_threshold is not None:
        kwargs["long_prefill_token_threshold"] = args.long_prefill_token_threshold
    rng = random.Random(0)
    long_ids = [rng.randrange(1000, 30000) for _ in range(args.long_tokens)]
    short_ids = [rng.randrange(1000, 30000) for _ in range(args.short_tokens)]
    with LLM(model=None, **kwargs) as llm:
        one_run(llm, long_ids[:600], short_ids, 2, "warmup")
        runs = [one_run(llm, long_ids, short_ids, args.short_max_tokens, str(i)) for i in range(args.repeats)]
    summary = {k: round(statistics.median(r[k] for r in runs), 2) for k in runs[0]}
    print(json.dumps({"date": time.strftime("%Y-%m-%d"), "machine": platform.machine(), "threads": args.threads,
                      "long_tokens": args.long_tokens, "short_tokens": args.short_tokens,
                      "short_max_tokens": args.short_max_tokens, "engine_kwargs": kwargs,
                      "median": summary, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
