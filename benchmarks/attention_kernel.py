"""The Triton paged-attention kernel against PyTorch's SDPA on contiguous K/V (flash backend), same run.

Usage (GPU machine): python benchmarks/attention_kernel.py
SDPA reads an unpaged [B, H, L, D] cache, so it is a lower bound on what paging may cost. Each row
also times the kernel with its KV split off (`unsplit_us`, one program per request and KV head) and
says how many splits the default chose (issue 17's goal: within 1.25x of SDPA at 4k-32k, batch 1-64).
"""
import json

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from pipespec.kernels.paged_attention import kv_splits_for, paged_attention


def case(batch, q_len, ctx, heads, kv_heads, dim, page=16):
    dev, dt = "cuda", torch.bfloat16
    blocks = batch * (-(-ctx // page))
    key = torch.randn(blocks * page, kv_heads, dim, device=dev, dtype=dt)
    value = torch.randn_like(key)
    tables = torch.randperm(blocks, device=dev).view(batch, -1)
    qsl = torch.arange(batch + 1, device=dev) * q_len
    seq_lens = torch.full((batch,), ctx, device=dev)
    q = torch.randn(batch * q_len, heads, dim, device=dev, dtype=dt)
    ours = do_bench(lambda: paged_attention(q, key, value, tables, qsl, seq_lens, q_len, dim ** -0.5, page))
    unsplit = do_bench(lambda: paged_attention(q, key, value, tables, qsl, seq_lens, q_len, dim ** -0.5, page,
                                               num_splits=1))
    splits = kv_splits_for(batch, kv_heads, q_len * (heads // kv_heads), tables.shape[1] * page, q.device)
    qd = q.view(batch, q_len, heads, dim).transpose(1, 2)
    kd = torch.randn(batch, kv_heads, ctx, dim, device=dev, dtype=dt)
    vd = torch.randn_like(kd)
    mask = None if q_len == 1 else torch.ones(q_len, ctx, device=dev, dtype=torch.bool).tril(ctx - q_len)
    sdpa = do_bench(lambda: F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, enable_gqa=True))
    kv_bytes = 2 * batch * ctx * kv_heads * dim * 2
    return {"batch": batch, "q_len": q_len, "ctx": ctx, "heads": f"{heads}/{kv_heads}x{dim}",
            "triton_us": round(ours * 1e3, 1), "unsplit_us": round(unsplit * 1e3, 1), "splits": splits,
            "sdpa_us": round(sdpa * 1e3, 1), "triton_over_sdpa": round(ours / sdpa, 2),
            "triton_GBps": round(kv_bytes / ours / 1e6, 1)}


if __name__ == "__main__":
    for shape in ((9, 3, 64), (32, 8, 128)):
        for batch, q_len, ctx in ((1, 1, 512), (1, 4, 512), (1, 1, 4096), (1, 4, 4096), (1, 1, 32768),
                                  (8, 1, 8192), (64, 1, 512), (64, 4, 512), (64, 1, 2048), (64, 1, 4096),
                                  (1, 512, 512)):
            print(json.dumps(case(batch, q_len, ctx, *shape)), flush=True)
