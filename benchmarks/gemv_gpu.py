"""Dense decode GEMV (`kernels/gemv.py`) against cuBLAS (`F.linear`), kernel by kernel, on one GPU.

Projections of the Llama-3-8B shape, the Qwen3.5-2B-class shape and SmolLM2-135M at M = 1, 2, 4, 8
rows in bf16: microseconds of one call replayed from a CUDA graph that cycles through copies of the
weight totalling 512 MB (so L2 does not serve them; decode replays graphs too), and the weight
bytes read per second. `down (gated)` is the MLP's down projection with its activation: silu_mul
then cuBLAS, against the GEMV that reads the gate/up row itself. With `--sweep` the M = 1 row of
every projection tries other launch shapes and reports the best (to choose the default from).

Usage (GPU machine): python benchmarks/gemv_gpu.py [--sweep] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from spec_decode import print_table  # noqa: E402

from pipespec.kernels.fused_ops import silu_mul  # noqa: E402
from pipespec.kernels.gemv import DENSE_GEMV, Gemv, rowmajor_gemv  # noqa: E402
from gpu_timing import graph_ms  # noqa: E402

# (model, projection): (N, K)
PROJECTIONS = {
    ("8B", "qkv"): (6144, 4096), ("8B", "o"): (4096, 4096), ("8B", "gate_up"): (28672, 4096),
    ("8B", "down"): (4096, 14336), ("8B", "lm_head"): (128256, 4096),
    ("Qwen3.5-2B", "gate_up"): (12288, 2048), ("Qwen3.5-2B", "down"): (2048, 6144),
    ("Qwen3.5-2B", "attn q+gate"): (4096, 2048), ("Qwen3.5-2B", "o"): (2048, 2048),
    ("SmolLM2", "qkv"): (960, 576), ("SmolLM2", "o"): (576, 576), ("SmolLM2", "gate_up"): (3072, 576),
    ("SmolLM2", "down"): (576, 1536),
}
L2_PASS = 512 << 20
# (block_n, block_k, warps, split_k; 0: `gemv_split_k` picks)
SWEEP = [Gemv(n, k, w, split) for n, k, w, split in (
    (8, 512, 4, 0), (16, 256, 4, 0), (8, 256, 4, 0), (32, 256, 4, 0), (16, 128, 4, 0), (16, 512, 4, 0),
    (32, 128, 4, 0), (16, 256, 8, 0), (32, 256, 8, 0), (8, 256, 2, 0), (4, 512, 4, 0), (64, 128, 8, 0),
    (8, 512, 4, 1), (4, 512, 4, 1), (4, 1024, 4, 1), (2, 1024, 4, 1), (8, 512, 4, 2))]


def _us(calls) -> float:
    return graph_ms(calls) * 1000


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--models", default="8B,Qwen3.5-2B,SmolLM2")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    rows_out, sweeps = [], []
    with torch.inference_mode():
        for (model, proj), (n, k) in PROJECTIONS.items():
            if model not in args.models.split(","):
                continue
            copies = max(1, L2_PASS // (n * k * 2))
            ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
            gated = proj == "down"
            for m in map(int, args.rows.split(",")):
                x = torch.randn(m, 2 * k if gated else k, device=dev, dtype=torch.bfloat16)
                h = silu_mul(x) if gated else x
                cublas = _us([lambda w=w: torch.nn.functional.linear(h, w) for w in ws])
                ours = _us([lambda w=w: rowmajor_gemv(h, w) for w in ws])
                row = {"model": model, "proj": f"{proj} {n}x{k}", "m": m, "cublas_us": round(cublas, 1),
                       "gemv_us": round(ours, 1), "cublas_TBps": round(n * k * 2 / cublas / 1e6, 2),
                       "gemv_TBps": round(n * k * 2 / ours / 1e6, 2), "speedup": round(cublas / ours, 2)}
                if gated:
                    unfused = _us([lambda w=w: torch.nn.functional.linear(silu_mul(x), w) for w in ws])
                    fused = _us([lambda w=w: rowmajor_gemv(x, w, gated=True) for w in ws])
                    row.update(silu_mul_cublas_us=round(unfused, 1), gated_gemv_us=round(fused, 1),
                               gated_speedup=round(unfused / fused, 2))
                rows_out.append(row)
                print(json.dumps(row), flush=True)
                if args.sweep and m == 1:
                    times = {f"n{s.block_n}_k{s.block_k}_w{s.num_warps}_split{s.split_k or 'auto'}": round(_us(
                        [lambda w=w, s=s: rowmajor_gemv(h, w, shape=s) for w in ws]), 1) for s in SWEEP}
                    best = min(times, key=times.get)
                    sweep = {"model": model, "proj": proj, "best": best, "best_us": times[best],
                             "default_us": round(_us([lambda w=w: rowmajor_gemv(h, w) for w in ws]), 1),
                             "default": str(DENSE_GEMV),
                             "us": times}
                    sweeps.append(sweep)
                    print(json.dumps(sweep), flush=True)
            del ws
            torch.cuda.empty_cache()
    cols = ["model", "proj", "m", "cublas_us", "gemv_us", "cublas_TBps", "gemv_TBps", "speedup",
            "silu_mul_cublas_us", "gated_gemv_us", "gated_speedup"]
    print_table(rows_out, {c: (lambda r, c=c: r.get(c, "")) for c in cols})
    if args.json:
        Path(args.json).write_text(json.dumps({"kernels": rows_out, "sweeps": sweeps}, indent=1))


if __name__ == "__main__":
    main()
