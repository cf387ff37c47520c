"""Programmatic dependent launch on the decode path (`pipespec/kernels/pdl.py`): a model's batch-1
decode kernels in a row (per layer: residual add + RMSNorm, the input projection, the output
projection, residual add + RMSNorm, gate/up, the gated down projection; then the LM head), captured
in one CUDA graph and replayed, with PDL off and on in the same run. Attention and the recurrence
are left out: the chain is the weight stream and the small kernels between its parts.

Usage (GPU machine): python benchmarks/pdl_chain.py [--models qwen3_5_2b llama3_8b] [--replays 20]
Prints ms a replay, the weight bytes' TB/s, and whether both outputs are bit-identical.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

from pipespec.kernels.fused_ops import rms_norm
from pipespec.kernels.gemv import rowmajor_gemv
from pipespec.stage.cuda_graphs import capture_graph

# hidden, input projection rows, output projection columns, intermediate, layers, vocab
SHAPES = {"qwen3_5_2b": (2048, 8224, 2048, 6144, 24, 248320),     # Gated DeltaNet layers' shapes
          "llama3_8b": (4096, 6144, 4096, 14336, 32, 128256)}


def build(name: str):
    h, n_in, n_out, inter, layers, vocab = SHAPES[name]
    g = torch.Generator(device="cuda").manual_seed(0)

    def w(*shape):
        return (torch.randn(*shape, device="cuda", generator=g) * 0.02).to(torch.bfloat16)

    return [dict(norm1=torch.ones(h, device="cuda", dtype=torch.bfloat16), w_in=w(n_in, h), w_out=w(h, n_out),
                 norm2=torch.ones(h, device="cuda", dtype=torch.bfloat16), gate_up=w(2 * inter, h), down=w(h, inter))
            for _ in range(layers)], w(vocab, h), (n_in, n_out)


def chain(x, layers, head, widths):
    n_in, n_out = widths
    residual = torch.zeros_like(x)
    for p in layers:
        h, residual = rms_norm(x, p["norm1"], 1e-6, residual)
        y = rowmajor_gemv(h, p["w_in"])[:, :n_out].contiguous()       # the mixer's output width
        x = rowmajor_gemv(y, p["w_out"])
        h, residual = rms_norm(x, p["norm2"], 1e-6, residual)
        x = rowmajor_gemv(rowmajor_gemv(h, p["gate_up"]), p["down"], gated=True)
    return rowmajor_gemv(rms_norm(x, layers[0]["norm1"], 1e-6), head)


def time_graph(fn, replays: int) -> tuple[float, torch.Tensor]:
    """Captured as the engine captures (`capture_graph`: PDL unless PIPESPEC_PDL=0)."""
    graph, out = capture_graph(None, fn)
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), out.clone()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=sorted(SHAPES), choices=sorted(SHAPES))
    ap.add_argument("--replays", type=int, default=20)
    args = ap.parse_args()
    for name in args.models:
        layers, head, widths = build(name)
        x = torch.randn(1, head.shape[1], device="cuda", dtype=torch.bfloat16)
        nbytes = sum(t.numel() * t.element_size() for p in layers for t in p.values()) + head.numel() * 2
        row, outs = {"model": name, "weight_GB": round(nbytes / 1e9, 3)}, {}
        for pdl in ("0", "1", "0", "1"):              # interleaved, medians of each
            os.environ["PIPESPEC_PDL"] = pdl
            ms, outs[pdl] = time_graph(lambda: chain(x, layers, head, widths), args.replays)
            row.setdefault(f"ms_pdl{pdl}", []).append(ms)
        for pdl in ("0", "1"):
            row[f"ms_pdl{pdl}"] = round(statistics.median(row[f"ms_pdl{pdl}"]), 4)
            row[f"TBps_pdl{pdl}"] = round(nbytes / row[f"ms_pdl{pdl}"] / 1e9, 3)
        row["speedup"] = round(row["ms_pdl0"] / row["ms_pdl1"], 3)
        row["identical"] = bool(torch.equal(outs["0"], outs["1"]))
        print(json.dumps(row), flush=True)
        del layers, head
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
