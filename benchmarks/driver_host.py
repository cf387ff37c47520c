"""The driver's host time a step: scheduling (the plan built), completing the batch, and applying
its result (tokens appended, detokenized, stop checks, outputs), by batch size, prompt length and K.

Why it matters on a GPU: with async scheduling the driver's work for step n + 1 runs while the device
runs step n, so a step costs at least the driver's time. SmolLM2's device step at batch 64 is ~1-2 ms
on an H200 (RESULTS.md), the same order as this Python code's time at that batch size. The code is
the same on every device, so it is measured here on the CPU: the stage runs a small dummy model with
the default model's tokenizer (its time is printed as `stage`, not the point), and each figure is the
median over runs of a phase's time summed over a run's steps, divided by the steps.

`--prefix-caching on off` measures the engine with the prefix cache on and off (the default: the
engine's default); the cache is reset before each run and every prompt starts with its own token, so
the figures are the cache's bookkeeping with no hits (registering blocks, looking prompts up).

`--features plain logprobs penalties` measures requests asking for sampling features (top-5 logprobs;
repetition, presence and frequency penalties with a logit_bias), each against plain greedy requests.

`--clock cpu` times the driver thread's CPU time instead of elapsed time: on a shared, loaded machine
elapsed time also counts the time other processes held the core.

`--base PATH` measures another source tree (a `git worktree` of an older commit) in the same call,
each run in a fresh process, the two trees alternating, so a ratio compares like with like.

    python benchmarks/driver_host.py                                   # batch 1 64 256, prompts 32 / 1024, K 0 / 2
    python benchmarks/driver_host.py --batch 64 --prompt-len 32 --k 0 --new-tokens 2048 --stream   # as the server
    git worktree add /tmp/base HEAD~3 && python benchmarks/driver_host.py --base /tmp/base
"""
from __future__ import annotations

import argparse
import collections
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PHASES = ("schedule", "complete", "apply")
FEATURES = {"plain": {}, "logprobs": {"logprobs": 5},
            "penalties": {"repetition_penalty": 1.1, "presence_penalty": 0.5, "frequency_penalty": 0.5,
                          "logit_bias": {13: 1.0}}}
TEXT = """The driver owns every request: it schedules a step, builds its plan, hands it to the stages,
then applies the result, appending each request's new tokens, turning them into text and checking
whether a stop string, an end token or a length limit ends it, before the next step is planned."""


def small_model(folder: Path) -> tuple[Path, Path]:
    """A one-layer, 64-wide Llama with the default model's tokenizer and vocabulary (random weights,
    load_format dummy), and a random MTP head file for it: the driver's work is the same as at any
    width, the stage's is small. Returns (model folder, head file)."""
    import torch
    from pipespec.model.mtp.deepseek import DeepSeekMTP
    from pipespec.model.mtp.files import save_mtp
    from pipespec.checkpoint.source import resolve_model
    tok = resolve_model(None, torch.float32).tokenizer()
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152,
              "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
              "max_position_embeddings": 32768, "tie_word_embeddings": True, "torch_dtype": "float32",
              "hidden_act": "silu"}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    tok.save_json(folder / "tokenizer.json")
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": tok.eos_token, "bos_token": tok.bos_token, "chat_template": tok.chat_template}))
    head = DeepSeekMTP(resolve_model(folder).arch)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.ones_like(p) if p.dim() == 1 else 0.05 * torch.randn_like(p))
    save_mtp(folder / "head.safetensors", head, base_model="driver_host.py's small model")
    return folder, folder / "head.safetensors"


def child(args) -> None:
    """One run set in this process: per-step phase times of the tree on sys.path."""
    import torch
    import pipespec
    from pipespec import LLM, SamplingParams
    assert Path(pipespec.__file__).resolve().is_relative_to(Path.cwd().resolve()), pipespec.__file__
    torch.set_num_threads(1)
    spec = None if not args.k else {"method": "mtp", "num_speculative_tokens": args.k,
                                    "model": args.head}
    caching = {} if args.prefix_caching == "default" else {"enable_prefix_caching": args.prefix_caching == "on"}
    llm = LLM(model=args.model, load_format="dummy", max_num_seqs=args.batch, speculative_config=spec,
              max_model_len=args.prompt_len + args.new_tokens + 64,
              num_kv_blocks=args.batch * ((args.prompt_len + args.new_tokens) // 16 + 8), **caching)
    eng = llm.engine
    spent = collections.Counter()
    # cpu: the driver thread's CPU time, which leaves out the time other processes held the core
    # (a shared machine); wall: elapsed time
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter

    def timed(owner, name, phase):
        fn = getattr(owner, name)

        def wrapper(*a, **kw):
            t0 = clock()
            try:
                return fn(*a, **kw)
            finally:
                spent[phase] += clock() - t0
        setattr(owner, name, wrapper)

    timed(eng.scheduler, "schedule", "schedule")
    timed(eng.scheduler, "complete", "complete")
    timed(eng, "_apply", "apply")
    timed(eng.executor, "submit", "stage")
    # prompts of English words: the dummy model repeats a prompt's last token, so each request then
    # generates a word again and again, which detokenizes like text (a byte token would not)
    words = llm.get_tokenizer().encode(" ".join(TEXT.split() * (1 + args.prompt_len // 64)))
    # (each starting with a token of its own: no two share a prefix cache block)
    prompts = [{"prompt_token_ids": [1000 + i] + words[i % 50 + 1:i % 50 + args.prompt_len]} for i in range(args.batch)]
    extra = FEATURES[args.features]
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True, **extra)
    if args.stream:       # as the server: deltas where the tree has them (a tree before them: cumulative)
        if hasattr(pipespec, "RequestOutputKind"):
            params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True,
                                    output_kind=pipespec.RequestOutputKind.DELTA, **extra)

        def run():
            for prompt in prompts:
                eng.add_request(f"stream-{next(ids)}", prompt, params)
            while eng.has_unfinished_requests():
                for out in eng.step():
                    assert out.outputs[0].token_ids      # (every output is read, as a server reads it)
    else:
        def run():
            llm.generate(prompts, params, use_tqdm=False)
    ids = itertools.count()
    run()                                                  # warm-up
    runs = collections.defaultdict(list)
    for _ in range(args.runs):
        if hasattr(llm, "reset_prefix_cache"):
            assert llm.reset_prefix_cache()                  # no hits from an earlier run
        spent.clear()
        steps0 = eng.scheduler._step_id
        run()
        steps = eng.scheduler._step_id - steps0
        for phase in (*PHASES, "stage"):
            runs[phase].append(1e6 * spent[phase] / steps)
        runs["driver"].append(1e6 * sum(spent[p] for p in PHASES) / steps)
    hits = llm.stats().get("prefix_cache", {}).get("hits", 0)
    assert hits == 0, f"{hits} prefix cache hits: the prompts share blocks"
    llm.shutdown()
    print(json.dumps({k: statistics.median(v) for k, v in runs.items()}))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--prompt-len", type=int, nargs="+", default=[32, 1024])
    ap.add_argument("--k", type=int, nargs="+", default=[0, 2])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3, help="timed runs a process (after one warm-up)")
    ap.add_argument("--repeats", type=int, default=1, help="processes a tree and configuration (median)")
    ap.add_argument("--stream", action="store_true",
                    help="drive engine.step() and read every output, as the server does (default: generate)")
    ap.add_argument("--prefix-caching", nargs="+", default=["default"], choices=["default", "on", "off"],
                    help="the engine's prefix cache in each configuration (default: the engine's default)")
    ap.add_argument("--features", nargs="+", default=["plain"], choices=list(FEATURES),
                    help="sampling features every request asks for, in each configuration")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="elapsed time, or the driver thread's CPU time (steadier on a loaded machine)")
    ap.add_argument("--base", type=Path, help="another source tree to measure in the same call")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--head", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        args.batch, args.prompt_len, args.k = args.batch[0], args.prompt_len[0], args.k[0]
        args.prefix_caching, args.features = args.prefix_caching[0], args.features[0]
        return child(args)
    trees = {"tree": HERE.parent} | ({"base": args.base.resolve()} if args.base else {})
    with tempfile.TemporaryDirectory() as tmp:
        model, head = small_model(Path(tmp) / "model")
        print(f"{'features':>9s} {'tree':5s} {'cache':>7s} {'batch':>5s} {'prompt':>6s} {'K':>2s} | "
              + " ".join(f"{p:>9s}" for p in PHASES) + f" {'driver':>9s} {'stage':>9s}   us a step", flush=True)
        for batch, prompt_len, k, cache, features in itertools.product(args.batch, args.prompt_len, args.k,
                                                                       args.prefix_caching, args.features):
            figures = collections.defaultdict(list)
            for _ in range(args.repeats):
                for name, root in trees.items():       # alternating: drift hits both
                    cmd = [sys.executable, str(HERE / "driver_host.py"), "--child", "--model", str(model),
                           "--head", str(head), "--batch", str(batch), "--prompt-len", str(prompt_len),
                           "--k", str(k), "--new-tokens", str(args.new_tokens), "--runs", str(args.runs),
                           "--prefix-caching", cache, "--features", features, "--clock", args.clock]
                    out = subprocess.run(cmd + ["--stream"] * args.stream, env=dict(os.environ, PYTHONPATH=str(root)),
                                         check=True, capture_output=True, text=True, cwd=root, timeout=3600)
                    figures[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
            for name, runs in figures.items():
                med = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
                print(f"{features:>9s} {name:5s} {cache:>7s} {batch:5d} {prompt_len:6d} {k:2d} | "
                      + " ".join(f"{med[p]:9.1f}" for p in PHASES)
                      + f" {med['driver']:9.1f} {med['stage']:9.1f}", flush=True)


if __name__ == "__main__":
    main()
