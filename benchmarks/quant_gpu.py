"""Weight-only quantized kernels and engines against bf16 on one GPU (issue 18).

1. Kernels: the Llama-3-8B projections (qkv, o, gate_up, down) at M = 1, 4, 8, 16, 32 and 64 rows:
   bf16 `x @ W.T` against `int4_matmul` (group 128) and `fp8_block_matmul` (128 x 128 blocks) as
   the defaults route them, and their CUDA-core decode kernels alone (`*_gemv_us`): the
   microseconds of one call replayed from a CUDA graph that cycles through copies of the weight
   totalling 512 MB of bf16 (so L2 does not serve them; decode replays graphs too), and the weight
   bytes read per second; past 8 rows also the MMA kernels at their most rows (`int4_mma_us` up
   to 64, `fp8_mma_us` up to 32: `MMA_MAX`; the defaults stop at 32). With `--sweep [KINDS]`, the
   batch-1 row of every projection also tries other launch shapes of the decode kernels (`Gemv`,
   split-K included) and reports the best, to choose the defaults from.
2. Engines: the Llama-3-8B shape with random weights (`--load-format dummy`), bf16 against
   `--quantization fp8` and `--quantization awq` (int4), CUDA graphs on, random 32-token prompts,
   greedy, 64 new tokens; tokens/s by batch, medians of interleaved repeats; the peer is the bf16
   engine in the same run. Goals at batch 1: fp8 >= 1.7x, int4 >= 2.5x. Also the decode alone
   (the whole call less a one-token call, per later token) and that one-token call's time (the
   prefill of the 32-token prompts and the first token).
3. Host: one eager call's host microseconds (bf16, FP8, int4; 4,096 x 4,096 at 1 and 32 rows)
   against its graph-replayed time: what an eager prefill pays each projection.

Usage (GPU machine): python benchmarks/quant_gpu.py [--batches 1,64] [--repeats 3]
       [--skip kernels,host,engines] [--sweep [KINDS]] [--profile] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from kernel_profile import decode_profile, kernel_profile  # noqa: E402
from pp_spec_gpu import timed  # noqa: E402
from pp_two_gpu import llama8b_folder, prompts_of  # noqa: E402

from pipespec import LLM, SamplingParams  # noqa: E402
from pipespec.kernels.fused_ops import silu_mul  # noqa: E402
from pipespec.kernels.gemv import rowmajor_gemv  # noqa: E402
from pipespec.kernels.quant_matmul import Gemv, Tiles, fp8_block_matmul, int4_matmul  # noqa: E402
from pipespec.model.quant.packed import Fp8Weight, Int4Weight  # noqa: E402
from gpu_timing import graph_ms  # noqa: E402

PROJECTIONS = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


L2_PASS = 512 << 20     # bytes of bf16 weights one timing cycles through: far past the 50 MB L2


def _us(calls) -> float:
    """Microseconds of one call, replayed from a CUDA graph of every call in turn (`graph_ms`)."""
    return graph_ms(calls) * 1000


# decode-kernel shapes tried at batch 1, each one Triton compile: (block_n, block_k, num_warps, split_k;
# 0: `gemv_split_k`). int4: columns a program (a warp per >= 128), K a step; fp8 / dense (the bf16
# row-major GEMV, the peer that shares fp8's kernel): rows a program, elements of a row a step. The
# defaults first, then more columns a lane or warps, longer or shorter steps, fixed splits.
SHAPES = {
    "fp8_mma": ((128, 128, 4, 0), (256, 128, 4, 0), (128, 64, 4, 0), (64, 128, 2, 0), (128, 128, 2, 0),
                (128, 128, 8, 0), (256, 128, 8, 0), (128, 128, 4, 4), (128, 128, 4, 8)),
    "int4_mma": ((128, 128, 4, 0), (256, 128, 4, 0), (128, 64, 4, 0), (256, 64, 4, 0), (128, 128, 2, 0),
                 (64, 64, 4, 0), (128, 128, 4, 4), (128, 128, 4, 8)),
    "int4": ((256, 32, 1, 0), (256, 64, 1, 0), (256, 16, 1, 0), (128, 64, 1, 0), (128, 32, 1, 0), (512, 32, 2, 0),
             (256, 32, 1, 16), (256, 32, 1, 32)),
    "fp8": ((16, 512, 4, 0), (8, 512, 4, 0), (32, 512, 4, 0), (16, 1024, 4, 0), (16, 512, 8, 0), (16, 512, 4, 2)),
    "dense": ((8, 512, 4, 0), (8, 1024, 4, 0), (16, 512, 4, 0), (8, 512, 8, 0), (8, 512, 4, 2)),
}
SWEEP = {kind: [Gemv(*shape, tail_sum=not kind.endswith("_mma")) for shape in shapes]
         for kind, shapes in SHAPES.items()}


# the CUDA-core decode kernels, the tensor-core ones' predecessors
GEMV_ONLY = Tiles(int4_mma=None, fp8_mma=None)
# the MMA decode kernels at up to 64 (int4) and 32 (fp8) rows
MMA_MAX = Tiles(int4_mma=replace(Tiles().int4_mma, max_m=64), int4_mma_wide=replace(Tiles().int4_mma_wide, max_m=64),
                fp8_mma=replace(Tiles().fp8_mma, max_m=32))


def _name(g: Gemv) -> str:
    return f"n{g.block_n}_k{g.block_k}_w{g.num_warps}_split{g.split_k or 'auto'}"


def sweep(name, x, dense, q4s, f8s, report, kinds):
    runs = {"int4_mma": (q4s, lambda w, g: int4_matmul(x, w.qweight, w.zeros, w.scales, w.group,
                                                       tiles=Tiles(int4_mma=g, int4_mma_wide=None))),
            "int4": (q4s, lambda w, g: int4_matmul(x, w.qweight, w.zeros, w.scales, w.group,
                                                   tiles=replace(GEMV_ONLY, int4_gemv=g))),
            "fp8_mma": (f8s, lambda w, g: fp8_block_matmul(x, w.weight, w.scale_inv, w.block, Tiles(fp8_mma=g))),
            "fp8": (f8s, lambda w, g: fp8_block_matmul(x, w.weight, w.scale_inv, w.block,
                                                       replace(GEMV_ONLY, fp8_gemv=g))),
            "dense": (dense, lambda w, g: rowmajor_gemv(x, w, shape=g))}
    for kind, (weights, run) in runs.items():
        if kind not in kinds:
            continue
        times = {_name(g): round(_us([lambda w=w, g=g: run(w, g) for w in weights]), 1) for g in SWEEP[kind]}
        best = min(times, key=times.get)
        row = {"part": "sweep", "kernel": kind, "proj": name, "m": x.shape[0], "best": best,
               "best_us": times[best], "us": times}
        report["kernels"].append(row)
        print(json.dumps(row), flush=True)


def random_weights(n: int, k: int, dev: torch.device) -> tuple[torch.Tensor, Int4Weight, Fp8Weight]:
    """One random [n, k] weight in each format: bf16, int4 (group 128) and FP8 (128 x 128 blocks)."""
    dense = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
    q4 = Int4Weight(torch.randint(-2**31, 2**31 - 1, (k // 8, n), device=dev, dtype=torch.int32),
                    torch.full((k // 128, n), 8.0, device=dev, dtype=torch.float16),        # fp16, as AWQ's
                    torch.full((k // 128, n), 0.005, device=dev, dtype=torch.float16), 128)
    f8 = Fp8Weight(torch.randn(n, k, device=dev).to(torch.float8_e4m3fn),
                   torch.full((n // 128, k // 128), 0.02, device=dev), (128, 128))
    return dense, q4, f8


def kernels(report, sweep_kinds: list[str]):
    dev = torch.device("cuda")
    for name, (n, k) in PROJECTIONS.items():
        copies = max(1, L2_PASS // (n * k * 2))
        dense, q4s, f8s = zip(*(random_weights(n, k, dev) for _ in range(copies)))
        for m in (1, 4, 8, 16, 32, 64):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            t = {"bf16": _us([lambda w=w: x @ w.t() for w in dense]),
                 "int4": _us([lambda w=w: w.matmul(x) for w in q4s]),
                 "int4_gemv": _us([lambda w=w: int4_matmul(x, w.qweight, w.zeros, w.scales, w.group, tiles=GEMV_ONLY)
                                   for w in q4s]),
                 "fp8": _us([lambda w=w: w.matmul(x) for w in f8s]),
                 "fp8_gemv": _us([lambda w=w: fp8_block_matmul(x, w.weight, w.scale_inv, w.block, GEMV_ONLY)
                                  for w in f8s])}
            if m > 8:
                t["int4_mma"] = _us([lambda w=w: int4_matmul(x, w.qweight, w.zeros, w.scales, w.group, tiles=MMA_MAX)
                                     for w in q4s])
            if 8 < m <= 32:
                t["fp8_mma"] = _us([lambda w=w: fp8_block_matmul(x, w.weight, w.scale_inv, w.block, MMA_MAX)
                                    for w in f8s])
            row = {"part": "kernel", "proj": name, "m": m, **{f"{kk}_us": round(v, 1) for kk, v in t.items()},
                   "bf16_gbps": round(n * k * 2 / t["bf16"] / 1e3, 0), "int4_gbps": round(n * k / 2 / t["int4"] / 1e3, 0),
                   "fp8_gbps": round(n * k / t["fp8"] / 1e3, 0),
                   "int4_over_bf16": round(t["bf16"] / t["int4"], 2), "fp8_over_bf16": round(t["bf16"] / t["fp8"], 2)}
            report["kernels"].append(row)
            print(json.dumps(row), flush=True)
            if sweep_kinds and m == 1:
                sweep(name, x, dense, q4s, f8s, report, sweep_kinds)
        if name == "down":     # as decode runs it: the gate/up row in (int4 activates it with silu_mul first)
            gu = torch.randn(1, 2 * k, device=dev, dtype=torch.bfloat16)
            t = {"bf16": _us([lambda w=w: silu_mul(gu) @ w.t() for w in dense]),
                 "bf16_gemv": _us([lambda w=w: rowmajor_gemv(gu, w, gated=True) for w in dense]),
                 "int4": _us([lambda w=w: w.matmul(gu, gated=True) for w in q4s]),
                 "fp8": _us([lambda w=w: w.matmul(gu, gated=True) for w in f8s]),
                 "fp8_gemv": _us([lambda w=w: fp8_block_matmul(gu, w.weight, w.scale_inv, w.block, GEMV_ONLY,
                                                               gated=True) for w in f8s])}
            row = {"part": "kernel", "proj": "down (gated)", "m": 1, **{f"{kk}_us": round(v, 1) for kk, v in t.items()}}
            report["kernels"].append(row)
            print(json.dumps(row), flush=True)
        del dense, q4s, f8s
        torch.cuda.empty_cache()


def host_times(report, calls: int = 300):
    """Host microseconds of one eager call (the loop of `calls` after warm-up, not synchronized:
    what the Python side and the launches cost) against its graph-replayed device time, for the
    4,096 x 4,096 projection at 1 and 32 rows: an eager prefill pays the host side every layer."""
    dev, k = torch.device("cuda"), 4096
    dense, q4, f8 = random_weights(4096, k, dev)
    with torch.inference_mode():
        for m in (1, 32):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            row = {"part": "host", "proj": "o", "m": m}
            for name, fn in (("bf16", lambda: x @ dense.t()), ("fp8", lambda: f8.matmul(x)),
                             ("int4", lambda: q4.matmul(x))):
                for _ in range(20):
                    fn()
                torch.cuda.synchronize()
                start = time.perf_counter()
                for _ in range(calls):
                    fn()
                row[f"{name}_host_us"] = round((time.perf_counter() - start) / calls * 1e6, 1)
                torch.cuda.synchronize()
                row[f"{name}_graph_us"] = round(_us([fn]), 1)
            report["kernels"].append(row)
            print(json.dumps(row), flush=True)


def greedy(tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)


def engines(args, report):
    model = llama8b_folder()
    kinds = {"bf16": None, "fp8": "fp8", "int4": "awq"}
    llms = {kind: LLM(model=model, load_format="dummy", quantization=q, device="cuda", dtype="bfloat16",
                      gpu_memory_utilization=args.util, max_num_seqs=max(args.batches), max_model_len=1024,
                      max_num_batched_tokens=max(1024, max(args.batches))) for kind, q in kinds.items()}
    params = greedy(args.new_tokens)
    for batch in args.batches:
        prompts = prompts_of(batch, 32, 128256)
        for llm in llms.values():        # warm-up: the buckets this batch replays
            llm.generate(prompts, greedy(4), use_tqdm=False)
        first = greedy(1)
        runs, firsts = {kind: [] for kind in llms}, {kind: [] for kind in llms}
        for _ in range(args.repeats):
            for kind, llm in llms.items():
                runs[kind].append(batch * args.new_tokens / timed(llm, prompts, params)["tokens_per_s"])
                firsts[kind].append(batch / timed(llm, prompts, first)["tokens_per_s"])
        med = {kind: batch * args.new_tokens / statistics.median(r) for kind, r in runs.items()}
        # decode alone: the full call less a one-token call (the prefill and first token), per later token
        dec = {kind: batch * (args.new_tokens - 1) / (statistics.median(runs[kind]) - statistics.median(firsts[kind]))
               for kind in llms}
        row = {"part": "engine", "batch": batch, **{f"{k}_tokens_per_s": round(v, 1) for k, v in med.items()},
               "fp8_over_bf16": round(med["fp8"] / med["bf16"], 3), "int4_over_bf16": round(med["int4"] / med["bf16"], 3),
               **{f"{k}_decode_tokens_per_s": round(v, 1) for k, v in dec.items()},
               "decode_fp8_over_bf16": round(dec["fp8"] / dec["bf16"], 3),
               "decode_int4_over_bf16": round(dec["int4"] / dec["bf16"], 3),
               **{f"{k}_first_token_ms": round(statistics.median(v) * 1e3, 1) for k, v in firsts.items()}}
        report["engines"].append(row)
        print(json.dumps(row), flush=True)
    if args.profile:                       # after the timed runs (the profiler slows later ones)
        prompts = prompts_of(1, 32, 128256)
        for kind, llm in llms.items():     # batch 1: where a decode step's GPU time goes, kernel by kernel
            def run(n, llm=llm):
                llm.generate(prompts, greedy(n), use_tqdm=False)
            row = {"part": "decode profile", "kind": kind,
                   **decode_profile(lambda: run(args.new_tokens), lambda: run(1), args.new_tokens)}
            report.setdefault("profile", []).append(row)
            print(json.dumps(row), flush=True)
            row = {"part": "first-token profile", "kind": kind, **kernel_profile(lambda: run(1), 1, top=8)}
            report["profile"].append(row)
            print(json.dumps(row), flush=True)
    for llm in llms.values():
        llm.shutdown()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--util", type=float, default=0.28, help="gpu_memory_utilization of each of the 3 engines")
    ap.add_argument("--skip", default="", help="comma-separated: kernels, host, engines")
    ap.add_argument("--sweep", nargs="?", const=",".join(SHAPES), default="",
                    help=f"try other launch shapes at batch 1 of these kernels (default all: {','.join(SHAPES)})")
    ap.add_argument("--profile", action="store_true", help="also profile batch-1 decode steps kernel by kernel")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    skip = set(filter(None, args.skip.split(",")))
    report = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(0), "kernels": [], "engines": []}
    if "kernels" not in skip:
        kernels(report, [k for k in args.sweep.split(",") if k])
    if "host" not in skip:
        host_times(report)
    if "engines" not in skip:
        engines(args, report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
