"""Speed and memory of MTP training steps on a random target shaped like SmolLM2-135M (no download).

Usage: python benchmarks/mtp_train_speed.py [--batch-size 48] [--seq-len 320] [--steps 3] [--iters 12]
Prints tokens/s of whole training steps (target pass + K chained head steps + backward + AdamW) and
the peak GPU memory; also checks that the dense teacher-forced target pass matches the engine's
paged reference backend on this device.
"""
import argparse
import json
import time

import torch

from pipespec.model.arch import ArchConfig
from pipespec.model.attention import ForwardContext, TorchReferenceBackend, allocate_kv_caches
from pipespec.model.llama import LlamaForCausalLM
from pipespec.model.mtp import DeepSeekMTP
from pipespec.train.data import Batcher, Sample
from pipespec.train.evaluate import agreement
from pipespec.train.forward import target_pass
from pipespec.train.loop import TrainConfig, train

SMOLLM2_135M = ArchConfig(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                          num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5,
                          rope_theta=100000.0, max_position=8192, tie_word_embeddings=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch-size", type=int, default=48)
    ap.add_argument("--seq-len", type=int, default=320)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--iters", type=int, default=12)
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    arch = SMOLLM2_135M
    target = LlamaForCausalLM(arch).to(dev).eval().requires_grad_(False)

    # dense pass == paged reference pass (float32)
    ids = torch.randint(0, arch.vocab_size, (1, 40), device=dev)
    hidden, _ = target_pass(target, ids)
    caches = allocate_kv_caches(arch.num_layers, 4, 16, arch.num_kv_heads, arch.head_dim, torch.float32, dev)
    backend, pos = TorchReferenceBackend(), torch.arange(40, device=dev)
    attn = backend.prepare(torch.tensor([0, 40], device=dev), torch.tensor([40], device=dev), pos,
                           torch.arange(4, device=dev)[None], 16)
    with torch.no_grad():
        ref, _ = target(ForwardContext(pos, pos.clone(), backend, attn, caches), input_ids=ids[0])
    dense_err = float((ref - hidden[0]).abs().max())

    if dev.type == "cuda":
        target.to(torch.bfloat16)
    head = DeepSeekMTP(arch)
    head.init_from_target(target)
    head.to(dev, torch.float32)
    g = torch.Generator().manual_seed(0)
    samples = [Sample(tuple(torch.randint(0, arch.vocab_size, (args.seq_len,), generator=g).tolist()), 0)
               for _ in range(4 * args.batch_size)]
    batcher = Batcher(samples, [], args.batch_size, args.seq_len)
    warm = 2
    cfg = TrainConfig(num_steps=args.steps, tokens=warm * args.batch_size * args.seq_len, batch_size=args.batch_size,
                      seq_len=args.seq_len, log_every=1)
    train(head, target, batcher, cfg, dev)                    # warm-up
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    cfg = TrainConfig(**{**cfg.__dict__, "tokens": args.iters * args.batch_size * args.seq_len, "log_every": 1000})
    t0 = time.perf_counter()
    train(head, target, batcher, cfg, dev)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    target.float()
    t1 = time.perf_counter()
    agreement(head, target, samples[:32], args.steps, dev)
    out = {"device": torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu",
           "dense_vs_paged_max_abs_err_fp32": dense_err,
           "train_tokens_per_s": round(args.iters * args.batch_size * args.seq_len / dt),
           "train_step_ms": round(1000 * dt / args.iters, 1),
           "peak_gpu_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1) if dev.type == "cuda" else None,
           "eval_32x320_s": round(time.perf_counter() - t1, 2)}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
