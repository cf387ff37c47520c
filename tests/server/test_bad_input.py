"""Bad input gets a 4xx with an OpenAI-style body naming the problem; the server stays healthy."""
import asyncio
import json
import threading

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings

AUTH = {"Authorization": "Bearer sk-test"}
LONG = "word " * 9000      # far beyond max_model_len (8192)

CASES = [
    # (route, raw body, status, words the message must contain)
    ("/v1/completions", b"{not json", 400, ["json"]),
    ("/v1/completions", b"[1, 2]", 400, []),
    ("/v1/completions", json.dumps({"prompt": 3}).encode(), 400, ["prompt"]),
    ("/v1/completions", json.dumps({"prompt": "hi", "max_tokens": "ten"}).encode(), 400, ["max_tokens"]),
    ("/v1/completions", json.dumps({"prompt": "hi", "max_tokens": -1}).encode(), 400, ["max_tokens"]),
    ("/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 10**9}).encode(), 400, ["max_tokens"]),
    ("/v1/completions", json.dumps({"prompt": "hi", "model": "gpt-9"}).encode(), 404, ["gpt-9"]),
    ("/v1/completions", json.dumps({"prompt": "hi", "temperature": -1}).encode(), 400, ["temperature"]),
    ("/v1/completions", json.dumps({"prompt": "hi", "top_p": 0}).encode(), 400, ["top_p"]),
    ("/v1/completions", json.dumps({"prompt": "hi", "n": 33}).encode(), 400, ["n=33", "max_num_seqs"]),
    ("/v1/completions", json.dumps({"prompt": "hi", "n": 0}).encode(), 400, ["n"]),
    ("/v1/completions", json.dumps({"prompt": "hi", "logprobs": 21}).encode(), 400, ["logprobs", "20"]),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                                          "top_logprobs": 21}).encode(), 400, ["top_logprobs", "20"]),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "hi"}],
                                          "top_logprobs": 2}).encode(), 400, ["top_logprobs", "logprobs: true"]),
    ("/v1/completions", json.dumps({"prompt": "hi", "presence_penalty": 3.0}).encode(), 400, ["presence_penalty"]),
    ("/v1/completions", json.dumps({"prompt": "hi", "logit_bias": {"999999": 1}}).encode(), 400,
     ["logit_bias", "vocabulary"]),
    ("/v1/completions", json.dumps({"prompt": "hi", "logit_bias": {"x": 1}}).encode(), 400, ["logit_bias"]),
    ("/v1/completions", json.dumps({"prompt": "hi", "bogus_field": 1}).encode(), 400, ["bogus_field"]),
    ("/v1/completions", json.dumps({"prompt": ""}).encode(), 400, ["empty"]),
    ("/v1/completions", json.dumps({"prompt": [1, 2, 10**7]}).encode(), 400, ["prompt_token_ids"]),
    ("/v1/completions", json.dumps({"prompt": LONG}).encode(), 400, ["max_model_len"]),
    ("/v1/chat/completions", json.dumps({"messages": []}).encode(), 400, ["messages"]),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "wizard", "content": "x"}]}).encode(), 400, ["role"]),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "user"}]}).encode(), 400, ["content"]),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}).encode(), 400,
     ["image_url", "text only"]),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": "http://x/v.mp4"}}]}]}).encode(), 400, ["video", "text only"]),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "hi"}],
                                          "stream_options": {"include_usage": True}}).encode(), 400, ["stream"]),
]


@pytest.mark.parametrize("route,body,status,words", CASES, ids=[f"{i}" for i in range(len(CASES))])
def test_bad_request_is_refused_with_a_clear_error(server, route, body, status, words):
    r = httpx.post(server.url + route, content=body, headers={**AUTH, "content-type": "application/json"},
                   timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"]
    for w in words:
        assert w.lower() in err["message"].lower(), err


def test_bad_input_does_not_disturb_a_running_stream(server):
    got = {}

    def stream():
        with httpx.stream("POST", f"{server.url}/v1/completions", headers=AUTH, timeout=120,
                          json={"prompt": "Tell me a story", "max_tokens": 40, "temperature": 0,
                                "ignore_eos": True, "stream": True,
                                "stream_options": {"include_usage": True}}) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
        got["lines"] = lines

    t = threading.Thread(target=stream)
    t.start()
    for _, body, status, _ in CASES[:8]:
        httpx.post(f"{server.url}/v1/completions", content=body,
                   headers={**AUTH, "content-type": "application/json"}, timeout=60)
    t.join(120)
    assert not t.is_alive()
    lines = got["lines"]
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["usage"]["completion_tokens"] == 40
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}


@pytest.mark.serial
def test_overload_gets_503_not_unbounded_queueing(server):
    """64 requests may wait to run (--max-queued-requests); beyond, 503 (tests/server/test_lifecycle.py
    checks that running requests do not count)."""
    async def main():
        async with httpx.AsyncClient(timeout=300) as c:
            reqs = [c.post(f"{server.url}/v1/completions", headers=AUTH,
                           json={"prompt": f"Item {i}", "max_tokens": 6, "ignore_eos": True}) for i in range(100)]
            return await asyncio.gather(*reqs)

    responses = asyncio.run(main())
    codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 503}
    assert codes.count(200) >= 64 and codes.count(503) >= 1, codes
    refused = next(r for r in responses if r.status_code == 503).json()["error"]
    assert "--max-queued-requests" in refused["message"] and refused["type"] == "server_overloaded"
    assert httpx.get(f"{server.url}/health").status_code == 200


@pytest.fixture(scope="session")
def api_schema(small_server):
    return schemathesis.openapi.from_url(f"{small_server.url}/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
def test_fuzz_never_5xx(case):
    response = case.call(timeout=120)
    assert response.status_code < 500, (case.path, case.body, response.text[:300])
