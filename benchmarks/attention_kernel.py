"""The Triton paged-attention kernel against PyTorch's SDPA on contiguous K/V (flash backend), same run.

Usage (GPU machine): python benchmarks/attention_kernel.py [--sweep] [--splits]
SDPA reads an unpaged [B, H, L, D] cache, so it is a lower bound on what paging may cost. Both are
timed as decode runs them, replayed from a CUDA graph (`graph_ms`; timed eagerly, the Triton launch
of tens of microseconds was what the first figures measured), over copies of the cache totalling
256 MB so L2 does not serve them. Each row also times the kernel with its KV split off
(`unsplit_us`, one program per request and KV head) and says how many splits the default chose
(issue 17's goal: within 1.25x of SDPA at 4k-32k, batch 1-64). `--sweep` also times other launch
shapes (`Launch`: key tile, pipeline stages, warps) on the goal's rows and reports the best of
each, to choose the defaults from; `--splits` times every split count of `SPLITS` on the decode rows
of batch > 1 and of the goal, beside the split rule's choice (`wave_splits`) and the one of the rule
before it (`num_kv_splits`, about four programs an SM), with the compiled kernel's shared memory and
registers (what `kv_splits` reads to count the programs an SM holds).
"""
import argparse
import itertools
import json

import torch
import torch.nn.functional as F
from triton.runtime.errors import OutOfResources
from pipespec.kernels import sm_count
from pipespec.kernels.kv_split import num_kv_splits
from pipespec.kernels.paged_attention import DEFAULT_LAUNCH, Launch, _paged_attention_kernel, kv_splits, paged_attention
from gpu_timing import graph_ms  # the benchmarks' own timers (run from benchmarks/)


L2_PASS = 256 << 20     # bytes of K/V one timing cycles through: far past the 50 MB L2


def _us(calls) -> float:
    return graph_ms(calls) * 1000


SWEEP = [Launch(block_n=n, num_stages=st, num_warps=w) for n, st, w in itertools.product((64, 128), (2, 3, 4), (4, 8))]
SPLITS = (1, 2, 3, 4, 5, 6, 8, 9, 11, 12, 16, 22, 24, 32, 44, 48, 64, 66, 86, 96, 128)


def kernel_resources() -> dict:
    """Shared memory bytes and registers of each compiled variant launched so far, by split count."""
    out = {}
    for compiled, _, _, meta in _paged_attention_kernel._entries.values():
        name = f"n{meta['BLOCK_N']}_s{meta.get('num_stages')}_w{meta.get('num_warps')}_splits{meta['NUM_SPLITS']}"
        out[name] = {"shared": compiled.metadata.shared, "regs": compiled.n_regs}
    return out


def case(batch, q_len, ctx, heads, kv_heads, dim, page=16, sweep=False, split_sweep=False):
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
    rows = q_len * (heads // kv_heads)
    splits = kv_splits(q, caches[0][0], caches[0][1], tables, qsl, seq_lens, q_len, page)
    old = num_kv_splits(batch * kv_heads * -(-rows // 16), tables.shape[1] * page, sm_count(q.device))
    by_splits = {s: round(_us(paged(s)), 1) for s in SPLITS if split_sweep and s * 256 <= ctx}
    tried = {}
    for launch in SWEEP if sweep else ():
        name = f"n{launch.block_n}_s{launch.num_stages}_w{launch.num_warps}"
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
    if by_splits:
        fastest = min(by_splits, key=by_splits.get)
        row.update(old_rule_splits=old, by_splits=by_splits, fastest_splits=fastest,
                   rule_over_fastest=round(ours / by_splits[fastest], 3), resources=kernel_resources())
    if tried:
        timed = {k: v for k, v in tried.items() if isinstance(v, float)}
        best = min(timed, key=timed.get)
        row.update(best=best, best_us=timed[best], best_over_sdpa=round(timed[best] / sdpa, 2), sweep=tried)
    return row


GOAL_ROWS = {(1, 1, 4096), (1, 1, 32768), (8, 1, 8192), (64, 1, 4096)}

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true", help="also time other launch shapes on the goal's rows")
    ap.add_argument("--splits", action="store_true", help="also time every split count on batched decode rows")
    args = ap.parse_args()
    for shape in ((9, 3, 64), (32, 8, 128)):
        for batch, q_len, ctx in ((1, 1, 512), (1, 4, 512), (1, 1, 4096), (1, 4, 4096), (1, 1, 32768),
                                  (8, 1, 8192), (8, 4, 8192), (16, 1, 16384), (32, 1, 8192), (64, 1, 512),
                                  (64, 4, 512), (64, 1, 2048), (64, 1, 4096), (64, 4, 4096), (1, 512, 512)):
            goal = (batch, q_len, ctx) in GOAL_ROWS
            split_sweep = args.splits and (goal or (batch > 1 and ctx >= 2048))
            print(json.dumps(case(batch, q_len, ctx, *shape, sweep=args.sweep and goal, split_sweep=split_sweep)),
                  flush=True)
