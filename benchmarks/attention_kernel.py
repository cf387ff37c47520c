"""The Triton paged-attention kernel against PyTorch's SDPA on contiguous K/V (flash backend), same run.

Usage (GPU machine): python benchmarks/attention_kernel.py [--sweep]
SDPA reads an unpaged [B, H, L, D] cache, so it is a lower bound on what paging may cost. Both are
timed as decode runs them, replayed from a CUDA graph (`graph_ms`; timed eagerly, the Triton launch
of tens of microseconds was what the first figures measured), over copies of the cache totalling
256 MB so L2 does not serve them. Each row also times the kernel with its KV split off
(`unsplit_us`, one program per request and KV head) and says how many splits the default chose
(issue 17's goal: within 1.25x of SDPA at 4k-32k, batch 1-64). `--sweep` also times other launch
shapes (`Launch`: key tile, pipeline stages, warps, the split rule) on the goal's rows and reports
the best of each, to choose the defaults from.
"""
import argparse
import itertools
import json

import torch
import torch.nn.functional as F
from triton.runtime.errors import OutOfResources
from pipespec.kernels.paged_attention import DEFAULT_LAUNCH, Launch, kv_splits_for, paged_attention
from pipespec.stage.cuda_graphs import graph_ms


L2_PASS = 256 << 20     # bytes of K/V one timing cycles through: far past the 50 MB L2


def _us(calls) -> float:
    return graph_ms(calls) * 1000


SWEEP = [Launch(block_n=n, num_stages=st, num_warps=w, per_sm=ps, max_splits=128)
         for n, st, w, ps in itertools.product((64, 128), (2, 3, 4), (4, 8), (2, 4))]


def case(batch, q_len, ctx, heads, kv_heads, dim, page=16, sweep=False):
    dev, dt = "cuda", torch.bfloat16
    blocks = batch * (-(-ctx // page))
    kv_bytes = 2 * batch * ctx * kv_heads * dim * 2
    copies = max(1, min(16, L2_PASS // kv_bytes))
    caches = [(torch.randn(blocks * page, kv_heads, dim, device=dev, dtype=dt),
               torch.randn(blocks * page, kv_heads, dim, device=dev, dtype=dt)) for _ in range(copies)]
    tables = torch.randperm(blocks, device=dev).view(batch, -1)
    qsl = torch.arange(batch + 1, device=dev) * q_len
    seq_lens = torch.full((batch,), ctx, device=dev)
    q = torch.randn(batch * q_len, heads, dim, device=dev, dtype=dt)

    def paged(splits=None, launch=DEFAULT_LAUNCH):
        return [lambda kv=kv: paged_attention(q, kv[0], kv[1], tables, qsl, seq_lens, q_len, dim ** -0.5, page,
                                              num_splits=splits, launch=launch) for kv in caches]

    ours, unsplit = _us(paged()), _us(paged(1))
    splits = kv_splits_for(batch, kv_heads, q_len * (heads // kv_heads), tables.shape[1] * page, q.device)
    tried = {}
    for launch in SWEEP if sweep else ():
        name = f"n{launch.block_n}_s{launch.num_stages}_w{launch.num_warps}_sm{launch.per_sm}"
        try:
            tried[name] = round(_us(paged(launch=launch)), 1)
        except OutOfResources:          # more shared memory than an SM has: not a candidate
            tried[name] = "out of resources"
    caches.clear()                            # room for the contiguous copies
    qd = q.view(batch, q_len, heads, dim).transpose(1, 2)
    dense = [(torch.randn(batch, kv_heads, ctx, dim, device=dev, dtype=dt),
              torch.randn(batch, kv_heads, ctx, dim, device=dev, dtype=dt)) for _ in range(copies)]
    mask = None if q_len == 1 else torch.ones(q_len, ctx, device=dev, dtype=torch.bool).tril(ctx - q_len)
    sdpa = _us([lambda kv=kv: F.scaled_dot_product_attention(qd, kv[0], kv[1], attn_mask=mask, enable_gqa=True)
                for kv in dense])
    row = {"batch": batch, "q_len": q_len, "ctx": ctx, "heads": f"{heads}/{kv_heads}x{dim}",
           "triton_us": round(ours, 1), "unsplit_us": round(unsplit, 1), "splits": splits,
           "sdpa_us": round(sdpa, 1), "triton_over_sdpa": round(ours / sdpa, 2),
           "triton_GBps": round(kv_bytes / ours / 1e3, 1)}
    if tried:
        timed = {k: v for k, v in tried.items() if isinstance(v, float)}
        best = min(timed, key=timed.get)
        row.update(best=best, best_us=timed[best], best_over_sdpa=round(timed[best] / sdpa, 2), sweep=tried)
    return row


GOAL_ROWS = {(1, 1, 4096), (1, 1, 32768), (8, 1, 8192), (64, 1, 4096)}

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true", help="also time other launch shapes on the goal's rows")
    args = ap.parse_args()
    for shape in ((9, 3, 64), (32, 8, 128)):
        for batch, q_len, ctx in ((1, 1, 512), (1, 4, 512), (1, 1, 4096), (1, 4, 4096), (1, 1, 32768),
                                  (8, 1, 8192), (64, 1, 512), (64, 4, 512), (64, 1, 2048), (64, 1, 4096),
                                  (1, 512, 512)):
            sweep = args.sweep and (batch, q_len, ctx) in GOAL_ROWS
            print(json.dumps(case(batch, q_len, ctx, *shape, sweep=sweep)), flush=True)
