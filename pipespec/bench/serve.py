"""`pipespec bench serve`: a load generator against a running OpenAI-compatible server.

As vLLM's: `--num-prompts` streaming requests to `/v1/completions`, sent at `--request-rate`
requests/s (Poisson arrivals; inf: all at once) with at most `--max-concurrency` in flight. Per
request it records the time to the first token (TTFT), the gaps between streamed chunks (ITL) and
the time per output token after the first (TPOT); the summary gives request and token throughput and
the mean, median and `--metric-percentiles` of each.

Prefix caching workloads: `--random-prefix-len N` puts the same N random tokens before every prompt
(a shared system prompt); `--multi-turn N` makes each of the `--num-prompts` requests a conversation
of N turns sent one after another, each turn's prompt the previous one plus its answer plus a new
user line (text of random common words then, since the answer comes back as text: `--random-input-len`
and `--random-prefix-len` count words, about a token each). The summary then also gives the TTFT of
first turns and of later ones.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time
from dataclasses import dataclass, field

from pipespec.bench import report
from pipespec.bench import random_token_prompts
from pipespec.bench.stats import describe, parse_percentiles

# ids of random prompts: below the vocabulary of any supported model, above byte/special tokens
_RANDOM_IDS = (1000, 30000)


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    ttft: float = 0.0                  # seconds to the first chunk carrying text
    latency: float = 0.0               # seconds to the end of the stream
    itl: list[float] = field(default_factory=list)    # gaps between chunks carrying text
    prompt_tokens: int = 0
    output_tokens: int = 0
    text: str = ""                     # the completion
    turn: int = 0                      # its turn in a conversation (--multi-turn), from 0

    @property
    def tpot(self) -> float | None:
        return (self.latency - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


async def one_request(client, url: str, prompt, max_tokens: int, model: str | None = None,
                      ignore_eos: bool = True) -> RequestResult:
    """One streamed completion; `prompt` is a string or a list of token ids."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": ignore_eos,
            "stream": True, "stream_options": {"include_usage": True}}
    if model is not None:
        body["model"] = model
    out = RequestResult()
    t0 = time.perf_counter()
    last = None
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                out.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:200]}"
                return out
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    out.error = chunk["error"].get("message", str(chunk["error"]))
                    return out
                if chunk.get("usage"):
                    out.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    out.output_tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    out.text += chunk["choices"][0]["text"]
                    now = time.perf_counter()
                    if last is None:
                        out.ttft = now - t0
                    else:
                        out.itl.append(now - last)
                    last = now
        out.latency = time.perf_counter() - t0
        out.ok = last is not None
        if not out.ok:
            out.error = "the stream carried no text"
    except Exception as e:  # noqa: BLE001 - a failed request is a result, not a crash of the benchmark
        out.error = f"{type(e).__name__}: {e}"
    return out


async def run_load(url: str, prompts: list, max_tokens: int, request_rate: float = float("inf"),
                   max_concurrency: int | None = None, model: str | None = None, api_key: str | None = None,
                   seed: int = 0, timeout: float = 600.0) -> tuple[list[RequestResult], float]:
    """Send every prompt (arrivals at `request_rate`, at most `max_concurrency` in flight);
    returns the results in prompt order and the wall time from the first send to the last answer."""
    import httpx

    rng = random.Random(seed)
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=max_concurrency or len(prompts) or 1)

    async with httpx.AsyncClient(timeout=timeout, headers=headers, limits=limits) as client:
        async def send(prompt) -> RequestResult:
            if gate is None:
                return await one_request(client, url, prompt, max_tokens, model)
            async with gate:
                return await one_request(client, url, prompt, max_tokens, model)

        t0 = time.perf_counter()
        tasks = []
        for i, prompt in enumerate(prompts):
            tasks.append(asyncio.create_task(send(prompt)))
            if request_rate != float("inf") and i < len(prompts) - 1:
                await asyncio.sleep(rng.expovariate(request_rate))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - t0


async def run_conversations(url: str, first: list[str], lines: list[list[str]], max_tokens: int,
                            max_concurrency: int | None = None, model: str | None = None,
                            api_key: str | None = None, timeout: float = 600.0) -> tuple[list[RequestResult], float]:
    """Conversations, at most `max_concurrency` at once: conversation i sends `first[i]`, then for
    each of its `lines[i]` the previous prompt plus its answer plus that line. Returns the results
    conversation by conversation, turn by turn (`RequestResult.turn`), and the wall time."""
    import httpx

    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=max_concurrency or len(first) or 1)

    async with httpx.AsyncClient(timeout=timeout, headers=headers, limits=limits) as client:
        async def talk(prompt: str, more: list[str]) -> list[RequestResult]:
            results = []
            for turn in range(len(more) + 1):
                r = await one_request(client, url, prompt, max_tokens, model)
                r.turn = turn
                results.append(r)
                if not r.ok or turn == len(more):
                    break
                prompt = prompt + r.text + "\n" + more[turn]
            return results

        async def send(prompt: str, more: list[str]) -> list[RequestResult]:
            if gate is None:
                return await talk(prompt, more)
            async with gate:
                return await talk(prompt, more)

        t0 = time.perf_counter()
        done = await asyncio.gather(*(send(p, m) for p, m in zip(first, lines)))
        return [r for conv in done for r in conv], time.perf_counter() - t0


# common English words, each one token in the usual tokenizers: conversation text of a known length
_WORDS = ("the of and to in is you that it he was for on are as with his they at be this have from or one "
          "had by word but not what all were we when your can said there use an each which she do how their "
          "if will up other about out many then them these so some her would make like him into time has look "
          "two more write go see number no way could people my than first water been call who oil its now find "
          "long down day did get come made may part over new sound take only little work know place year live "
          "me back give most very after thing our just name good sentence man think say great where help "
          "through much before line right too mean old any same tell boy follow came want show also around "
          "form three small set put end does another well large must big even such because turn here why ask "
          "went men read need land different home us move try kind hand picture again change off play spell "
          "air away animal house point page letter mother answer found study still learn should world").split()


def random_word_lines(num: int, words: int, rng: random.Random) -> list[str]:
    """`num` lines of `words` random common words (a token each, give or take)."""
    return [" ".join(rng.choice(_WORDS) for _ in range(words)) for _ in range(num)]


def summarize(results: list[RequestResult], duration: float, percentiles: tuple[float, ...]) -> dict:
    done = [r for r in results if r.ok]
    prompt_tokens = sum(r.prompt_tokens for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    summary = {"completed": len(done), "failed": len(results) - len(done), "duration_s": duration,
               "total_input_tokens": prompt_tokens, "total_output_tokens": output_tokens,
               "request_throughput": len(done) / duration,
               "output_throughput": output_tokens / duration,
               "total_token_throughput": (prompt_tokens + output_tokens) / duration}
    for name, values in (("ttft", [r.ttft for r in done]),
                         ("tpot", [r.tpot for r in done if r.tpot is not None]),
                         ("itl", [x for r in done for x in r.itl]),
                         ("e2el", [r.latency for r in done])):
        for stat, value in describe(values, percentiles, scale=1000.0).items():
            summary[f"{stat}_{name}_ms"] = value
    if any(r.turn for r in results):
        for name, values in (("first_turn", [r.ttft for r in done if r.turn == 0]),
                             ("later_turns", [r.ttft for r in done if r.turn > 0])):
            for stat, value in describe(values, (), scale=1000.0).items():
                summary[f"{stat}_ttft_{name}_ms"] = value
    errors = sorted({r.error for r in results if not r.ok})
    if errors:
        summary["errors"] = errors[:5]
    return summary


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default=None, help="server URL (default: http://HOST:PORT)")
    p.add_argument("--host", default="127.0.0.1", help="server host, when --base-url is not given")
    p.add_argument("--port", type=int, default=8000, help="server port, when --base-url is not given")
    p.add_argument("--model", default=None, help="model name to send (default: the server's)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY)")
    p.add_argument("--num-prompts", type=int, default=100, help="requests to send")
    p.add_argument("--random-input-len", type=int, default=128, help="prompt tokens per request")
    p.add_argument("--random-prefix-len", type=int, default=0,
                   help="tokens of a random prefix shared by every prompt, before its own --random-input-len "
                        "(a shared system prompt; measures the prefix cache)")
    p.add_argument("--multi-turn", type=int, default=1, metavar="N",
                   help="turns per conversation: each of --num-prompts conversations sends N requests one after "
                        "another, each the previous prompt plus its answer plus a new line of random words")
    p.add_argument("--random-output-len", type=int, default=64, help="generated tokens per request (EOS ignored)")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second, Poisson arrivals; inf sends them all at once")
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most (default: no limit)")
    p.add_argument("--metric-percentiles", default="99", help="percentiles of TTFT, TPOT, ITL and E2EL to report")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts and of the arrival times")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds one request may take")
    p.add_argument("--output-json", default=None, help="also write the results to this JSON file")


def run(args: argparse.Namespace) -> int:
    percentiles = parse_percentiles(args.metric_percentiles)
    for name in ("num_prompts", "random_input_len", "random_output_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not args.request_rate > 0:
        raise ValueError(f"--request-rate must be > 0 (inf: all at once), got {args.request_rate}")
    if args.random_prefix_len < 0 or args.multi_turn < 1:
        raise ValueError("--random-prefix-len must be >= 0 and --multi-turn >= 1, got "
                         f"{args.random_prefix_len} and {args.multi_turn}")
    url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    if args.multi_turn > 1:
        rng = random.Random(args.seed)
        prefix = random_word_lines(1, args.random_prefix_len, rng)[0] + "\n" if args.random_prefix_len else ""
        first = [prefix + line for line in random_word_lines(args.num_prompts, args.random_input_len, rng)]
        lines = [random_word_lines(args.multi_turn - 1, args.random_input_len, rng) for _ in first]
        results, duration = asyncio.run(run_conversations(url, first, lines, args.random_output_len,
                                                          args.max_concurrency, args.model, args.api_key,
                                                          args.request_timeout))
    else:
        prompts = random_token_prompts(args.num_prompts, args.random_input_len, _RANDOM_IDS[1], args.seed,
                                       low=_RANDOM_IDS[0])
        if args.random_prefix_len:
            prefix = random_token_prompts(1, args.random_prefix_len, _RANDOM_IDS[1], args.seed + 1,
                                          low=_RANDOM_IDS[0])[0]
            prompts = [prefix + p for p in prompts]
        results, duration = asyncio.run(run_load(url, prompts, args.random_output_len, args.request_rate,
                                                 args.max_concurrency, args.model, args.api_key, args.seed,
                                                 args.request_timeout))
    s = summarize(results, duration, percentiles)
    lines = ["============ Serving Benchmark Result ============",
             f"Successful requests:             {s['completed']}",
             f"Failed requests:                 {s['failed']}",
             f"Benchmark duration (s):          {duration:.2f}",
             f"Total input tokens:              {s['total_input_tokens']}",
             f"Total generated tokens:          {s['total_output_tokens']}",
             f"Request throughput (req/s):      {s['request_throughput']:.2f}",
             f"Output token throughput (tok/s): {s['output_throughput']:.2f}",
             f"Total token throughput (tok/s):  {s['total_token_throughput']:.2f}"]
    for name, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                        ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        lines.append(f"---------- {title} ----------")
        for stat in ["mean", "median"] + [f"p{q:g}" for q in percentiles]:
            value = s[f"{stat}_{name}_ms"]
            label = stat.capitalize() if stat in ("mean", "median") else stat.upper()
            lines.append(f"{label + ' ' + name.upper() + ' (ms):':<33}{'n/a' if value is None else f'{value:.2f}'}")
    if args.multi_turn > 1:
        for name, title in (("first_turn", "first turns"), ("later_turns", "later turns")):
            value = s.get(f"median_ttft_{name}_ms")
            lines.append(f"{'Median TTFT, ' + title + ' (ms):':<33}{'n/a' if value is None else f'{value:.2f}'}")
    if s.get("errors"):
        lines.append("errors: " + " | ".join(s["errors"]))
    lines.append("=" * 50)
    results_json = {"base_url": url, "num_prompts": args.num_prompts, "request_rate": args.request_rate,
                    "max_concurrency": args.max_concurrency, "random_input_len": args.random_input_len,
                    "random_output_len": args.random_output_len, "random_prefix_len": args.random_prefix_len,
                    "multi_turn": args.multi_turn, **s}
    report(lines, results_json, args.output_json)
    return 0 if s["completed"] else 1
