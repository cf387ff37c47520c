"""The few-pair routed-expert kernels (`kernels/moe_experts.py`) at real MoE shapes, on one GPU.

Each call is one decode layer's routed experts for T tokens (and, where the model has one shaped
like a routed expert, its shared expert as one more pair a token), replayed from a CUDA graph
whose calls each route to other experts (so L2 does not serve the weights; decode replays graphs
too). Reports microseconds a call and the expert bytes read per second. With `--sweep` it also
tries other launch shapes for each kernel (the other kept at the default) and reports the best.

Usage (GPU machine): python benchmarks/moe_experts_gpu.py [--sweep] [--tokens 1 2 4] [--json out.json]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from spec_decode import print_table  # noqa: E402

from pipespec.kernels.moe_experts import FEW_PAIR, few_pair_experts  # noqa: E402
from gpu_timing import graph_ms  # noqa: E402

# name: (experts held, hidden, expert intermediate, top-k, shared expert shaped like a routed one).
# DeepSeek-V3 holds 256 experts; 32 of them (2.8 GB) are enough to route every call elsewhere.
SHAPES = {"glm_flash": (64, 2048, 1536, 4, True), "deepseek_v3": (32, 7168, 2048, 8, True),
          "qwen3_5_35b_a3b": (256, 2048, 512, 8, False)}
CALLS = 24
GATE_UP = [dict(gate_up_n=n, gate_up_k=k, gate_up_warps=w) for n in (2, 4, 8) for k in (512, 1024, 2048)
           for w in (4, 8)]
DOWN = [dict(down_n=n, down_k=k, down_warps=w) for n in (1, 2, 4, 8) for k in (512, 1024, 2048)
        for w in (2, 4, 8)]


def _calls(name: str, tokens: int, dev: torch.device):
    e, h, i, k, has_shared = SHAPES[name]
    g = torch.Generator(device=dev).manual_seed(0)
    gate_up = torch.randn(e, 2 * i, h, device=dev, generator=g, dtype=torch.bfloat16) * 0.02
    down = torch.randn(e, h, i, device=dev, generator=g, dtype=torch.bfloat16) * 0.02
    shared = ((torch.randn(2 * i, h, device=dev, generator=g, dtype=torch.bfloat16) * 0.02,
               torch.randn(h, i, device=dev, generator=g, dtype=torch.bfloat16) * 0.02) if has_shared else None)
    x = torch.randn(tokens, h, device=dev, dtype=torch.bfloat16)
    routes = [(torch.stack([torch.randperm(e, device=dev)[:k] for _ in range(tokens)]),
               torch.rand(tokens, k, device=dev)) for _ in range(CALLS)]
    distinct = sum(len(set(ids.flatten().tolist())) for ids, _ in routes) / CALLS
    nbytes = (distinct + (1 if has_shared else 0)) * 3 * i * h * 2

    def make(s):
        return [lambda ids=ids, w=w: few_pair_experts(x, ids, w, gate_up, down, shared=shared, shape=s)
                for ids, w in routes]
    return make, nbytes


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=sorted(SHAPES), choices=sorted(SHAPES))
    ap.add_argument("--tokens", nargs="+", type=int, default=[1, 2, 4])
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    rows, sweeps = [], []
    with torch.inference_mode():
        for name in args.models:
            for t in args.tokens:
                make, nbytes = _calls(name, t, dev)
                us = graph_ms(make(FEW_PAIR)) * 1000
                row = {"model": name, "tokens": t, "us": round(us, 1), "MB": round(nbytes / 1e6, 1),
                       "TBps": round(nbytes / us / 1e6, 2)}
                rows.append(row)
                print(json.dumps(row), flush=True)
                if not args.sweep:
                    continue
                for kernel, grid in (("gate_up", GATE_UP), ("down", DOWN)):
                    times = {}
                    for change in grid:
                        s = dataclasses.replace(FEW_PAIR, **change)
                        times["_".join(f"{k.split('_')[-1]}{v}" for k, v in change.items())] = round(
                            graph_ms(make(s)) * 1000, 1)
                    best = min(times, key=times.get)
                    sweep = {"model": name, "tokens": t, "kernel": kernel, "default_us": row["us"], "best": best,
                             "best_us": times[best], "us": times}
                    sweeps.append(sweep)
                    print(json.dumps(sweep), flush=True)
            torch.cuda.empty_cache()
    print_table(rows, {c: (lambda r, c=c: r[c]) for c in ("model", "tokens", "us", "MB", "TBps")})
    if args.json:
        Path(args.json).write_text(json.dumps({"calls": rows, "sweeps": sweeps}, indent=1))


if __name__ == "__main__":
    main()
