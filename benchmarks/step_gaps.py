"""Where a speculative engine's steps go: the time between consecutive results, grouped by the
step's K and whether it was steady (every request verifying exactly K drafts, what adaptive K
costs) or not (prefill, a K change: eager steps), against the run's tokens/s and the graph replays.

Written to explain a GPU figure (RESULTS.md, 2026-12-01 third session): adaptive K measured its K = 2
steps at 1.6 ms at batch 64 while a fixed K = 2 engine's whole run implies ~4 ms a step.

Usage (GPU machine): python benchmarks/step_gaps.py [--batch 64] [--new-tokens 64] [--max-k 2] [--profile-first]
"""
from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from spec_decode import chat_ids, print_profile  # noqa: E402

from pipespec import LLM, SamplingParams  # noqa: E402


def profile_first(llm, prompts, name: str) -> None:
    """The host and device time of a request's first step: a one-token generate (after one unprofiled)."""
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)
    print_profile(llm, prompts, params, f"{name}, one-token request", {"cpu_time_total": 25})


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--max-k", type=int, default=2)
    ap.add_argument("--profile-first", action="store_true", help="profile a one-token request (the prefill step)")
    args = ap.parse_args()
    engines = {"K=0": None, f"K={args.max_k}": False, f"adaptive (max K={args.max_k})": True}
    for name, adaptive in engines.items():
        spec = None if adaptive is None else {"method": "mtp", "num_speculative_tokens": args.max_k,
                                              "adaptive": adaptive}
        llm = LLM(device="cuda", speculative_config=spec, gpu_memory_utilization=0.12, max_num_seqs=args.batch)
        eng, log = llm.engine, []
        measure = eng._measure_step

        def logged(batch, measure=measure):
            graphs = eng.executor.stage.graphs
            log.append((time.perf_counter(), batch.plan.num_spec_tokens, batch.steady, graphs.replays if graphs else 0))
            return measure(batch)

        eng._measure_step = logged
        chats = chat_ids(llm.get_tokenizer())
        prompts = [{"prompt_token_ids": chats[i % len(chats)]} for i in range(args.batch)]
        params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
        for _ in range(3):                     # the last run is reported; adaptive K learns in the first
            log.clear()
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            end = time.perf_counter()
        gaps = collections.defaultdict(list)
        for (t0, *_), (t1, k, steady, _) in zip(log, log[1:]):
            gaps[(k, steady)].append(t1 - t0)
        print(json.dumps({
            "engine": name, "tokens_per_s": round(args.batch * args.new_tokens / (end - start)), "steps": len(log),
            "graph_replays": log[-1][3] - log[0][3],
            # outside the gaps: generate() to the first result (prefill), the last result to its return
            "first_result_ms": round(1e3 * (log[0][0] - start), 3), "after_last_ms": round(1e3 * (end - log[-1][0]), 3),
            "gap_ms (count, median, total)": {f"K={k} {'steady' if s else 'other'}":
                                              [len(v), round(1e3 * statistics.median(v), 3), round(1e3 * sum(v), 1)]
                                              for (k, s), v in sorted(gaps.items())},
            "policy": eng.stats().get("spec_decode", {}).get("adaptive_k")}), flush=True)
        if args.profile_first:
            profile_first(llm, prompts[:1], name)
        llm.shutdown()


if __name__ == "__main__":
    main()
