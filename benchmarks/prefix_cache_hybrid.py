"""Prefix caching of a hybrid model (Gated DeltaNet + gated attention) on the CPU: prompt tokens
computed and wall time with the cache on and off, same run.

A small Qwen3.5-layout checkpoint with random weights (`family_gpu.SHAPES["qwen3_5_cpu_small"]`,
`--load-format dummy`). A round is one request of a shared system prompt (`--prefix-tokens`)
plus a question, then `--requests` more with the same prefix and questions of their own, sent
together: with the cache on they restore the linear-attention state snapshot taken at the last block
boundary of the shared part and reuse its KV blocks. The two engines alternate round by round,
each round starting from `reset_prefix_cache()`. Medians over the rounds.

    python benchmarks/prefix_cache_hybrid.py [--rounds 3] [--prefix-tokens 1024] [--requests 8] [--k 0]
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from family_gpu import write_folder  # noqa: E402  (config + word-level tokenizer of a shape)

from pipespec import LLM, SamplingParams  # noqa: E402


def one_round(llm: LLM, prefix: list[int], questions: list[list[int]], output_tokens: int) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=output_tokens, ignore_eos=True)
    assert llm.reset_prefix_cache()
    before = dict(llm.stats().get("prefix_cache") or {})
    start = time.perf_counter()
    first = llm.generate([{"prompt_token_ids": prefix + questions[0]}], params, use_tqdm=False)
    middle = time.perf_counter()
    rest = llm.generate([{"prompt_token_ids": prefix + q} for q in questions[1:]], params, use_tqdm=False)
    wall = time.perf_counter() - start
    total = sum(len(prefix) + len(q) for q in questions)
    after = llm.stats().get("prefix_cache")
    hits = after["hits"] - before.get("hits", 0) if after else 0
    restores = after["state_snapshot_restores"] - before.get("state_snapshot_restores", 0) if after else 0
    # (the first request computes the prefix either way; the later ones are the figure)
    return {"wall_s": wall, "later_requests_wall_s": wall - (middle - start), "prompt_tokens": total, "computed_prompt_tokens": total - hits,
            "snapshot_restores": restores,
            "outputs": [o.outputs[0].token_ids for o in first + rest]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prefix-tokens", type=int, default=1024)
    ap.add_argument("--question-tokens", type=int, default=16)
    ap.add_argument("--requests", type=int, default=8, help="requests after the first, sent together")
    ap.add_argument("--output-tokens", type=int, default=8)
    ap.add_argument("--k", type=int, default=0, help="MTP draft tokens (0: no speculation)")
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()
    folder, text = write_folder("qwen3_5_cpu_small")
    rng = random.Random(0)
    vocab = text["vocab_size"]
    kwargs = dict(model=folder, load_format="dummy", dtype="float32", device="cpu", max_model_len=2048,
                  max_num_seqs=args.requests + 1, seed=0,
                  speculative_config={"method": "mtp", "num_speculative_tokens": args.k} if args.k else None)
    engines = {"on": LLM(enable_prefix_caching=True, **kwargs), "off": LLM(enable_prefix_caching=False, **kwargs)}
    runs = {name: [] for name in engines}
    try:
        for r in range(args.rounds):
            prefix = [rng.randrange(3, vocab) for _ in range(args.prefix_tokens)]
            questions = [[rng.randrange(3, vocab) for _ in range(args.question_tokens)]
                         for _ in range(args.requests + 1)]
            for name in (("on", "off") if r % 2 == 0 else ("off", "on")):
                runs[name].append(one_round(engines[name], prefix, questions, args.output_tokens))
            same = runs["on"][-1].pop("outputs") == runs["off"][-1].pop("outputs")
            print(f"round {r}: on {runs['on'][-1]}, off {runs['off'][-1]}, outputs equal: {same}", flush=True)
            if not same:
                raise SystemExit("outputs differ with the cache on and off")
    finally:
        for llm in engines.values():
            llm.shutdown()
    summary = {name: {key: statistics.median(run[key] for run in rs) for key in rs[0]} for name, rs in runs.items()}
    summary["on_over_off_wall"] = summary["on"]["wall_s"] / summary["off"]["wall_s"]
    summary["machine"] = f"{platform.machine()}, {platform.processor() or '?'}"
    print(json.dumps(summary, indent=1))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps({"args": vars(args), "runs": runs, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
