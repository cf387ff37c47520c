"""Command-line arguments of `pipespec train-mtp` and `pipespec eval-mtp` (no heavy imports)."""
from __future__ import annotations

import argparse

from pipespec.train.budget import HELDOUT_SHARE

DTYPES = ("float32", "bfloat16", "float16")


def add_train_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="target: HF folder or GGUF file (default: SmolLM2-135M-Instruct)")
    p.add_argument("--out", required=True, help="the head file to write (.safetensors)")
    p.add_argument("--device", default="auto")
    p.add_argument("--tokens", type=int, default=20_000_000, help="training tokens")
    p.add_argument("--steps", type=int, default=3, help="K: chained MTP steps to train")
    p.add_argument("--seed", type=int, default=0)
    t = p.add_argument_group("training")
    t.add_argument("--batch-size", type=int, default=None,
                   help="sequences a step (default: 48 on an accelerator; on a CPU, sized to --max-time so that it "
                        "holds a few dozen steps, 2-8 x 128 tokens)")
    t.add_argument("--seq-len", type=int, default=None, help="tokens a sequence (default: 320; 128 on a CPU)")
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--warmup", type=int, default=None,
                   help="warm-up steps (default: 10%% of the steps the run is expected to take, at most 50)")
    t.add_argument("--step-weight", type=float, default=0.8, help="loss weight ratio of step k+1 to step k")
    t.add_argument("--max-time", type=float, default=None,
                   help="seconds of training at most (the loop; loading and the final evaluation come on top); "
                        "default: until --tokens")
    t.add_argument("--weight-decay", type=float, default=0.0)
    t.add_argument("--log-every", type=int, default=50)
    t.add_argument("--log-interval", type=float, default=30.0,
                   help="seconds: when stderr is no terminal (no progress bar), log progress at least this often "
                        "(0: only every --log-every steps)")
    t.add_argument("--eval-every", type=int, default=0,
                   help="log the agreement on 64 held-out answers every N steps (0: only at the end)")
    t.add_argument("--checkpoint", default=None, help="resumable state (default: OUT.ckpt)")
    t.add_argument("--checkpoint-every", type=int, default=500)
    t.add_argument("--resume", action="store_true", help="continue from --checkpoint if it exists")
    t.add_argument("--no-init-from-last-layer", action="store_true",
                   help="start the block from random weights instead of the target's last layer")
    t.add_argument("--init-head", default=None, metavar="FILE",
                   help="start from this head file's weights (one `train-mtp` wrote, e.g. the bundled head: "
                        "'bundled'), to train it further on new data; its width is the file's")
    t.add_argument("--block-intermediate", type=int, default=None,
                   help="the head block's MLP width (default: the target's); wider starts from the target's "
                        "last layer in its first columns")
    t.add_argument("--out-dtype", default="bfloat16", choices=DTYPES)
    t.add_argument("--draft-vocab", type=int, default=0,
                   help="also write a draft vocabulary into the head file: the N tokens most frequent in the "
                        "training answers (the engine drafts over them with speculative_config.draft_vocab_size)")
    d = p.add_argument_group("data")
    d.add_argument("--data-cache", default=None,
                   help="samples file: read if it exists, else written after generation (default: OUT.data.json; "
                        "a name ending in .gz is gzipped)")
    d.add_argument("--gen-only", action="store_true",
                   help="generate the data into --data-cache and stop (train in a later run)")
    d.add_argument("--gen-prompts", type=int, default=None, help="training prompts to answer (default: all)")
    d.add_argument("--vocab-prompts", type=int, default=0,
                   help="more training prompts, on words of the target's vocabulary (a topic template each; "
                        "no held-out subject's word), mixed in with the others")
    d.add_argument("--kind-prompts", type=int, default=0,
                   help="more training prompts: requests of several dozen kinds (poems, recipes, emails, code, plans, "
                        "...; request_kinds.py) about the training subjects, mixed in with the others")
    d.add_argument("--written-prompts", type=int, default=0,
                   help="more training prompts the target writes itself: it continues N lists of requests, and the "
                        "lines that read as a request are answered with the others")
    d.add_argument("--follow-ups", type=int, default=0,
                   help="N of the training prompts get a second user turn (\"Can you make it shorter?\", ...) after "
                        "their greedy answer, whose answer is trained on too (multi-turn answers)")
    d.add_argument("--gen-temperatures", default="0.0,0.7",
                   help="one pass over the prompts per temperature, in order, while time remains")
    d.add_argument("--gen-max-tokens", type=int, default=256)
    d.add_argument("--gen-batch", type=int, default=None, help="answers generated at once (default: 256; 8 on a CPU)")
    d.add_argument("--gen-time", type=float, default=None,
                   help="seconds of all generation at most, a hard bound (answers under way are cut): the "
                        f"held-out answers get the first {round(100 * HELDOUT_SHARE)}%%, the training answers the rest; 0: none "
                        "(text windows only, nothing measured); default: unbounded")
    d.add_argument("--text-tokens", type=int, default=None,
                   help="plain text/code tokens from the Python installation (0: none; default: 2,000,000, on a CPU "
                        "with --max-time 10x what the budget can train on)")
    d.add_argument("--text-fraction", type=float, default=0.25)
    e = p.add_argument_group("evaluation")
    e.add_argument("--heldout-prompts", type=int, default=128,
                   help="held-out answers: prompts about subjects no training prompt mentions")
    e.add_argument("--heldout-kind-prompts", type=int, default=None,
                   help="held-out answers of kinds of request no training prompt is of (default: as many as "
                        "--heldout-prompts when --kind-prompts or --written-prompts is set, else none)")
    e.add_argument("--eval-dtype", default="float32", choices=DTYPES)
    e.add_argument("--check-set", default=None,
                   help="write a small held-out set here, and record the head's agreement on it")
    e.add_argument("--check-size", type=int, default=12)
    e.add_argument("--check-len", type=int, default=160)


def add_eval_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="target: HF folder or GGUF file (default: SmolLM2-135M-Instruct)")
    p.add_argument("--head", default=None, help="head file (default: the head bundled for the model)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="float32", choices=DTYPES)
    p.add_argument("--steps", type=int, default=None, help="K (default: what the head was trained for)")
    p.add_argument("--data", default=None,
                   help="samples file to evaluate on instead of generating, or a train-mtp data cache (its "
                        "held-out answers)")
    p.add_argument("--prompts", type=int, default=64, help="held-out prompts to answer (greedy)")
    p.add_argument("--prompt-set", choices=("heldout", "kinds", "everyday"), default="heldout",
                   help="which prompts: the trainer's held-out split (subjects no training prompt mentions; with "
                        "--data, the cache's held-out answers), its held-out kinds of request (with --data, the "
                        "cache's answers to them), or everyday requests written apart from the trainer (poems, "
                        "recipes, emails, code, plans, ...)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--gen-batch", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--draft-vocab", default=None, metavar="FILE",
                   help="draft over this file's draft vocabulary (`pipespec draft-vocab`), as the engine does with "
                        "speculative_config.draft_vocab")
    p.add_argument("--draft-vocab-size", type=int, default=None,
                   help="draft over the first N tokens of the draft vocabulary (--draft-vocab's, else the head "
                        "file's), as the engine does with speculative_config.draft_vocab_size")


def add_draft_vocab_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", required=True,
                   help="a train-mtp data cache (`train-mtp --gen-only`): its answers are counted")
    p.add_argument("--size", type=int, required=True, help="how many tokens (most frequent first)")
    p.add_argument("--out", required=True, help="the file to write (.safetensors)")
    p.add_argument("--model", default=None, help="the model the answers came from (its vocabulary size; default: "
                                                  "SmolLM2-135M-Instruct)")
