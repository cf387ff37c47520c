"""Load generator for `pipespec serve`: TTFT, inter-token latency and output tokens/s at several
concurrency levels, with real streaming HTTP clients.

Usage:
  python benchmarks/serve_load.py [--url http://127.0.0.1:8000] [--concurrency 1 8 32]
         [--requests-per-client 2] [--max-tokens 64] [--server-args "..."]
Without --url it starts `python -m pipespec serve` itself on a free port (with --server-args).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time

import httpx


async def one_request(client: httpx.AsyncClient, url: str, i: int, max_tokens: int) -> dict:
    body = {"prompt": f"Write a short story about robot number {i} who learns to paint.",
            "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, "stream": True}
    t0 = time.perf_counter()
    stamps = []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                if json.loads(line[6:])["choices"][0]["text"]:
                    stamps.append(time.perf_counter())
    return {"ttft": stamps[0] - t0, "itl": [b - a for a, b in zip(stamps, stamps[1:])],
            "tokens": max_tokens, "end": time.perf_counter()}


async def level(url: str, concurrency: int, per_client: int, max_tokens: int) -> dict:
    async with httpx.AsyncClient(timeout=600) as client:
        async def worker(w):
            return [await one_request(client, url, w * 1000 + k, max_tokens) for k in range(per_client)]
        t0 = time.perf_counter()
        results = [r for rs in await asyncio.gather(*(worker(w) for w in range(concurrency))) for r in rs]
        wall = time.perf_counter() - t0
    itl = [x for r in results for x in r["itl"]]
    return {"concurrency": concurrency, "requests": len(results),
            "ttft_ms_median": round(1000 * statistics.median(r["ttft"] for r in results), 1),
            "itl_ms_median": round(1000 * statistics.median(itl), 1) if itl else None,
            "output_tokens_per_s": round(sum(r["tokens"] for r in results) / wall, 1)}


def start_server(server_args: str) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "pipespec", "--log-level", "WARNING", "serve", "--port",
                             str(port), *shlex.split(server_args)], start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)
    raise RuntimeError("server did not start")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default=None)
    ap.add_argument("--server-args", default="--max-num-seqs 64")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--requests-per-client", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    proc, url = (None, args.url) if args.url else start_server(args.server_args)
    try:
        asyncio.run(level(url, 1, 1, 4))     # warm-up
        rows = [asyncio.run(level(url, c, args.requests_per_client, args.max_tokens)) for c in args.concurrency]
    finally:
        if proc is not None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(30)
    print(json.dumps({"date": time.strftime("%Y-%m-%d"), "machine": platform.machine(),
                      "server_args": args.server_args, "max_tokens": args.max_tokens, "levels": rows}, indent=1))


if __name__ == "__main__":
    main()
