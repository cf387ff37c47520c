"""`pipespec train-mtp` and `pipespec eval-mtp`: data, target, training, evaluation, files."""
from __future__ import annotations

import dataclasses
import json
import logging
import sys
import time
from pathlib import Path

import torch

from pipespec.model.llama import LlamaForCausalLM
from pipespec.model.mtp import DeepSeekMTP, load_mtp_file, read_mtp_metadata, save_mtp
from pipespec.model.placement import resolve_device, resolve_dtype
from pipespec.model.source import resolve_model
from pipespec.model.weights import load_weights
from pipespec.train.data import Batcher, Sample, load_samples, plain_text_samples, save_samples, self_generate
from pipespec.train.evaluate import agreement, as_dict, format_table
from pipespec.train.prompts import chat_prompts
from pipespec.train.loop import TrainConfig, train

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_target(source, device, dtype) -> LlamaForCausalLM:
    target = LlamaForCausalLM(source.arch)
    load_weights(target, source.weights(), dtype, device, desc="Loading target")
    return target.eval().requires_grad_(False)


def _engine(model, arch, device: torch.device, round_size: int, max_tokens: int):
    from pipespec import LLM

    max_len = 128 + max_tokens + 64
    kwargs = dict(model=model, device=str(device), max_model_len=max_len, max_num_seqs=round_size,
                  max_num_batched_tokens=max(4096, min(32768, 64 * round_size)))
    if device.type == "cuda":   # room for a whole round at full length, not the whole card
        per_token = 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * 2
        kwargs["kv_cache_memory"] = 2 * round_size * max_len * per_token + (256 << 20)
    return LLM(**kwargs)


def generate_heldout(model, arch, device, count: int, max_tokens: int, round_size: int) -> list[Sample]:
    llm = _engine(model, arch, device, min(round_size, count), max_tokens)
    try:
        return self_generate(llm, chat_prompts("heldout")[:count], max_tokens, 0.0, round_size)
    finally:
        llm.shutdown()


def build_data(args, source, device) -> dict[str, list[Sample]]:
    t0 = time.perf_counter()
    prompts = chat_prompts("train")[:args.gen_prompts]
    temps = [float(x) for x in args.gen_temperatures.split(",") if x.strip()]
    llm = _engine(args.model, source.arch, device, args.gen_batch, args.gen_max_tokens)
    chat: list[Sample] = []
    heldout: list[Sample] = []
    timing: dict = {}
    try:
        # held-out answers first: they are needed whatever the time budget leaves for training data
        heldout = self_generate(llm, chat_prompts("heldout")[:args.heldout_prompts], args.gen_max_tokens,
                                0.0, args.gen_batch)
        for temp in temps:
            left = None if args.gen_time is None else args.gen_time - (time.perf_counter() - t0)
            if left is not None and left <= 0:
                break
            chat += self_generate(llm, prompts, args.gen_max_tokens, temp, args.gen_batch, left, timing)
    finally:
        llm.shutdown()
    text = []
    if args.text_tokens > 0:
        text = plain_text_samples(source.tokenizer(), args.text_tokens, args.seq_len, args.seed)
    logger.info("data: %d chat samples (%d tokens), %d text windows (%d tokens), %d held-out samples, in %.0f s",
                len(chat), sum(len(s.ids) for s in chat), len(text), sum(len(s.ids) for s in text),
                len(heldout), time.perf_counter() - t0)
    return {"chat": chat, "text": text, "heldout": heldout}


def _save_data(path: Path, data: dict[str, list[Sample]]) -> None:
    path.write_text(json.dumps({k: [{"ids": list(s.ids), "start": s.start} for s in v] for k, v in data.items()}))


def _load_data(path: Path) -> dict[str, list[Sample]]:
    raw = json.loads(path.read_text())
    return {k: [Sample(tuple(d["ids"]), d["start"]) for d in v] for k, v in raw.items()}


def train_command(args) -> int:
    t_start = time.perf_counter()
    out = Path(args.out)
    device = resolve_device(args.device)
    train_dtype = resolve_dtype("auto", device)
    eval_dtype = _DTYPES[args.eval_dtype]
    source = resolve_model(args.model)
    cache = Path(args.data_cache or f"{out}.data.json")
    if cache.exists():
        data = _load_data(cache)
        logger.info("read the training data from %s", cache)
    else:
        data = build_data(args, source, device)
        cache.parent.mkdir(parents=True, exist_ok=True)
        _save_data(cache, data)
    t_data = time.perf_counter() - t_start
    if args.gen_only:
        print(f"wrote the training data to {cache} in {t_data:.0f} s; train with --data-cache {cache}")
        return 0

    torch.manual_seed(args.seed)
    target = load_target(source, device, train_dtype)
    mtp = DeepSeekMTP(source.arch)
    if not args.no_init_from_last_layer:
        mtp.init_from_target(target)
    mtp.to(device=device, dtype=torch.float32)
    cfg = TrainConfig(num_steps=args.steps, tokens=args.tokens, batch_size=args.batch_size, seq_len=args.seq_len,
                      lr=args.lr, warmup=args.warmup, step_weight=args.step_weight, seed=args.seed,
                      max_time=args.max_time, log_every=args.log_every,
                      checkpoint=args.checkpoint or f"{out}.ckpt", checkpoint_every=args.checkpoint_every,
                      eval_every=args.eval_every, weight_decay=args.weight_decay)
    pad = (source.tokenizer().eos_token_id or 0)
    batcher = Batcher(data["chat"], data["text"], cfg.batch_size, cfg.seq_len, args.text_fraction, args.seed, pad)
    out_dtype = _DTYPES[args.out_dtype]
    info = {"command": " ".join(["pipespec"] + sys.argv[1:]) if sys.argv else "",
            "chat_samples": len(data["chat"]), "chat_tokens": sum(len(s.ids) for s in data["chat"]),
            "text_samples": len(data["text"]), "text_tokens": sum(len(s.ids) for s in data["text"]),
            "heldout_samples": len(data["heldout"]), "config": dataclasses.asdict(cfg),
            "init": "random" if args.no_init_from_last_layer else "target last layer"}

    def write_head(step: int) -> None:
        save_mtp(out, mtp, source.name, out_dtype, {"pipespec.train": dict(info, steps_done=step)})

    curve = []

    def evaluate(step: int) -> None:
        result = agreement(mtp, target, data["heldout"][:64], cfg.num_steps, device)
        curve.append({"step": step, "agreement": [round(r.rate, 4) for r in result]})
        logger.info("step %d held-out agreement (64 answers, %s): %s", step, train_dtype,
                    " ".join(f"{100 * r.rate:.1f}%" for r in result))

    summary = train(mtp, target, batcher, cfg, device, resume=args.resume, on_checkpoint=write_head,
                    evaluate=evaluate if args.eval_every and data["heldout"] else None)
    info["heldout_curve"] = curve
    info.update(summary, data_seconds=round(t_data, 1))
    write_head(summary["steps"])
    del target, mtp
    if device.type == "cuda":
        torch.cuda.empty_cache()

    # evaluate the file as written (out_dtype weights), in eval_dtype
    target = load_target(source, device, eval_dtype)
    head, _ = load_mtp_file(out, source.arch, eval_dtype, device)
    heldout = agreement(head, target, data["heldout"], cfg.num_steps, device)
    seen = agreement(head, target, data["chat"][:len(data["heldout"])], cfg.num_steps, device)
    extra = {"pipespec.train": info, "pipespec.eval_heldout": as_dict(heldout),
             "pipespec.eval_train_sample": as_dict(seen), "pipespec.num_spec_steps": cfg.num_steps}
    if args.check_set:
        check = [Sample(s.ids[:args.check_len], s.start) for s in data["heldout"][:args.check_size]]
        save_samples(args.check_set, check)
        extra["pipespec.eval_check"] = as_dict(agreement(head, target, check, cfg.num_steps, device))
    save_mtp(out, head, source.name, out_dtype, extra)
    print(f"\nheld-out ({len(data['heldout'])} self-generated answers to unseen prompts):")
    print(format_table(heldout))
    print(f"\ntraining answers (first {len(data['heldout'])}, for the generalization gap):")
    print(format_table(seen))
    if args.check_set:
        print(f"\ncheck set ({args.check_set}): {extra['pipespec.eval_check']}")
    print(f"\nwrote {out} in {time.perf_counter() - t_start:.0f} s "
          f"(data {t_data:.0f} s, training {summary['seconds']:.0f} s, {summary['tokens']} tokens)")
    return 0


def eval_command(args) -> int:
    from pipespec.heads import bundled_head_path

    device = resolve_device(args.device)
    dtype = _DTYPES[args.dtype]
    head_path = args.head or bundled_head_path(args.model)
    if head_path is None:
        raise ValueError("no MTP head is bundled for this model; pass --head (train one with pipespec train-mtp)")
    meta = read_mtp_metadata(head_path)
    steps = args.steps or int(meta.get("pipespec.num_spec_steps", 3))
    source = resolve_model(args.model)
    if args.data:
        samples = load_samples(args.data)
    else:
        samples = generate_heldout(args.model, source.arch, device, args.prompts, args.max_tokens, args.gen_batch)
    target = load_target(source, device, dtype)
    head, _ = load_mtp_file(head_path, source.arch, dtype, device)
    results = agreement(head, target, samples, steps, device, args.batch_size)
    print(f"head {head_path} on {source.name}: {len(samples)} samples, teacher-forced, {args.dtype}")
    print(format_table(results))
    return 0
