"""`pipespec train-mtp` and `pipespec eval-mtp`: data, target, training, evaluation, files."""
from __future__ import annotations

import dataclasses
import json
import logging
import random
import sys
import time
from pathlib import Path

import torch

from pipespec.checkpoint.source import resolve_model
from pipespec.heads import bundled_head_path
from pipespec.model.llama import LlamaForCausalLM
from pipespec.model.mtp import DeepSeekMTP, load_mtp_file, read_mtp_metadata, save_mtp
from pipespec.model.weights import load_weights
from pipespec.placement import resolve_device, resolve_dtype
from pipespec.speculative.draft_vocab import DRAFT_VOCAB_TENSOR, DraftVocab, write_draft_vocab
from pipespec.train.budget import GenBudget, plan_text
from pipespec.train.progress import Heartbeat, peak_rss_bytes
from pipespec.train.sizing import (CPU_GEN_STEP_TOKENS, StepSize, default_gen_batch, default_step, default_text_tokens,
                                   eval_batch_tokens, expected_memory_bytes)
from pipespec.train.data import (Batcher, Sample, load_data, load_samples, most_frequent_tokens, plain_text_samples,
                                 save_data, save_samples, self_generate, two_turn_samples, written_requests)
from pipespec.train.evaluate import agreement, agreements, as_dict, report
from pipespec.train.prompts import chat_prompts, everyday_prompts, vocabulary_prompts
from pipespec.train.request_kinds import kind_prompts
from pipespec.train.loop import TrainConfig, train
from pipespec.train.payoff import draft_cost_ratio, payoff

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
EVAL_LOG_INTERVAL = 30.0        # seconds: eval-mtp's heartbeat without a terminal


def load_teacher(source, device, dtype) -> LlamaForCausalLM:
    target = LlamaForCausalLM(source.arch)
    load_weights(target, source.weights(), dtype, device, desc="Loading target")
    return target.eval().requires_grad_(False)


def _engine(model, arch, device: torch.device, round_size: int, max_tokens: int, turns: int = 1):
    from pipespec import LLM

    # a prompt of up to 128 tokens and its answer a turn (a second turn's prompt holds the first's answer)
    max_len = turns * (128 + max_tokens) + 64
    # on a CPU an engine step of thousands of prompt tokens takes tens of seconds, and a deadline is
    # only checked between steps
    step_tokens = CPU_GEN_STEP_TOKENS if device.type == "cpu" else max(4096, min(32768, 64 * round_size))
    kwargs = dict(model=model, device=str(device), max_model_len=max_len, max_num_seqs=round_size,
                  max_num_batched_tokens=step_tokens)
    if device.type == "cuda":   # room for a whole round at full length, not the whole card
        per_token = 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * 2
        kwargs["kv_cache_memory"] = 2 * round_size * max_len * per_token + (256 << 20)
    return LLM(**kwargs)


def _warm_up(llm) -> None:
    """One tiny request, so the engine's first-step set-up (seconds on a CPU) counts as loading, not
    against the generation budget."""
    from pipespec.sampling import SamplingParams

    llm.generate({"prompt_token_ids": [0, 1, 2, 3]}, SamplingParams(max_tokens=2), use_tqdm=False)


# eval-mtp's --prompt-set: the prompts it answers, and the split of a data cache (--data) it reads instead
PROMPT_SETS = {"heldout": (lambda: chat_prompts("heldout"), "heldout"),
               "kinds": (lambda: kind_prompts("heldout"), "heldout_kinds"),
               "everyday": (everyday_prompts, None)}


def generate_heldout(model, arch, device, count: int, max_tokens: int, round_size: int,
                     prompt_set: str = "heldout") -> list[Sample]:
    prompts = PROMPT_SETS[prompt_set][0]()
    llm = _engine(model, arch, device, min(round_size, count), max_tokens)
    try:
        return self_generate(llm, prompts[:count], max_tokens, 0.0, round_size)
    finally:
        llm.shutdown()


def heldout_kind_count(args) -> int:
    """--heldout-kind-prompts, default: as many as --heldout-prompts when the run trains on requests
    of many kinds (--kind-prompts, --written-prompts), else none."""
    if args.heldout_kind_prompts is not None:
        return args.heldout_kind_prompts
    return args.heldout_prompts if args.kind_prompts or args.written_prompts else 0


def build_data(args, source, device) -> dict[str, list[Sample]]:
    """Held-out answers (to unseen subjects, and to unseen kinds of request), training answers and
    text windows. `--gen-time` bounds all answers together (budget.py says how it is split); the
    clock starts once the engine is loaded.

    The training prompts: the templates' (prompts.py), words of the vocabulary, kinds of request
    (request_kinds.py) and requests the target writes itself, mixed; the first --follow-ups of them
    get a second user turn after their greedy answer."""
    prompts = chat_prompts("train")[:args.gen_prompts]
    if args.vocab_prompts:
        prompts += vocabulary_prompts(source.tokenizer(), args.vocab_prompts, seed=args.seed)
    prompts += kind_prompts("train", args.kind_prompts, seed=args.seed) if args.kind_prompts else []
    temps = [float(x) for x in args.gen_temperatures.split(",") if x.strip()]
    chat: list[Sample] = []
    heldout: list[Sample] = []
    heldout_kinds: list[Sample] = []
    budget = GenBudget(args.gen_time)
    if args.gen_time != 0:
        llm = _engine(args.model, source.arch, device, args.gen_batch, args.gen_max_tokens,
                      turns=2 if args.follow_ups else 1)
        try:
            _warm_up(llm)
            t0 = time.monotonic()
            heldout_deadline, deadline = budget.deadlines(t0)
            heldout = self_generate(llm, chat_prompts("heldout")[:args.heldout_prompts], args.gen_max_tokens,
                                    0.0, args.gen_batch, heldout_deadline, "held-out answers")
            if kinds_count := heldout_kind_count(args):
                heldout_kinds = self_generate(llm, kind_prompts("heldout", kinds_count),
                                              args.gen_max_tokens, 0.0, args.gen_batch, heldout_deadline,
                                              "held-out kinds' answers")
            if args.written_prompts:
                prompts += written_requests(llm, args.written_prompts, args.gen_batch, deadline, args.seed)
            if args.vocab_prompts or args.kind_prompts or args.written_prompts:
                random.Random(args.seed).shuffle(prompts)     # while time lasts, answers of every kind
            if args.follow_ups:
                chat += two_turn_samples(llm, prompts[:args.follow_ups], args.gen_max_tokens, args.gen_batch,
                                         deadline, args.seed)
                prompts = prompts[args.follow_ups:]
            for temp in temps:
                if deadline is not None and time.monotonic() >= deadline:
                    break
                chat += self_generate(llm, prompts, args.gen_max_tokens, temp, args.gen_batch, deadline,
                                      f"training answers (temperature {temp:g})")
            t_gen = time.monotonic() - t0
        finally:
            llm.shutdown()
        logger.info("generation took %.1f s%s", t_gen, "" if args.gen_time is None else f" of {args.gen_time:g} s")
    t1 = time.monotonic()
    text = []
    if args.text_tokens > 0:
        text = plain_text_samples(source.tokenizer(), args.text_tokens, args.seq_len, args.seed)
    logger.info("data: %d chat samples (%d tokens), %d text windows (%d tokens, %.1f s), %d held-out samples "
                "(and %d of held-out kinds)", len(chat), sum(len(s.ids) for s in chat), len(text),
                sum(len(s.ids) for s in text), time.monotonic() - t1, len(heldout), len(heldout_kinds))
    data = {"chat": chat, "text": text, "heldout": heldout}
    if heldout_kinds:
        data["heldout_kinds"] = heldout_kinds
    return data


def check_data(data: dict[str, list[Sample]], args) -> None:
    """Refuse a run with nothing to learn from; warn, naming the flag to raise, when the answers the
    head should learn (the target's own chat) are missing."""
    if not data["chat"] and not data["text"]:
        raise ValueError("no training data: 0 chat answers and 0 text windows; raise --gen-time "
                         "(seconds of generation) or --text-tokens")
    if not data["chat"]:
        logger.warning("the training set holds 0 chat answers (%d text windows only): the head will learn "
                       "plain text, not the target's answers, and draft chat poorly; raise --gen-time "
                       "(now %s s; the training answers get what the held-out answers leave of it)",
                       len(data["text"]), args.gen_time)
    if not data["heldout"]:
        logger.warning("0 held-out answers: the head's agreement cannot be measured; raise --gen-time "
                       "(now %s s) or --heldout-prompts (now %d)", args.gen_time, args.heldout_prompts)


def init_head_path(args) -> Path | None:
    """`--init-head`'s file, checked before anything runs (None: a new head)."""
    if not args.init_head:
        return None
    if args.block_intermediate or args.no_init_from_last_layer:
        raise ValueError("--init-head takes the head's weights and width from its file: drop "
                         "--block-intermediate / --no-init-from-last-layer")
    path = bundled_head_path(args.model) if args.init_head == "bundled" else Path(args.init_head)
    if path is None:
        raise ValueError(f"--init-head bundled: no head is bundled for {args.model or 'the default model'}")
    if not path.is_file():
        raise ValueError(f"--init-head {path}: no such file")
    return path


def initial_head(args, init_path: Path | None, source, target, device) -> tuple[DeepSeekMTP, str]:
    """The head training starts from, in float32 on `device`, and how it was made (for the file's
    metadata): a head file's weights (`--init-head`), or a new block from the target's last layer
    (or random, `--no-init-from-last-layer`) at the target's MLP width or `--block-intermediate`."""
    if init_path is not None:
        mtp, _ = load_mtp_file(init_path, source.arch, torch.float32, device)
        if not isinstance(mtp, DeepSeekMTP):
            raise ValueError(f"--init-head {init_path}: a {mtp.family} head; train-mtp trains DeepSeek-style "
                             f"heads (the files it writes)")
        return mtp, f"head file {init_path}"
    head_arch = source.arch
    if args.block_intermediate:
        head_arch = dataclasses.replace(head_arch, intermediate_size=args.block_intermediate)
    mtp = DeepSeekMTP(head_arch)
    if not args.no_init_from_last_layer:
        mtp.init_from_target(target)
    return mtp.to(device=device, dtype=torch.float32), "random" if args.no_init_from_last_layer else "target last layer"


def resolve_sizes(args, device: torch.device) -> None:
    """Fill in the sizes left to the device and the time budget (sizing.py): the step's batch and
    sequence length, generation's round, the text tokens."""
    step = default_step(device.type, args.max_time, args.seq_len)
    if args.seq_len is None:
        args.seq_len = step.seq_len
    if args.batch_size is None:
        args.batch_size = step.batch_size
    if args.gen_batch is None:
        args.gen_batch = default_gen_batch(device.type)
    if args.text_tokens is None:
        args.text_tokens = default_text_tokens(device.type, args.max_time)


def memory_plan(args, source, device: torch.device, train_dtype: torch.dtype) -> tuple[int, str]:
    """(expected peak bytes, the plan's words for the training step and its memory)."""
    arch = source.arch
    head_arch = dataclasses.replace(arch, intermediate_size=args.block_intermediate) if args.block_intermediate \
        else arch
    with torch.device("meta"):                              # shapes only
        target_params = sum(p.numel() for p in LlamaForCausalLM(arch).parameters())
        head_params = sum(p.numel() for p in DeepSeekMTP(head_arch).parameters())
    step = StepSize(args.batch_size, args.seq_len)
    peak = expected_memory_bytes(target_params, head_params, step.tokens, arch.vocab_size, args.steps,
                                 torch.finfo(train_dtype).bits // 8)
    where = "RAM" if device.type == "cpu" else f"{device.type} memory"
    warm = f"warm-up {args.warmup} steps" if args.warmup is not None else \
        "warm-up 10% of the steps the first step's time says fit"
    text = (f"steps of {args.batch_size} x {args.seq_len} tokens on {device.type} (--batch-size, --seq-len), {warm}; "
            f"memory: about {peak / 1e9:.1f} GB of {where} at the peak (the target in {train_dtype}, the head with its "
            f"optimizer state, a step's {arch.vocab_size:,}-wide logits)")
    return peak, text


def train_command(args) -> int:
    """Runs the command; without a terminal (no progress bar) a heartbeat logs what it is doing at
    least every --log-interval seconds."""
    if sys.stderr.isatty() or not args.log_interval:
        return _train_command(args, lambda text: None)
    with Heartbeat(args.log_interval) as beat:
        return _train_command(args, beat.status)


def _train_command(args, status) -> int:
    t_start = time.perf_counter()
    out = Path(args.out)
    device = resolve_device(args.device)
    train_dtype = resolve_dtype("auto", device)
    eval_dtype = _DTYPES[args.eval_dtype]
    source = resolve_model(args.model)
    init_path = init_head_path(args)
    if args.draft_vocab and not 0 < args.draft_vocab <= source.arch.vocab_size:
        raise ValueError(f"--draft-vocab must be in 1..{source.arch.vocab_size} (the target's vocabulary), "
                         f"got {args.draft_vocab}")
    resolve_sizes(args, device)
    peak, step_text = memory_plan(args, source, device, train_dtype)
    cache = Path(args.data_cache or f"{out}.data.json")
    logger.info("%s", plan_text(args, str(cache) if cache.exists() else None, step_text))
    if cache.exists():
        data = load_data(cache)
        logger.info("read the training data from %s", cache)
    else:
        status("generating data")
        data = build_data(args, source, device)
        cache.parent.mkdir(parents=True, exist_ok=True)
        save_data(cache, data)
    t_data = time.perf_counter() - t_start
    check_data(data, args)
    if args.draft_vocab and not data["chat"]:
        raise ValueError("--draft-vocab counts the tokens of the training answers, and there are none; raise "
                         "--gen-time or drop --draft-vocab")
    if args.gen_only:
        print(f"wrote the training data to {cache} in {t_data:.0f} s; train with --data-cache {cache}")
        return 0

    torch.manual_seed(args.seed)
    status("loading the target")
    target = load_teacher(source, device, train_dtype)
    mtp, init = initial_head(args, init_path, source, target, device)
    cfg = TrainConfig(num_steps=args.steps, tokens=args.tokens, batch_size=args.batch_size, seq_len=args.seq_len,
                      lr=args.lr, warmup=args.warmup, step_weight=args.step_weight, seed=args.seed,
                      max_time=args.max_time, log_every=args.log_every,
                      log_interval=None if sys.stderr.isatty() or not args.log_interval else args.log_interval,
                      checkpoint=args.checkpoint or f"{out}.ckpt", checkpoint_every=args.checkpoint_every,
                      eval_every=args.eval_every, weight_decay=args.weight_decay)
    pad = (source.tokenizer().eos_token_id or 0)
    batcher = Batcher(data["chat"], data["text"], cfg.batch_size, cfg.seq_len, args.text_fraction, args.seed, pad)
    out_dtype = _DTYPES[args.out_dtype]
    info = {"command": " ".join(["pipespec"] + sys.argv[1:]) if sys.argv else "",
            "chat_samples": len(data["chat"]), "chat_tokens": sum(len(s.ids) for s in data["chat"]),
            "text_samples": len(data["text"]), "text_tokens": sum(len(s.ids) for s in data["text"]),
            "heldout_samples": len(data["heldout"]), "config": dataclasses.asdict(cfg),
            "init": init}
    eval_tokens = eval_batch_tokens(cfg.batch_size * cfg.seq_len, cfg.num_steps)

    def write_head(step: int) -> None:
        save_mtp(out, mtp, source.name, out_dtype, {"pipespec.train": dict(info, steps_done=step)},
                 base_arch=source.arch)

    curve = []

    def evaluate(step: int) -> None:
        result = agreement(mtp, target, data["heldout"][:64], cfg.num_steps, device, max_tokens=eval_tokens)
        curve.append({"step": step, "agreement": [round(r.rate, 4) for r in result]})
        logger.info("step %d held-out agreement (64 answers, %s): %s", step, train_dtype,
                    " ".join(f"{100 * r.rate:.1f}%" for r in result))

    summary = train(mtp, target, batcher, cfg, device, resume=args.resume, on_checkpoint=write_head,
                    evaluate=evaluate if args.eval_every and data["heldout"] else None, status=status)
    info["heldout_curve"] = curve
    info.update(summary, data_seconds=round(t_data, 1))
    write_head(summary["steps"])
    del mtp
    if eval_dtype != train_dtype:
        del target
        if device.type == "cuda":
            torch.cuda.empty_cache()
        target = load_teacher(source, device, eval_dtype)

    # evaluate the file as written (out_dtype weights), in eval_dtype
    head, _ = load_mtp_file(out, source.arch, eval_dtype, device)
    seen_samples = data["chat"][:len(data["heldout"]) or 64]       # as many as held out, to compare
    status(f"evaluating the head on {len(data['heldout'])} held-out answers and {len(seen_samples)} training answers")
    t_eval = time.perf_counter()
    tensors = vocab = None
    if args.draft_vocab:
        ids = most_frequent_tokens(data["chat"], source.arch.vocab_size, args.draft_vocab)
        tensors = {DRAFT_VOCAB_TENSOR: ids}
        vocab = DraftVocab(ids.to(device))
    # with a draft vocabulary: the held-out answers scored both ways from one pass of the target
    heldout, *with_vocab = agreements(head, target, data["heldout"], cfg.num_steps, device,
                                      [None] + ([vocab] if vocab is not None else []), max_tokens=eval_tokens)
    seen = agreement(head, target, seen_samples, cfg.num_steps, device, max_tokens=eval_tokens)
    extra = {"pipespec.train": info, "pipespec.eval_heldout": as_dict(heldout),
             "pipespec.eval_train_sample": as_dict(seen), "pipespec.num_spec_steps": cfg.num_steps}
    kinds = None
    if data.get("heldout_kinds"):
        kinds = agreement(head, target, data["heldout_kinds"], cfg.num_steps, device, max_tokens=eval_tokens)
        extra["pipespec.eval_heldout_kinds"] = as_dict(kinds)
    if args.check_set:
        check = [Sample(s.ids[:args.check_len], s.start) for s in data["heldout"][:args.check_size]]
        save_samples(args.check_set, check)
        extra["pipespec.eval_check"] = as_dict(agreement(head, target, check, cfg.num_steps, device,
                                                         max_tokens=eval_tokens))
    if with_vocab:
        extra["pipespec.eval_heldout_draft_vocab"] = as_dict(with_vocab[0])
    t_eval = time.perf_counter() - t_eval
    save_mtp(out, head, source.name, out_dtype, extra, base_arch=source.arch, tensors=tensors)
    print(report(f"held-out ({len(data['heldout'])} self-generated answers to unseen prompts)", heldout,
                 _why_empty(data["heldout"], "held-out answers")))
    if kinds is not None:
        print(report(f"held-out kinds ({len(data['heldout_kinds'])} answers to kinds of request no training prompt "
                     f"is of)", kinds, "no answers"))
    print(report(f"training answers (first {len(seen_samples)}, for the generalization gap)", seen,
                 _why_empty(seen_samples, "chat answers in the training set")))
    if with_vocab:
        print(report(f"held-out, drafting over the draft vocabulary ({args.draft_vocab} most frequent answer "
                     f"tokens, written to the head file)", with_vocab[0], "no held-out answers"))
    if args.check_set:
        print(f"\ncheck set ({args.check_set}): {extra['pipespec.eval_check']}")
    warn_if_slower(heldout, target, head, f"Train longer (--max-time, now {args.max_time} s; trained "
                   f"{summary['seconds']:.0f} s) on more of the target's answers (--gen-time, now {args.gen_time} s)")
    used = peak_rss_bytes()
    print(f"\nwrote {out} in {time.perf_counter() - t_start:.0f} s "
          f"(data {t_data:.0f} s, training {summary['seconds']:.0f} s, {summary['tokens']} tokens, evaluation "
          f"{t_eval:.0f} s); peak RSS {used / 1e9:.2f} GB (planned {peak / 1e9:.1f} GB)")
    return 0


def _why_empty(samples: list[Sample], what: str) -> str:
    if not samples:
        return f"there are no {what}; raise --gen-time"
    tokens = sum(len(s.ids) - s.start for s in samples)
    return f"the {len(samples)} {what} hold {tokens} answer tokens, too few to score; raise --gen-time"


def head_payoff(heldout, target, head):
    """payoff.py's cost model over measured held-out agreement (None: nothing was measured)."""
    if not any(r.positions for r in heldout):
        return None
    arch = target.arch
    d = draft_cost_ratio(sum(p.numel() for p in target.model.layers.parameters()),
                         sum(p.numel() for p in head.parameters()), arch.vocab_size * arch.hidden_size)
    return payoff([r.walk_length for r in heldout], d)


def warn_if_slower(heldout, target, head, advice: str) -> None:
    """Say so, with what to change (`advice`), when the measured held-out agreement would make
    speculative decoding slower than plain decoding (train-mtp and eval-mtp say it in the same
    words); else print the expected speedup."""
    p = head_payoff(heldout, target, head)
    if p is None:
        return                            # nothing measured: report() said why
    d = p.draft_cost
    if p.pays:
        print(f"\nexpected decode speedup at batch 1: {p.speedup:.2f}x with K={p.best_k} (a draft step costs "
              f"~{d:.2f} of a target step by weights read)")
        return
    message = (f"this head would make decoding slower: its held-out step-1 agreement is "
               f"{100 * heldout[0].rate:.1f}%, and a draft step costs ~{d:.2f} of a target step (the MTP layer and "
               f"the LM head against the target's layers and LM head, by weights read at batch 1), so at best "
               f"(K={p.best_k}) speculation runs at {p.speedup:.2f}x; step-1 agreement must exceed "
               f"{100 * d:.0f}% to pay. {advice}")
    logger.warning("%s", message)
    print(f"\nWARNING: {message}")


def draft_vocab_command(args) -> int:
    """`pipespec draft-vocab`: the tokens most frequent in a data cache's training answers, as a file
    speculative_config.draft_vocab names."""
    source = resolve_model(args.model)
    if not 0 < args.size <= source.arch.vocab_size:
        raise ValueError(f"--size must be in 1..{source.arch.vocab_size} (the model's vocabulary), got {args.size}")
    answers = load_samples(args.data, "chat")
    if not answers:
        raise ValueError(f"{args.data} holds no training answers to count; make one with `pipespec train-mtp "
                         f"--gen-only --data-cache {args.data}`")
    ids = most_frequent_tokens(answers, source.arch.vocab_size, args.size)
    tokens = sum(len(s.ids) - s.start for s in answers)
    covered = sum(int(torch.isin(torch.tensor(s.ids[s.start:]), ids).sum()) for s in answers)
    write_draft_vocab(args.out, ids, {"pipespec.base_model": source.name, "pipespec.draft_vocab": json.dumps(
        {"size": args.size, "answers": len(answers), "answer_tokens": tokens, "covered": round(covered / tokens, 4)})})
    print(f"wrote {args.out}: the {args.size} tokens most frequent in {len(answers)} answers ({tokens} tokens, "
          f"{100 * covered / tokens:.1f}% of them among these); use it with speculative_config "
          f"{{\"draft_vocab\": \"{args.out}\"}}")
    return 0


def eval_command(args) -> int:
    """Runs `eval-mtp`; without a terminal a heartbeat logs what it is doing at least every 30 s
    (generating the answers to score can take minutes on a CPU)."""
    if sys.stderr.isatty():
        return _eval_command(args, lambda text: None)
    with Heartbeat(EVAL_LOG_INTERVAL) as beat:
        return _eval_command(args, beat.status)


def _eval_command(args, status) -> int:
    device = resolve_device(args.device)
    dtype = _DTYPES[args.dtype]
    head_path = args.head or bundled_head_path(args.model)
    if head_path is None:
        raise ValueError("no MTP head is bundled for this model; pass --head (train one with pipespec train-mtp)")
    meta = read_mtp_metadata(head_path)
    steps = args.steps or int(meta.get("pipespec.num_spec_steps", 3))
    source = resolve_model(args.model)
    if args.data:
        split = PROMPT_SETS[args.prompt_set][1]
        if split is None:
            raise ValueError(f"--prompt-set {args.prompt_set} is answered here, not read from a data cache: "
                             "drop --data")
        samples = load_samples(args.data, split)
    else:
        status(f"generating {args.prompts} answers to {args.prompt_set} prompts")
        samples = generate_heldout(args.model, source.arch, device, args.prompts, args.max_tokens, args.gen_batch,
                                   args.prompt_set)
    status("loading the target")
    target = load_teacher(source, device, dtype)
    head, _ = load_mtp_file(head_path, source.arch, dtype, device)
    vocab = None
    if args.draft_vocab or args.draft_vocab_size:
        vocab = DraftVocab.from_file(args.draft_vocab or head_path, args.draft_vocab_size, source.arch.vocab_size,
                                     device)
    status(f"scoring the head on {len(samples)} answers")
    results = agreement(head, target, samples, steps, device, args.batch_size, vocab=vocab)
    over = f", drafting over {vocab.ids.numel()} tokens" if vocab is not None else ""
    print(report(f"head {head_path} on {source.name}: {len(samples)} samples, teacher-forced, {args.dtype}{over}",
                 results, "no sample has an answer long enough to score; give --data with longer answers "
                 "or raise --max-tokens"))
    warn_if_slower(results, target, head, "Train it longer (pipespec train-mtp --init-head FILE continues from it) "
                   "or on more of the target's answers (--gen-time)")
    return 0
