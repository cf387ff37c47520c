"""Load generator for `pipespec serve`: TTFT, inter-token latency and output tokens/s at several
concurrency levels, with real streaming HTTP clients.

Usage:
  python benchmarks/serve_load.py [--url http://127.0.0.1:8000] [--concurrency 1 8 32]
         [--requests-per-client 2] [--max-tokens 64] [--server-args "..."]
Without --url it starts `python -m pipespec serve` itself on a free port (with --server-args).
The requests and their measurement are `pipespec bench serve`'s (pipespec/bench/serve.py); this script
adds the concurrency sweep and starting the server.
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
import subprocess
import sys
import time

import httpx

from pipespec.bench.serve import run_load, summarize


def story_prompts(n: int, offset: int = 0) -> list[str]:
    return [f"Write a short story about robot number {offset + i} who learns to paint." for i in range(n)]


def level(url: str, concurrency: int, per_client: int, max_tokens: int) -> dict:
    """`concurrency` clients, each sending `per_client` requests one after another: the load
    generator of `pipespec bench serve` with at most `concurrency` requests in flight."""
    prompts = story_prompts(concurrency * per_client)
    results, wall = asyncio.run(run_load(url, prompts, max_tokens, max_concurrency=concurrency))
    failed = [r.error for r in results if not r.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed: {failed[0]}")
    s = summarize(results, wall, percentiles=())
    return {"concurrency": concurrency, "requests": len(results),
            "ttft_ms_median": round(s["median_ttft_ms"], 1),
            "itl_ms_median": round(s["median_itl_ms"], 1) if s["median_itl_ms"] is not None else None,
            "output_tokens_per_s": round(s["output_throughput"], 1)}


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
        level(url, 1, 1, 4)     # warm-up
        rows = [level(url, c, args.requests_per_client, args.max_tokens) for c in args.concurrency]
    finally:
        if proc is not None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(30)
    print(json.dumps({"date": time.strftime("%Y-%m-%d"), "machine": platform.machine(),
                      "server_args": args.server_args, "max_tokens": args.max_tokens, "levels": rows}, indent=1))


if __name__ == "__main__":
    main()
