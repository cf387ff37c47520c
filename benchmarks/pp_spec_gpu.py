"""PP + MTP on CUDA: greedy identity and acceptance across pipeline sizes, throughput, a long soak.

On one GPU both stages share it over gloo (NCCL refuses two ranks on one device): a functional
check, and throughput figures that say nothing about two GPUs. On a machine with two GPUs run it
with --backend nccl for the real figures.
Usage: python benchmarks/pp_spec_gpu.py [--backend gloo|nccl] [--soak 1000] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from spec_decode import chat_ids  # noqa: E402

from pipespec import LLM, SamplingParams  # noqa: E402


def engine(pp: int, k: int, backend: str, **kw) -> LLM:
    spec = {"method": "mtp", "num_speculative_tokens": k} if k else None
    return LLM(device="cuda", pipeline_parallel_size=pp, distributed_backend=backend, speculative_config=spec,
               gpu_memory_utilization=0.08, max_num_seqs=64, **kw)


def acceptance(before: dict, after: dict) -> float:
    drafts = after["num_drafts"] - before.get("num_drafts", 0)
    return 1 + (after["num_accepted_tokens"] - before.get("num_accepted_tokens", 0)) / max(drafts, 1)


def timed(llm: LLM, prompts, params) -> dict:
    """tokens/s of one generate call; with a pipeline, each stage's busy fraction and the driver's
    share of the wall time spent waiting for results; acceptance and preemptions."""
    executor = llm.engine.executor
    before = executor.stats() if hasattr(executor, "stats") else None
    spec_before = dict(llm.stats().get("spec_decode", {}))
    preempted = llm.engine.scheduler.num_preemptions
    torch.cuda.synchronize()
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t
    run = {"tokens_per_s": sum(len(o.outputs[0].token_ids) for o in outs) / wall,
           "outputs": [o.outputs[0].token_ids for o in outs],
           "preemptions": llm.engine.scheduler.num_preemptions - preempted}
    if before is not None:
        after = executor.stats()
        run["busy"] = [(a["busy_s"] - b["busy_s"]) / wall for a, b in zip(after, before)]
        run["driver_wait"] = (after[0]["wait_s"] - before[0]["wait_s"]) / wall
    spec_after = llm.stats().get("spec_decode")
    if spec_after:
        run["acceptance_length"] = acceptance(spec_before, spec_after)
    return run


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="gloo")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--soak", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    report = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(0),
              "gpus": torch.cuda.device_count(), "backend": args.backend, "identity": [], "speed": []}
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    for k in (0, 1, 2, 3):
        engines = {pp: engine(pp, k, args.backend) for pp in (1, 2)}
        tok = engines[1].get_tokenizer()
        chats = [{"prompt_token_ids": ids} for ids in chat_ids(tok)]
        runs = {pp: timed(llm, chats, params) for pp, llm in engines.items()}
        row = {"k": k, "identical": runs[1]["outputs"] == runs[2]["outputs"],
               "acceptance_pp1": round(runs[1].get("acceptance_length", 1.0), 3),
               "acceptance_pp2": round(runs[2].get("acceptance_length", 1.0), 3)}
        report["identity"].append(row)
        print(json.dumps(row), flush=True)
        if k in (0, 3):
            for batch in (1, 64):
                prompts = [chats[i % len(chats)] for i in range(batch)]
                for llm in engines.values():
                    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
                speed = {pp: [timed(llm, prompts, params) for _ in range(args.repeats)]
                         for pp, llm in engines.items()}
                med = {pp: statistics.median(r["tokens_per_s"] for r in rs) for pp, rs in speed.items()}
                busy = [round(statistics.median(r["busy"][i] for r in speed[2]), 2) for i in range(2)]
                srow = {"k": k, "batch": batch, "pp1_tokens_per_s": round(med[1], 1),
                        "pp2_tokens_per_s": round(med[2], 1), "pp2_over_pp1": round(med[2] / med[1], 2),
                        "pp2_stage_busy": busy}
                report["speed"].append(srow)
                print(json.dumps(srow), flush=True)
        if k == 3 and args.soak:
            llm = engines[2]
            rng = random.Random(0)
            soak = [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(rng.randrange(1, 300))]}
                    for _ in range(args.soak)]
            soak_params = [SamplingParams(temperature=rng.choice([0.0, 0.8]), seed=i,
                                          max_tokens=rng.randrange(1, 128)) for i in range(args.soak)]
            t = time.perf_counter()
            outs = llm.generate(soak, soak_params, use_tqdm=False)
            sched = llm.engine.scheduler
            srow = {"soak_requests": len(outs), "all_finished": all(o.finished for o in outs),
                    "seconds": round(time.perf_counter() - t, 1),
                    "leaked_blocks": sched.allocator.num_blocks - sched.allocator.num_free,
                    "unfinished": int(llm.engine.has_unfinished_requests())}
            report["soak"] = srow
            print(json.dumps(srow), flush=True)
        for llm in engines.values():
            llm.shutdown()
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
