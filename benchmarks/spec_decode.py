"""MTP speculative decoding vs none, same run: tokens/s and mean acceptance length.

SmolLM2-135M-Instruct with its bundled head, greedy chat answers to held-out-style prompts, or
(`--prompts heldout`) to the trainer's held-out split: subjects no training prompt mentions (issue
17's acceptance goal is measured there); `--prompts kinds` to its held-out kinds of request, and
`--prompts everyday` to eval-mtp's everyday requests (issue 49's goals are on prompts of any kind).
Usage: python benchmarks/spec_decode.py [--device cpu|cuda] [--pp 1 2] [--batch 1 8] [--k 1 2 3]
       [--max-tokens 64] [--repeats 3] [--dtype auto] [--prompts bench|heldout|kinds|everyday] [--stop-at-eos]
       [--rounds 1]
       [--draft-vocab FILE|full] [--draft-vocab-size N]
`--rounds R` runs R batches of distinct prompts in turn in each timed run (at batch 1: R prompts, one
at a time), so a batch-1 figure is not one prompt's.
Each cell is the median over --repeats; configurations are interleaved per repeat so drift hits all.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from pipespec import LLM, SamplingParams
from pipespec.train.recipe import PROMPT_SETS

PROMPTS = ["Write a short poem about autumn leaves.", "Explain how a bicycle gear works.",
           "Give three tips for a job interview.", "What is the difference between a list and a tuple in Python?",
           "Describe a sunrise over the mountains.", "How do vaccines train the immune system?",
           "Write a haiku about coffee.", "Summarize the plot of a heist movie you invent.",
           "Why is the sky blue?", "Suggest a weekend plan for a rainy day.",
           "How does a hash map work?", "Write a limerick about a cat.",
           "What are the benefits of walking every day?", "Explain recursion to a child.",
           "List the planets of the solar system.", "How do I make a good cup of tea?"]


def print_table(rows: list[dict], columns: dict) -> None:
    """`rows` as a markdown table; `columns`: header -> the cell of a row (a function of it)."""
    print("\n| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for r in rows:
        print("| " + " | ".join(str(cell(r)) for cell in columns.values()) + " |")


def print_profile(llm: LLM, prompts, params: SamplingParams, title: str, sorts: dict[str, int]) -> None:
    """Profile one `generate` on the host and the device; print a table per sort key (-> its rows)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, params, use_tqdm=False)
    events = prof.key_averages()
    print(f"--- {title}: {params.max_tokens} tokens")
    for key, rows in sorts.items():
        print(events.table(sort_by=key, row_limit=rows, max_name_column_width=70))


def chat_ids(tok, prompts: list[str] = PROMPTS) -> list[list[int]]:
    """`prompts` as user turns in the model's chat template, token ids (the template adds its own
    special tokens)."""
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]), add_special_tokens=False)
            for p in prompts]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--pp", type=int, nargs="+", default=[1])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--k", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--prompts", choices=("bench", *PROMPT_SETS), default="bench",
                    help="this file's prompts, the trainer's held-out split (pipespec.train.prompts), its held-out "
                         "kinds of request (request_kinds.py), or eval-mtp's everyday requests")
    ap.add_argument("--stop-at-eos", action="store_true",
                    help="answers end at EOS (tokens/s counts the tokens generated) instead of max-tokens each")
    ap.add_argument("--draft-vocab", default=None,
                    help="speculative_config.draft_vocab of every speculative engine (default: the head's own "
                         "list; 'full': every token)")
    ap.add_argument("--draft-vocab-size", type=int, default=None,
                    help="speculative_config.draft_vocab_size of every speculative engine (default: none)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="batches of distinct prompts run in turn in each timed run (default 1)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    for pp in args.pp:
        share = {"gpu_memory_utilization": 0.2} if args.device.startswith("cuda") else {}
        engines = {k: LLM(device=args.device, dtype=args.dtype, pipeline_parallel_size=pp, max_num_seqs=64, **share,
                          speculative_config={"method": "mtp", "num_speculative_tokens": k,
                                              "draft_vocab": args.draft_vocab,
                                              "draft_vocab_size": args.draft_vocab_size} if k else None)
                   for k in [0] + args.k}
        tok = engines[0].get_tokenizer()
        chats = chat_ids(tok, PROMPTS if args.prompts == "bench" else PROMPT_SETS[args.prompts][0]())
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=not args.stop_at_eos)
        for batch in args.batch:
            rounds = [[{"prompt_token_ids": chats[(r * batch + i) % len(chats)]} for i in range(batch)]
                      for r in range(args.rounds)]
            for llm in engines.values():
                llm.generate(rounds[0][:1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
            speed = {k: [] for k in engines}
            accept = {}
            for _ in range(args.repeats):
                for k, llm in engines.items():
                    before = dict(llm.stats().get("spec_decode", {}))
                    if args.device.startswith("cuda"):
                        torch.cuda.synchronize()
                    t = time.perf_counter()
                    outs = [o for prompts in rounds for o in llm.generate(prompts, params, use_tqdm=False)]
                    if args.device.startswith("cuda"):
                        torch.cuda.synchronize()
                    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
                    speed[k].append(tokens / (time.perf_counter() - t))
                    after = llm.stats().get("spec_decode")
                    if after:
                        drafts = after["num_drafts"] - before.get("num_drafts", 0)
                        acc = after["num_accepted_tokens"] - before.get("num_accepted_tokens", 0)
                        accept.setdefault(k, []).append(1 + acc / max(drafts, 1))
            base = statistics.median(speed[0])
            for k in engines:
                med = statistics.median(speed[k])
                rows.append({"pp": pp, "batch": batch, "k": k, "tokens_per_s": round(med, 1),
                             "speedup": round(med / base, 2),
                             "mean_acceptance_length": round(statistics.median(accept[k]), 2) if k else 1.0})
                print(json.dumps(rows[-1]), flush=True)
        for llm in engines.values():
            llm.shutdown()
    dev = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else f"{platform.machine()} cpu"
    print(json.dumps({"date": time.strftime("%Y-%m-%d"), "device": dev, "torch": torch.__version__,
                      "max_tokens": args.max_tokens, "repeats": args.repeats,
                      "prompts": args.prompts, "stop_at_eos": args.stop_at_eos, "rounds": args.rounds,
                      "draft_vocab": args.draft_vocab, "draft_vocab_size": args.draft_vocab_size, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
