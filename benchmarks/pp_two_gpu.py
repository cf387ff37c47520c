"""PP = 2 over NCCL on two GPUs against PP = 1 on one, CUDA graphs on: throughput by batch with each
stage's busy fraction and the driver's waiting share, KV capacity at a fixed memory budget, and the
time from a killed stage to the error at the driver.

A Llama-3-8B-shaped model with random weights (`--load-format dummy`), or SmolLM2 (`--model smollm2`).
Usage: python benchmarks/pp_two_gpu.py [--model 8b|smollm2] [--batches 1,64,256] [--new-tokens 64]
       [--repeats 3] [--kv-util 0.16] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from gpu_bench import LLAMA3_8B  # noqa: E402
from pp_spec_gpu import timed  # noqa: E402

from pipespec import LLM, SamplingParams  # noqa: E402
from pipespec.engine.llm_engine import EngineDeadError  # noqa: E402


def llama8b_folder() -> str:
    from tokenizers import Tokenizer, models
    from transformers import LlamaConfig

    folder = Path(tempfile.mkdtemp(prefix="llama3-8b-shape-"))
    LlamaConfig(**LLAMA3_8B, bos_token_id=1, eos_token_id=2).save_pretrained(folder)
    vocab = {f"t{i}": i for i in range(LLAMA3_8B["vocab_size"])}
    Tokenizer(models.WordLevel(vocab, unk_token="t0")).save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "t2", "bos_token": "t1"}))
    return str(folder)


def engine(model: str | None, pp: int, max_seqs: int, util: float, **kw) -> LLM:
    extra = dict(load_format="dummy") if model else {}
    return LLM(model=model, device="cuda", pipeline_parallel_size=pp, distributed_backend="nccl",
               gpu_memory_utilization=util, max_num_seqs=max_seqs, max_model_len=1024,
               max_num_batched_tokens=max(1024, max_seqs), **extra, **kw)


def prompts_of(batch: int, length: int, vocab: int) -> list[dict]:
    g = torch.Generator().manual_seed(batch)
    return [{"prompt_token_ids": torch.randint(100, vocab, (length,), generator=g).tolist()} for _ in range(batch)]


def throughput(model, args, report):
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    max_seqs = max(args.batches)
    engines = {pp: engine(model, pp, max_seqs, args.util) for pp in (1, 2)}
    report["kv_blocks"] = {pp: llm.engine.scheduler.allocator.num_blocks for pp, llm in engines.items()}
    vocab = engines[1].engine.arch.vocab_size
    for batch in args.batches:
        prompts = prompts_of(batch, args.prompt_len, vocab)
        for llm in engines.values():                 # warm-up: every bucket this batch replays
            llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        runs = {pp: [] for pp in engines}
        for _ in range(args.repeats):                # interleaved, so drift hits both alike
            for pp, llm in engines.items():
                runs[pp].append(timed(llm, prompts, params))
        med = {pp: statistics.median(r["tokens_per_s"] for r in rs) for pp, rs in runs.items()}
        row = {"batch": batch, "pp1_tokens_per_s": round(med[1], 1), "pp2_tokens_per_s": round(med[2], 1),
               "pp2_over_pp1": round(med[2] / med[1], 3),
               "pp2_stage_busy": [round(statistics.median(r["busy"][i] for r in runs[2]), 3) for i in range(2)],
               "pp2_driver_wait": round(statistics.median(r["driver_wait"] for r in runs[2]), 3),
               # greedy equal to PP = 1 (larger batches split into micro-batches, whose bf16 sums may differ)
               "greedy_identical": runs[1][0]["outputs"] == runs[2][0]["outputs"]}
        report["speed"].append(row)
        print(json.dumps(row), flush=True)
    for llm in engines.values():
        llm.shutdown()


def kv_bound(model, args, report):
    """At a memory budget where PP = 1 holds fewer tokens than the batch needs (it preempts and
    recomputes), PP = 2 holds each stage's half of the layers and serves the batch whole."""
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    rows = {}
    for pp in (1, 2):
        llm = engine(model, pp, 256, args.kv_util)
        blocks = llm.engine.scheduler.allocator.num_blocks
        tokens_held = blocks * llm.engine.config.cache.block_size
        if pp == 1:     # 1.5x the tokens PP = 1 can hold
            batch = min(int(1.5 * tokens_held / (args.kv_prompt_len + args.new_tokens)), 256)
        prompts = prompts_of(batch, args.kv_prompt_len, llm.engine.arch.vocab_size)
        llm.generate(prompts[:8], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
        run = timed(llm, prompts, params)
        rows[pp] = {"kv_tokens": tokens_held, "batch": batch, "tokens_per_s": round(run["tokens_per_s"], 1),
                    "preemptions": run["preemptions"]}
        llm.shutdown()
    rows["pp2_over_pp1"] = round(rows[2]["tokens_per_s"] / rows[1]["tokens_per_s"], 3)
    report["kv_bound"] = rows
    print(json.dumps(rows), flush=True)


def kill_to_error(llm: LLM, prompt_len: int, report: dict) -> None:
    """SIGKILL the engine's first worker process mid-generation; record the seconds until the
    driver raises (and what it says), then shut the engine down."""
    pid = llm.engine.executor.worker_pids[0]
    params = SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True)
    for i, p in enumerate(prompts_of(16, prompt_len, llm.engine.arch.vocab_size)):
        llm.engine.add_request(str(i), p, params)
    for _ in range(5):
        llm.engine.step()
    os.kill(pid, signal.SIGKILL)
    t = time.perf_counter()
    error = None
    try:
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
    except EngineDeadError as e:
        error = str(e)
    row = {"kill_to_error_s": round(time.perf_counter() - t, 3), "error": (error or "none")[:300]}
    report["kill"] = row
    print(json.dumps(row), flush=True)
    llm.shutdown()


def kill_time(model, args, report):
    kill_to_error(engine(model, 2, 64, args.util), args.prompt_len, report)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="8b", choices=["8b", "smollm2"])
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--util", type=float, default=0.45)
    ap.add_argument("--kv-util", type=float, default=0.16, help="memory budget of the KV-bound rows")
    ap.add_argument("--kv-prompt-len", type=int, default=512, help="prompt length of the KV-bound rows")
    ap.add_argument("--skip", default="", help="comma-separated parts to skip: speed, kv, kill")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    skip = set(filter(None, args.skip.split(",")))
    model = llama8b_folder() if args.model == "8b" else None
    report = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(0),
              "gpus": torch.cuda.device_count(), "model": args.model, "speed": []}
    if "speed" not in skip:
        throughput(model, args, report)
    if "kv" not in skip:
        kv_bound(model, args, report)
    if "kill" not in skip:
        kill_time(model, args, report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
