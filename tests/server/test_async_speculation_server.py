"""`pipespec serve` as it runs by default on a GPU, here on the CPU: async scheduling with fixed-K
speculation (verify steps continued before they return). Concurrent streams, some closed mid-way,
give the offline synchronous engine's greedy text, and every KV block comes back."""
import asyncio

import httpx
from openai import AsyncOpenAI

from pipespec import SamplingParams
from tests.live_server import LiveServer, metric

PROMPTS = [f"Story number {i}:" for i in range(8)]


def test_concurrent_streams_with_speculation_and_async_scheduling(llm):
    server = LiveServer("--device", "cpu", "--max-model-len", "512", "--max-num-seqs", "8", "--async-scheduling",
                        "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 3}')

    async def one(i: int, client: AsyncOpenAI, model: str) -> str | None:
        stream = await client.completions.create(model=model, prompt=PROMPTS[i], max_tokens=20, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True})
        text, n = "", 0
        async for chunk in stream:
            n += 1
            if i % 3 == 2 and n == 2:             # every third client walks away mid-stream
                await stream.close()
                return None
            text += chunk.choices[0].text if chunk.choices else ""
        return text

    async def main():
        client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", timeout=300, max_retries=0)
        model = (await client.models.list()).data[0].id
        return await asyncio.gather(*(one(i, client, model) for i in range(len(PROMPTS))))

    try:
        got = asyncio.run(main())
        metrics = ""
        for _ in range(100):                       # aborts reach the engine thread asynchronously
            metrics = httpx.get(f"{server.url}/metrics").text
            if metric(metrics, "pipespec:kv_cache_usage_perc") == 0.0 and metric(metrics, "pipespec:num_requests_running") == 0:
                break
            asyncio.run(asyncio.sleep(0.1))
    finally:
        server.stop()
    want = [o.outputs[0].text for o in
            llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True), use_tqdm=False)]
    assert [g for g in got if g is not None] == [w for w, g in zip(want, got) if g is not None]
    assert got.count(None) == 2
    assert metric(metrics, "pipespec:kv_cache_usage_perc") == 0.0

