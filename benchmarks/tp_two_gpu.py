"""TP = 2 over NCCL on two GPUs against TP = 1 on one, CUDA graphs on (the all-reduces and the LM
head's vocabulary gather are captured in them): throughput by batch (goal at batch 1: >= 1.6x), the
same with MTP K = 2 at batch 1, and the time from a killed TP rank to the error at the driver.

A Llama-3-8B-shaped model with random weights (`--load-format dummy`, bf16). Dummy weights are drawn
whole and cut into shards, so both TP sizes run the same model; the MTP head is a random
DeepSeek-style head for that shape (written once to a temporary file), so its acceptance says
nothing: the MTP rows measure what drafting costs and how TP = 2 carries it.
Usage: python benchmarks/tp_two_gpu.py [--batches 1,64] [--new-tokens 64] [--repeats 3]
       [--util 0.40] [--skip speed,mtp,kill] [--custom-peer] [--profile] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from kernel_profile import kernel_profile  # noqa: E402
from pp_spec_gpu import timed  # noqa: E402
from pp_two_gpu import kill_to_error, llama8b_folder, prompts_of  # noqa: E402

from pipespec import LLM, SamplingParams  # noqa: E402


def engine(model: str, tp: int, max_seqs: int, util: float, head: str | None = None, k: int = 0,
           custom_all_reduce: bool = False) -> LLM:
    spec = {"method": "mtp", "num_speculative_tokens": k, "model": head} if k else None
    return LLM(model=model, load_format="dummy", device="cuda", dtype="bfloat16", tensor_parallel_size=tp,
               distributed_backend="nccl", gpu_memory_utilization=util, max_num_seqs=max_seqs,
               max_model_len=1024, max_num_batched_tokens=max(1024, max_seqs), speculative_config=spec,
               custom_all_reduce=custom_all_reduce)


# the engines compared: TP = 1 (the peer), TP = 2 as configured by default (NCCL's all-reduce), and
# with --custom-peer TP = 2 with the one-host all-reduce (what it buys)
LABELS = {"tp1": (1, False), "tp2": (2, False), "tp2_custom": (2, True)}


def random_head(model: str) -> str:
    """A random DeepSeek-style MTP head for the model's shape, saved in bf16."""
    from pipespec.model.mtp import DeepSeekMTP, save_mtp
    from pipespec.checkpoint.source import resolve_model
    from pipespec.model.weights import init_dummy_weights

    layer = DeepSeekMTP(resolve_model(model).arch)
    init_dummy_weights(layer, torch.bfloat16, "cuda", seed=1)
    path = Path(tempfile.mkdtemp(prefix="tp-bench-head-")) / "head.safetensors"
    save_mtp(path, layer, "llama3-8b-shape", dtype=torch.bfloat16)
    del layer
    torch.cuda.empty_cache()
    return str(path)


def compare(engines: dict[int, LLM], batch: int, args, label: str) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    vocab = engines["tp1"].engine.arch.vocab_size
    prompts = prompts_of(batch, args.prompt_len, vocab)
    for llm in engines.values():                 # warm-up: every bucket this batch replays
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    runs = {tp: [] for tp in engines}
    for _ in range(args.repeats):                # interleaved, so drift hits both alike
        for tp, llm in engines.items():
            runs[tp].append(timed(llm, prompts, params))
    med = {tp: statistics.median(r["tokens_per_s"] for r in rs) for tp, rs in runs.items()}
    row = {"rows": label, "batch": batch, **{f"{tp}_tokens_per_s": round(v, 1) for tp, v in med.items()},
           **{f"{tp}_over_tp1": round(v / med["tp1"], 3) for tp, v in med.items() if tp != "tp1"},
           "tp2_driver_busy": round(statistics.median(r["busy"][0] for r in runs["tp2"]), 3),
           "tp2_graph_replays": engines["tp2"].engine.executor.stage.graphs.replays
           if engines["tp2"].engine.executor.stage.graphs is not None else 0,
           # same weights at both sizes; bf16 sums in another order may still flip a near tie
           "greedy_identical": runs["tp1"][0]["outputs"] == runs["tp2"][0]["outputs"]}
    if "acceptance_length" in runs["tp2"][0]:
        row["acceptance_length"] = {tp: round(rs[0]["acceptance_length"], 3) for tp, rs in runs.items()}
    return row


def speed(model, args, report):
    max_seqs = max(args.batches)
    labels = [lb for lb in LABELS if args.custom_peer or lb != "tp2_custom"]
    engines = {lb: engine(model, LABELS[lb][0], max_seqs, args.util, custom_all_reduce=LABELS[lb][1])
               for lb in labels}
    report["kv_blocks"] = {tp: llm.engine.scheduler.allocator.num_blocks for tp, llm in engines.items()}
    for batch in args.batches:
        row = compare(engines, batch, args, "plain")
        report["speed"].append(row)
        print(json.dumps(row), flush=True)
    for llm in engines.values():
        llm.shutdown()


def mtp(model, args, report):
    head = random_head(model)
    engines = {lb: engine(model, LABELS[lb][0], 8, args.util, head=head, k=2) for lb in ("tp1", "tp2")}
    row = compare(engines, 1, args, "mtp_k2")
    report["speed"].append(row)
    print(json.dumps(row), flush=True)
    for llm in engines.values():
        llm.shutdown()


def profile(model, args, report):
    """Where a batch-1 step's time goes on the driver's GPU, TP = 1 against TP = 2 (rank 0), over 32
    decode tokens (`kernel_profile`)."""
    tokens = 32
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    for tp in (1, 2):
        llm = engine(model, tp, 1, args.util, custom_all_reduce=args.custom_peer and tp == 2)
        prompts = prompts_of(1, args.prompt_len, llm.engine.arch.vocab_size)
        llm.generate(prompts, params, use_tqdm=False)
        trace = str(Path(args.json).with_suffix(f".tp{tp}.trace.json")) if args.json else None
        row = {"part": "profile", "tp": tp, **kernel_profile(
            lambda: llm.generate(prompts, params, use_tqdm=False), tokens, trace=trace)}
        report["profile"].append(row)
        print(json.dumps(row), flush=True)
        llm.shutdown()


def kill_time(model, args, report):
    kill_to_error(engine(model, 2, 16, args.util), args.prompt_len, report)   # kills TP rank 1 of the stage


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--util", type=float, default=0.40,
                    help="gpu_memory_utilization of each engine (TP = 1 and TP = 2 share cuda:0)")
    ap.add_argument("--skip", default="", help="comma-separated parts to skip: speed, mtp, kill")
    ap.add_argument("--profile", action="store_true", help="also profile batch-1 steps of TP = 1 and TP = 2")
    ap.add_argument("--custom-peer", action="store_true",
                    help="also run TP = 2 with the one-host all-reduce (--custom-all-reduce)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if torch.cuda.device_count() < 2:
        sys.exit("this benchmark needs two GPUs")
    args.batches = [int(b) for b in args.batches.split(",")]
    skip = set(filter(None, args.skip.split(",")))
    model = llama8b_folder()
    report = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(0),
              "gpus": torch.cuda.device_count(), "model": "llama3-8b-shape dummy bf16", "speed": [],
              "profile": []}
    if "speed" not in skip:
        speed(model, args, report)
    if "mtp" not in skip:
        mtp(model, args, report)
    if "kill" not in skip:
        kill_time(model, args, report)
    if args.profile:
        profile(model, args, report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
