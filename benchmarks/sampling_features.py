"""What sampling features cost in tokens/s on the CPU: every request of a batch asking for top-5
logprobs, for penalties (repetition, presence, frequency and a logit_bias), or for both, against
plain requests, on the default model (fp32). Greedy, ignore_eos, the same prompts; configurations
alternate within each repeat so drift hits all of them; the figure is the median over repeats.

    python benchmarks/sampling_features.py --batch 1 64 --repeats 3
"""
from __future__ import annotations

import argparse
import statistics
import time

FEATURES = {"plain": {}, "logprobs": {"logprobs": 5},
            "penalties": {"repetition_penalty": 1.1, "presence_penalty": 0.5, "frequency_penalty": 0.5,
                          "logit_bias": {13: 1.0}},
            "both": {"logprobs": 5, "repetition_penalty": 1.1, "presence_penalty": 0.5, "frequency_penalty": 0.5,
                     "logit_bias": {13: 1.0}}}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--k", type=int, default=0, help="MTP draft tokens (0: no speculation)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    import torch
    from pipespec import LLM, SamplingParams
    torch.set_num_threads(args.threads)
    spec = {"method": "mtp", "num_speculative_tokens": args.k} if args.k else None
    llm = LLM(dtype="float32", device="cpu", max_model_len=512, max_num_seqs=max(args.batch),
              max_num_batched_tokens=4096, enable_prefix_caching=False, speculative_config=spec)
    tok = llm.get_tokenizer()
    words = tok.encode("The driver owns every request: it schedules a step, builds its plan, hands it to the "
                       "stages, then applies the result, appending each request's new tokens.")
    print(f"{'batch':>5s} " + " ".join(f"{f:>10s}" for f in FEATURES) + "   tokens/s (ratio to plain)", flush=True)
    for batch in args.batch:
        prompts = [{"prompt_token_ids": [1000 + i] + words} for i in range(batch)]
        rates = {f: [] for f in FEATURES}
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        for _ in range(args.repeats):
            for name, extra in FEATURES.items():
                params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True, **extra)
                t0 = time.perf_counter()
                llm.generate(prompts, params, use_tqdm=False)
                rates[name].append(batch * args.new_tokens / (time.perf_counter() - t0))
        med = {f: statistics.median(r) for f, r in rates.items()}
        print(f"{batch:5d} " + " ".join(f"{med[f]:10.1f}" for f in FEATURES) + "   "
              + " ".join(f"{f}={med[f] / med['plain']:.3f}" for f in FEATURES if f != "plain"), flush=True)
    llm.shutdown()


if __name__ == "__main__":
    main()
