"""MLA's decode attention pieces, timed as decode runs them (replayed from a CUDA graph, over copies of
the latent cache past L2): the paged absorbed kernel (`kernels/mla_attention.py`) with its default KV
split and unsplit, and the absorbed per-head products (`kernels/mla_absorb.py`) against the einsums
they replaced, at GLM-4.7-Flash's and DeepSeek-V3's head shapes.

Usage (GPU machine): python benchmarks/mla_kernel.py [--sweep] [--json out.json]
The cache rows' TB/s is the latent cache bytes a call reads over its time: the kernel's roofline
at long contexts. `--sweep` also times other launch shapes (`MLALaunch`) and split counts.
"""
import argparse
import itertools
import json

import torch
from triton.runtime.errors import OutOfResources

from pipespec.kernels.mla_absorb import absorb_output, absorb_query
from pipespec.kernels.mla_attention import DEFAULT_MLA_LAUNCH, MLALaunch, mla_paged_attention
from gpu_timing import graph_ms  # the benchmarks' own timers (run from benchmarks/)

L2_PASS = 256 << 20
# heads, kv_lora_rank, rope dim, nope dim, v dim
SHAPES = {"glm_flash": (20, 512, 64, 192, 256), "deepseek_v3": (128, 512, 64, 128, 128)}
SWEEP = [MLALaunch(block_m=m, block_n=n, num_warps=w)
         for m, n, w in itertools.product((16, 32), (16, 32, 64), (4, 8))]


def _us(calls) -> float:
    return round(graph_ms(calls) * 1000, 2)


def attention_row(shape: str, batch: int, ctx: int, sweep: bool, page: int = 16) -> dict:
    heads, rank, rope, _, _ = SHAPES[shape]
    dev, dt = "cuda", torch.bfloat16
    blocks = batch * (-(-ctx // page))
    width = 2048 // page                                # the graph's block tables span max_model_len
    width = max(width, -(-ctx // page))
    cache_bytes = batch * ctx * (rank + rope) * 2
    copies = max(1, min(16, L2_PASS // cache_bytes))
    caches = [torch.randn(blocks * page, 1, rank + rope, device=dev, dtype=dt) for _ in range(copies)]
    tables = torch.zeros(batch, width, dtype=torch.int32, device=dev)
    tables[:, :-(-ctx // page)] = torch.randperm(blocks, device=dev, dtype=torch.int32).view(batch, -1)
    qsl = torch.arange(batch + 1, device=dev, dtype=torch.int32)
    seq_lens = torch.full((batch,), ctx, device=dev, dtype=torch.int32)
    q_lat = torch.randn(batch, heads, rank, device=dev, dtype=dt)
    q_rope = torch.randn(batch, heads, rope, device=dev, dtype=dt)

    def calls(splits=None, launch=DEFAULT_MLA_LAUNCH):
        return [lambda c=c: mla_paged_attention(q_lat, q_rope, c, tables, qsl, seq_lens, 1, 0.1, page,
                                                num_splits=splits, launch=launch) for c in caches]

    row = {"shape": shape, "batch": batch, "ctx": ctx, "default_us": _us(calls()), "unsplit_us": _us(calls(1))}
    row["cache_TBps"] = round(cache_bytes / row["default_us"] / 1e6, 2)
    if sweep:
        tried = {}
        for launch, splits in itertools.product(SWEEP, (None, 4)):
            name = f"m{launch.block_m}_n{launch.block_n}_w{launch.num_warps}_sp{splits}"
            try:
                tried[name] = _us(calls(splits, launch))
            except OutOfResources:
                continue
        best = sorted(tried.items(), key=lambda kv: kv[1])[:5]
        row["best"] = best
    return row


def absorb_row(shape: str, rows: int) -> dict:
    heads, rank, _, dn, dv = SHAPES[shape]
    dev, dt = "cuda", torch.bfloat16
    w_bytes = heads * (dn + dv) * rank * 2
    copies = max(1, min(32, L2_PASS // w_bytes))
    weights = [torch.randn(heads * (dn + dv), rank, device=dev, dtype=dt) * 0.05 for _ in range(copies)]
    q = torch.randn(rows, heads, dn + 64, device=dev, dtype=dt)[..., :dn]
    o = torch.randn(rows, heads, rank, device=dev, dtype=dt)
    per_head = [w.view(heads, dn + dv, rank) for w in weights]
    out = {"shape": shape, "rows": rows}
    out["query_us"] = _us([lambda w=w: absorb_query(q, w, dn, dv) for w in weights])
    out["query_einsum_us"] = _us([lambda w=w: torch.einsum("thd,hdr->thr", q, w[:, :dn]) for w in per_head])
    out["output_us"] = _us([lambda w=w: absorb_output(o, w, dn, dv) for w in weights])
    out["output_einsum_us"] = _us([lambda w=w: torch.einsum("thr,hvr->thv", o, w[:, dn:]) for w in per_head])
    out["query_TBps"] = round(heads * dn * rank * 2 / out["query_us"] / 1e6, 2)
    out["output_TBps"] = round(heads * dv * rank * 2 / out["output_us"] / 1e6, 2)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = []
    for shape in SHAPES:
        for r in (1, 2, 4):
            rows.append(absorb_row(shape, r))
            print(json.dumps(rows[-1]), flush=True)
    for shape, batch, ctx in itertools.product(SHAPES, (1, 8), (96, 1024, 4096)):
        rows.append(attention_row(shape, batch, ctx, args.sweep and batch == 1 and shape == "glm_flash"
                                  and ctx != 1024))
        print(json.dumps(rows[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
