"""What one client sends cannot stall the others: body size cap (413), prompt processing off the
event loop; the 400 for a missing body names the field; --max-queued-requests counts waiting requests."""
import asyncio
import json
import threading
import time

import httpx
import openai
import pytest

from pipespec.server.body_limit import DEFAULT_MAX_BODY_BYTES
from tests.live_server import LiveServer

AUTH = {"Authorization": "Bearer sk-test"}


@pytest.mark.serial
def test_body_over_the_cap_gets_413_naming_the_limit(server):
    body = json.dumps({"prompt": "hello " * (DEFAULT_MAX_BODY_BYTES // 6 + 10)}).encode()
    t0 = time.monotonic()
    r = httpx.post(f"{server.url}/v1/completions", content=body, timeout=60,
                   headers={**AUTH, "content-type": "application/json"})
    assert r.status_code == 413, r.text
    err = r.json()["error"]
    assert str(DEFAULT_MAX_BODY_BYTES) in err["message"] and "--max-request-body-bytes" in err["message"]
    assert time.monotonic() - t0 < 5
    # streamed without a Content-Length: refused as soon as it passes the cap
    chunks = (b"x" * 1_000_000 for _ in range(DEFAULT_MAX_BODY_BYTES // 1_000_000 + 2))
    r = httpx.post(f"{server.url}/v1/completions", content=chunks, headers=AUTH, timeout=60)
    assert r.status_code == 413 and "--max-request-body-bytes" in r.json()["error"]["message"]
    assert httpx.get(f"{server.url}/health").status_code == 200


@pytest.mark.serial
def test_health_answers_while_a_huge_prompt_is_tokenized(server):
    """A 4 MB prompt (under the cap) takes the server seconds to tokenize and refuse (it is far over
    max_model_len); /health meanwhile answers at once."""
    got = {}

    def big():
        t0 = time.monotonic()
        got["response"] = httpx.post(f"{server.url}/v1/completions", headers=AUTH, timeout=120,
                                     json={"prompt": "hello " * 700_000, "max_tokens": 4})
        got["seconds"] = time.monotonic() - t0

    t = threading.Thread(target=big)
    t.start()
    time.sleep(0.3)                       # the body is in; tokenizing has begun
    health = []
    while t.is_alive() and len(health) < 200:
        t0 = time.monotonic()
        assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
        health.append(time.monotonic() - t0)
        time.sleep(0.05)
    t.join(120)
    assert got["response"].status_code == 400 and "max_model_len" in got["response"].text
    assert got["seconds"] > 1.0, "the prompt was too quick to show anything"
    assert len(health) >= 3 and max(health) < 0.5, (got["seconds"], health)


@pytest.mark.parametrize("route,field", [("/v1/chat/completions", "messages"), ("/v1/completions", "prompt")])
def test_empty_body_names_the_missing_field(server, route, field):
    r = httpx.post(server.url + route, headers=AUTH, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and field in err["message"], err


@pytest.fixture(scope="module")
def one_seat_server():
    s = LiveServer("--max-num-seqs", "1", "--max-queued-requests", "1", "--max-model-len", "256")
    yield s
    s.stop()


def test_max_queued_requests_counts_only_waiting_requests(one_seat_server):
    """One request runs, one waits (accepted), a third is refused; then both complete."""
    url = one_seat_server.url

    async def main():
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
        running = await client.completions.create(model=None, prompt="Count to fifty:", max_tokens=60,
                                                  temperature=0, stream=True, extra_body={"ignore_eos": True})
        first = await asyncio.wait_for(running.__anext__(), 60)          # it is running now
        waiting = asyncio.create_task(client.completions.create(
            model=None, prompt="Hi", max_tokens=4, temperature=0, extra_body={"ignore_eos": True}))
        await asyncio.sleep(0.5)                                          # queued behind it
        with pytest.raises(openai.APIStatusError) as refused:
            await client.completions.create(model=None, prompt="Hello", max_tokens=4)
        rest = [c async for c in running]
        done = await asyncio.wait_for(waiting, 120)
        return first, rest, done, refused.value

    first, rest, done, refused = asyncio.run(main())
    assert refused.status_code == 503 and "waiting" in str(refused.message)
    assert rest[-1].choices[0].finish_reason == "length"
    assert done.choices[0].finish_reason == "length" and done.usage.completion_tokens == 4
