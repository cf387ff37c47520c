"""Stop a `pipespec serve` during a long stream and report what the client got (issue 48 item 4).

    python benchmarks/shutdown_probe.py [REPO] [--signal TERM|INT] [-- serve flags...]

Starts `python -m pipespec serve` from REPO (default: this checkout), streams a 1,500-token
completion with the official openai client, sends the signal after 20 chunks, and prints: chunks
received, the last chunk's finish_reason, whether the stream ended cleanly or with an error, the
exit status and time, and the tracebacks in the server log.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai


def main() -> None:
    args = sys.argv[1:]
    extra = args[args.index("--") + 1:] if "--" in args else []
    args = args[:args.index("--")] if "--" in args else args
    sig = signal.SIGINT if "--signal" in args and args[args.index("--signal") + 1] == "INT" else signal.SIGTERM
    repo = Path(args[0]) if args and not args[0].startswith("--") else Path(__file__).resolve().parents[1]
    port = 8000 + os.getpid() % 1000
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    env = dict(os.environ, PYTHONPATH=str(repo), TOKENIZERS_PARALLELISM="false")
    proc = subprocess.Popen([sys.executable, "-m", "pipespec", "--log-level", "INFO", "serve", "--port", str(port),
                             *extra], cwd=repo, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.2)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    chunks, outcome, signalled = [], "ended cleanly", None
    try:
        stream = client.completions.create(model=httpx.get(f"{url}/v1/models").json()["data"][0]["id"],
                                           prompt="Tell me a long story", max_tokens=1500, stream=True,
                                           extra_body={"ignore_eos": True})
        for chunk in stream:
            chunks.append(chunk)
            if len(chunks) == 20:
                proc.send_signal(sig)
                signalled = time.monotonic()
    except Exception as e:  # noqa: BLE001 (what the user sees)
        outcome = f"{type(e).__name__}: {e}"
    code = proc.wait(60)
    exit_time = time.monotonic() - signalled
    text = Path(log.name).read_text()
    last = chunks[-1].choices[0].finish_reason if chunks and chunks[-1].choices else None
    print(f"signal {sig.name}: {len(chunks)} chunks, last finish_reason={last}, stream {outcome}; "
          f"exit {code} after {exit_time:.2f}s; tracebacks in log: {text.count('Traceback')}, "
          f"CancelledError: {text.count('CancelledError')}")


if __name__ == "__main__":
    main()
