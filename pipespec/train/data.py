"""Training data for MTP heads, all offline: the target's own chat answers (generated with the
engine) and plain text/code found on the machine; and deterministic batches over them."""
from __future__ import annotations

import gzip
import itertools
import json
import logging
import random
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)
_request_ids = itertools.count()


@dataclass(frozen=True)
class Sample:
    ids: tuple[int, ...]
    start: int = 0              # first token of the answer (0 for plain text: all of it counts)


def write_json(path: str | Path, obj) -> None:
    """`obj` as JSON at `path`, gzipped when the name ends in .gz (token ids pack ~3x: a data cache
    small enough to carry between machines)."""
    text = json.dumps(obj)
    if str(path).endswith(".gz"):
        Path(path).write_bytes(gzip.compress(text.encode()))
    else:
        Path(path).write_text(text)


def read_json(path: str | Path):
    raw = Path(path).read_bytes()
    return json.loads(gzip.decompress(raw) if str(path).endswith(".gz") else raw)


def _as_json(samples: list[Sample]) -> list[dict]:
    return [{"ids": list(s.ids), "start": s.start} for s in samples]


def _from_json(items: list[dict]) -> list[Sample]:
    return [Sample(tuple(d["ids"]), d["start"]) for d in items]


def save_samples(path: str | Path, samples: list[Sample]) -> None:
    write_json(path, _as_json(samples))


def save_data(path: str | Path, data: dict[str, list[Sample]]) -> None:
    """A training data cache: its splits ({"chat", "text", "heldout"}) in one file."""
    write_json(path, {split: _as_json(samples) for split, samples in data.items()})


def load_data(path: str | Path) -> dict[str, list[Sample]]:
    return {split: _from_json(items) for split, items in read_json(path).items()}


def load_samples(path: str | Path, split: str = "heldout") -> list[Sample]:
    """A samples file, or one split of a training data cache (`save_data`: so that heads are
    compared on the very answers a training run held out)."""
    raw = read_json(path)
    if isinstance(raw, dict):
        if split not in raw:
            raise ValueError(f"{path} is a data cache without a {split!r} split (it holds {', '.join(raw)})")
        raw = raw[split]
    return _from_json(raw)


def encode_prompt(tok, prompt, chat: bool = True) -> list[int]:
    """A prompt's token ids: a user turn (str) or a conversation (a list of messages) in the chat
    template; with `chat=False`, text for the target to continue as it is."""
    if not chat:
        return tok.encode(prompt, add_special_tokens=False)
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    return tok.encode(tok.apply_chat_template(messages, True), add_special_tokens=False)


def self_generate(llm, prompts: list, max_tokens: int, temperature: float = 0.0,
                  round_size: int = 256, deadline: float | None = None, what: str = "answers",
                  chat: bool = True, stop: list[str] | None = None) -> list[Sample]:
    """The target's answers to `prompts` (encode_prompt's kinds), as samples in prompt order; a
    prompt whose answer is empty has none. generate_outputs says how they are generated."""
    outputs = generate_outputs(llm, prompts, max_tokens, temperature, round_size, deadline, what, chat, stop)
    return [_as_sample(out) for _, out in sorted(outputs.items()) if out.outputs[0].token_ids]


def _as_sample(out) -> Sample:
    """A RequestOutput as a training sample: its prompt and answer, the answer alone counted."""
    return Sample(tuple(out.prompt_token_ids) + tuple(out.outputs[0].token_ids), len(out.prompt_token_ids))


def generate_outputs(llm, prompts: list, max_tokens: int, temperature: float = 0.0, round_size: int = 256,
                     deadline: float | None = None, what: str = "answers", chat: bool = True,
                     stop: list[str] | None = None) -> dict[int, object]:
    """{prompt index: its finished (or cut) RequestOutput}, at most `round_size` requests in the
    engine at once (refilled a quarter of a round at a time).

    `deadline` (a `time.monotonic()` instant) is a hard bound: when it passes, the answers under way
    are cut where they are (a greedy answer cut short is still the target's own text, so it still
    trains and evaluates) and the prompts not started are dropped. Requests use the engine's default
    seeds (fixed by its config seed and arrival order). Uses the engine's public request API.
    """
    from pipespec.sampling import RequestOutputKind, SamplingParams

    engine, tok = llm.engine, llm.get_tokenizer()
    # whole answers only: no output of a running request is built at every step
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, stop=stop,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    outputs: dict[int, object] = {}
    live: dict[str, int] = {}
    todo = iter(enumerate(prompts))
    started, t0, t_log = 0, time.monotonic(), time.monotonic()

    def fill() -> None:
        # Top the round up once a quarter of it has finished: on a GPU a step that prefills new
        # prompts runs eagerly, while a step of decodes alone replays a CUDA graph, so prompts come
        # in batches rather than one after each finished answer (which made nearly every step eager).
        nonlocal started
        if len(live) > round_size - max(1, round_size // 4):
            return
        while len(live) < round_size:
            item = next(todo, None)
            if item is None:
                return
            i, prompt = item
            ids = encode_prompt(tok, prompt, chat)
            req = engine.make_request(f"selfgen-{next(_request_ids)}", {"prompt_token_ids": ids}, params)
            engine.submit(req)
            live[req.request_id] = i
            started += 1

    fill()
    cut_short = 0
    try:
        while live:
            if deadline is not None and time.monotonic() >= deadline:
                break
            for out in engine.step():
                if out.finished and out.request_id in live:
                    outputs[live.pop(out.request_id)] = out
            fill()
            if time.monotonic() - t_log > 30:
                t_log = time.monotonic()
                logger.info("%s: %d of %d done, %d under way, %.0f s", what, len(outputs), len(prompts),
                            len(live), t_log - t0)
    finally:
        for request_id, i in list(live.items()):      # cut at the deadline (or interrupted)
            out = engine.abort_request(request_id)
            cut_short += 1
            if out is not None:
                outputs[i] = out
    tokens = sum(len(out.outputs[0].token_ids) for out in outputs.values())
    seconds = time.monotonic() - t0
    cut = (f"; the time budget cut {cut_short} short and left {len(prompts) - started} unstarted"
           if cut_short or started < len(prompts) else "")
    logger.info("%s: %d answers (%d tokens, %.0f tok/s) in %.1f s%s", what, len(outputs), tokens,
                tokens / max(seconds, 1e-9), seconds, cut)
    return outputs


def written_requests(llm, count: int, round_size: int, deadline: float | None = None, seed: int = 0) -> list[str]:
    """Up to `count` requests the target writes itself (request_kinds.writing_prompts), the ones
    that read as a request, without repeats."""
    from pipespec.train.request_kinds import parse_written, writing_prompts

    outputs = generate_outputs(llm, writing_prompts(count, seed=seed), 48, 0.8, round_size, deadline,
                               "requests the target writes", chat=False, stop=["\n"])
    requests = (parse_written(out.outputs[0].text) for _, out in sorted(outputs.items()))
    unique = list(dict.fromkeys(r for r in requests if r))
    logger.info("kept %d of %d written requests (the rest did not read as one, or repeated one)",
                len(unique), len(outputs))
    return unique


def two_turn_samples(llm, prompts: list[str], max_tokens: int, round_size: int, deadline: float | None = None,
                     seed: int = 0) -> list[Sample]:
    """Greedy answers to `prompts`, then to a follow-up turn after each (request_kinds.FOLLOW_UPS):
    the samples of both turns (a second turn's sample holds the whole conversation, its answer alone
    counted)."""
    from pipespec.train.request_kinds import follow_up_conversations

    first = generate_outputs(llm, prompts, max_tokens, 0.0, round_size, deadline, "first turns")
    # a second turn only after a first answer that ended as the target ended it (not cut by the deadline)
    done = sorted(i for i, out in first.items() if out.outputs[0].finish_reason in ("stop", "length"))
    conversations = follow_up_conversations([(prompts[i], first[i].outputs[0].text) for i in done], seed)
    second = self_generate(llm, conversations, max_tokens, 0.0, round_size, deadline, "second turns")
    return [_as_sample(first[i]) for i in done] + second


def most_frequent_tokens(samples: list[Sample], vocab_size: int, n: int) -> torch.Tensor:
    """The `n` token ids most frequent in the samples' answers (ties: the lower id), most frequent first:
    a draft vocabulary (speculative/draft_vocab.py)."""
    if not 1 <= n <= vocab_size:
        raise ValueError(f"a draft vocabulary holds 1..{vocab_size} tokens, got {n}")
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for s in samples:
        counts += torch.bincount(torch.tensor(s.ids[s.start:], dtype=torch.int64), minlength=vocab_size)
    return torch.sort(counts, descending=True, stable=True).indices[:n]


def text_files(roots: list[Path] | None = None) -> list[Path]:
    """Plain text and code on this machine: the Python standard library and docs under sys.prefix."""
    if roots is None:
        roots = [Path(sysconfig.get_paths()["stdlib"]), Path(sys.prefix) / "share" / "doc"]
    files = []
    for root in roots:
        if not root.is_dir():
            continue
        for path in root.rglob("*"):
            parts = set(path.parts)
            if parts & {"site-packages", "dist-packages", "test", "tests", "__pycache__", "idlelib"}:
                continue
            if path.suffix in (".py", ".txt", ".rst", ".md") and path.is_file():
                files.append(path)
    return sorted(files)


def plain_text_samples(tokenizer, max_tokens: int, seq_len: int, seed: int = 0,
                       roots: list[Path] | None = None) -> list[Sample]:
    """Windows of `seq_len` tokens cut from text/code files, about `max_tokens` tokens in all."""
    files = text_files(roots)
    random.Random(seed).shuffle(files)
    samples, total = [], 0
    for path in files:
        if total >= max_tokens:
            break
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        ids = tokenizer.encode(text[:200_000], add_special_tokens=False)
        for i in range(0, len(ids) - 16, seq_len):
            window = ids[i:i + seq_len]
            samples.append(Sample(tuple(window), 0))
            total += len(window)
            if total >= max_tokens:
                break
    return samples


def collate(samples: list[Sample], seq_len: int | None = None, pad_id: int = 0):
    """(ids [B, N] int64 right-padded, lens [B], starts [B]); N = seq_len or the longest sample."""
    n = seq_len or max(len(s.ids) for s in samples)
    ids = torch.full((len(samples), n), pad_id, dtype=torch.int64)
    lens = torch.empty(len(samples), dtype=torch.int64)
    starts = torch.empty(len(samples), dtype=torch.int64)
    for i, s in enumerate(samples):
        row = s.ids[:n]
        ids[i, :len(row)] = torch.tensor(row, dtype=torch.int64)
        lens[i], starts[i] = len(row), min(s.start, len(row))
    return ids, lens, starts


class Batcher:
    """Deterministic mixed batches: batch `step` is a pure function of (seed, step), so a resumed
    run sees the same data. Each batch takes `text_fraction` of its rows from the text pool and the
    rest from the chat pool; each pool is walked in a seeded permutation per epoch."""

    def __init__(self, chat: list[Sample], text: list[Sample], batch_size: int, seq_len: int,
                 text_fraction: float = 0.25, seed: int = 0, pad_id: int = 0):
        if not chat and not text:
            raise ValueError("no training samples")
        n_text = round(batch_size * text_fraction) if chat and text else (batch_size if text else 0)
        self.pools = [(p, n) for p, n in ((chat, batch_size - n_text), (text, n_text)) if n]
        self.batch_size, self.seq_len, self.seed, self.pad_id = batch_size, seq_len, seed, pad_id
        self._perms: dict[tuple[int, int], list[int]] = {}

    def _perm(self, pool_index: int, size: int, epoch: int) -> list[int]:
        key = (pool_index, epoch)
        if key not in self._perms:
            if len(self._perms) > 8:
                self._perms.clear()
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + pool_index * 7919 + epoch)
            self._perms[key] = torch.randperm(size, generator=g).tolist()
        return self._perms[key]

    def _take(self, pool_index: int, pool: list[Sample], count: int, step: int) -> list[Sample]:
        out = []
        for j in range(step * count, (step + 1) * count):
            epoch, offset = divmod(j, len(pool))
            out.append(pool[self._perm(pool_index, len(pool), epoch)[offset]])
        return out

    def batch(self, step: int):
        samples = []
        for i, (pool, count) in enumerate(self.pools):
            samples.extend(self._take(i, pool, count, step))
        return collate(samples, self.seq_len, self.pad_id)
