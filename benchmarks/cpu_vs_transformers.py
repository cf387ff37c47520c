"""pipespec vs transformers `generate` on CPU, same GGUF weights, fp32, in one run.

Measures (medians over --repeats, runs of the two engines interleaved so drift hits both):
  * batch 1: decode tokens/s (time for N+1 new tokens minus time for 1, over N)
  * 16 prompts of mixed lengths: output tokens/s for the whole batch, prefill included (prefix
    caching off, so that every repeat prefills); transformers both as one left-padded batched
    generate() call and one prompt at a time
Usage: python benchmarks/cpu_vs_transformers.py [--threads 2] [--new-tokens 64] [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch", type=int, default=16)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM

    from pipespec import LLM, SamplingParams
    from pipespec.checkpoint.source import default_model_path

    gguf = default_model_path()
    # prefix caching off: the repeats send the same prompts, whose prefill a cache would skip
    llm = LLM(model=None, dtype="float32", device="cpu", enable_prefix_caching=False)
    hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    tok = llm.get_tokenizer()
    n = args.new_tokens

    base = ("The history of computing is a long story of ideas, machines and people. "
            "It begins with counting boards and mechanical calculators, ")
    prompt1 = tok.encode("Write a short story about a robot who learns to paint.")
    # mixed lengths: 8 .. ~300 tokens
    words = (base * 12).split()
    lengths = [8 + (i * 37) % 290 for i in range(args.batch)]
    batch_prompts = [tok.encode(" ".join(words[:max(4, L * 3 // 4)]))[:L] for L in lengths]

    def ours(prompts, new):
        p = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": q} for q in prompts], p, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == new for o in outs)

    @torch.inference_mode()
    def hf_one(prompt, new):
        ids = torch.tensor([prompt])
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                          do_sample=False, pad_token_id=2)
        assert out.shape[1] == len(prompt) + new

    @torch.inference_mode()
    def hf_batch(prompts, new):
        width = max(len(q) for q in prompts)
        ids = torch.tensor([[2] * (width - len(q)) + q for q in prompts])
        mask = torch.tensor([[0] * (width - len(q)) + [1] * len(q) for q in prompts])
        out = hf.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                          do_sample=False, pad_token_id=2)
        assert out.shape[1] == width + new

    # warm-up
    ours([prompt1], 4); hf_one(prompt1, 4)

    r = {k: [] for k in ("ours_b1", "hf_b1", "ours_batch", "hf_batch", "hf_seq")}
    for _ in range(args.repeats):
        r["ours_b1"].append(n / (timed(lambda: ours([prompt1], n + 1)) - timed(lambda: ours([prompt1], 1))))
        r["hf_b1"].append(n / (timed(lambda: hf_one(prompt1, n + 1)) - timed(lambda: hf_one(prompt1, 1))))
        total = len(batch_prompts) * n
        r["ours_batch"].append(total / timed(lambda: ours(batch_prompts, n)))
        r["hf_batch"].append(total / timed(lambda: hf_batch(batch_prompts, n)))
    r["hf_seq"].append(len(batch_prompts) * n / timed(lambda: [hf_one(q, n) for q in batch_prompts]))

    med = {k: statistics.median(v) for k, v in r.items()}
    summary = {
        "machine": f"{platform.machine()} {platform.processor() or ''} threads={args.threads}".strip(),
        "date": time.strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "new_tokens": n, "batch": args.batch, "prompt_lengths": lengths,
        "tokens_per_s_median": {k: round(v, 1) for k, v in med.items()},
        "ratio_b1": round(med["ours_b1"] / med["hf_b1"], 2),
        "ratio_batch_vs_hf_batched": round(med["ours_batch"] / med["hf_batch"], 2),
        "ratio_batch_vs_hf_sequential": round(med["ours_batch"] / med["hf_seq"], 2),
        "runs": {k: [round(x, 1) for x in v] for k, v in r.items()},
    }
    print(json.dumps(summary, indent=1))
    llm.shutdown()


if __name__ == "__main__":
    main()
