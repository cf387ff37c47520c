"""What structured output costs in decode tokens/s, and what it does to MTP's acceptance: every request
of a batch constrained by a JSON schema or a regex against plain requests, on the default model, greedy,
the same prompts; configurations alternate within each repeat so drift hits all of them; medians.

A constrained request ends when its grammar is complete, so each configuration is timed over the
tokens it generated (wall time of the whole `generate`, prefill included). The regex admits long
outputs (lower-case words), so its requests run to max_tokens as plain ones do: its ratio is the
cost of the masks alone (driver-side mask computation, the plan's bitmasks, the last stage's fill).

    python benchmarks/structured_output.py --device cuda --batch 1 64 --k 0 2
    python benchmarks/structured_output.py --device cpu --batch 1 16 --k 0 2 --new-tokens 48
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "skills", "bio"],
          "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"},
                         "skills": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 6},
                         "bio": {"type": "string", "maxLength": 400}}}
CONFIGS = {"plain": None, "regex": {"regex": "[a-z]+( [a-z]+)*"}, "json_schema": {"json": SCHEMA}}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--k", type=int, nargs="+", default=[0, 2], help="MTP draft tokens (0: no speculation)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    import torch
    from pipespec import LLM, SamplingParams, StructuredOutputsParams

    def sync():
        if args.device == "cuda":
            torch.cuda.synchronize()

    kw = dict(device=args.device, max_num_seqs=max(args.batch), enable_prefix_caching=False)
    kw.update(gpu_memory_utilization=0.15) if args.device == "cuda" else kw.update(dtype="float32", max_model_len=1024)
    for k in args.k:
        spec = {"method": "mtp", "num_speculative_tokens": k} if k else None
        with LLM(speculative_config=spec, **kw) as llm:
            tok = llm.get_tokenizer()
            prompt = tok.encode(tok.apply_chat_template(
                [{"role": "user", "content": "Describe a senior programmer as JSON with a long bio."}]),
                add_special_tokens=False)
            for batch in args.batch:
                prompts = [{"prompt_token_ids": prompt}] * batch
                rates = {c: [] for c in CONFIGS}
                accept = {c: [] for c in CONFIGS}
                for rep in range(args.repeats + 1):              # the first round warms up (and compiles)
                    for name, so in CONFIGS.items():
                        p = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=so is None,
                                           structured_outputs=StructuredOutputsParams(**so) if so else None)
                        before = dict(llm.stats().get("spec_decode", {}))
                        sync()
                        t = time.perf_counter()
                        outs = llm.generate(prompts, p, use_tqdm=False)
                        sync()
                        secs = time.perf_counter() - t
                        after = llm.stats().get("spec_decode", {})
                        if rep:
                            rates[name].append(sum(len(o.outputs[0].token_ids) for o in outs) / secs)
                            drafts = after.get("num_drafts", 0) - before.get("num_drafts", 0)
                            if drafts:
                                accept[name].append(1 + (after["num_accepted_tokens"]
                                                         - before.get("num_accepted_tokens", 0)) / drafts)
                med = {c: statistics.median(v) for c, v in rates.items()}
                row = {"device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu", "k": k,
                       "batch": batch, "tokens_per_s": {c: round(v, 1) for c, v in med.items()},
                       "vs_plain": {c: round(med[c] / med["plain"], 3) for c in CONFIGS if c != "plain"},
                       "acceptance_length": {c: round(statistics.median(v), 3) for c, v in accept.items() if v},
                       "tokens_per_request": {c: len(outs[0].outputs[0].token_ids) for c in ["json_schema"]}}
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
