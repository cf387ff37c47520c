"""Structured output through the official `openai` client: response_format (json_schema, json_object),
vLLM's structured_outputs and guided_* extra-body fields, streamed too; a grammar that does not compile
is a 400 naming the field, and the server keeps serving."""
import json
import re

import httpx
import jsonschema
import pytest
from openai import BadRequestError

CITY = {"type": "object", "additionalProperties": False, "required": ["city", "country"],
        "properties": {"city": {"type": "string", "maxLength": 20}, "country": {"type": "string", "maxLength": 20}}}
ASK = [{"role": "user", "content": "Name a big city and its country, as JSON."}]


def test_response_format_json_schema(client, model):
    r = client.chat.completions.create(model=model, messages=ASK, max_tokens=40, temperature=0,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "city", "schema": CITY, "strict": True}})
    jsonschema.validate(json.loads(r.choices[0].message.content), CITY)
    assert r.choices[0].finish_reason == "stop"


def test_json_object_streamed(client, model):
    stream = client.chat.completions.create(
        model=model, max_tokens=40, temperature=0, stream=True, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": 'Return {"city": <the capital of France>} as JSON.'}])
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert isinstance(json.loads(text), dict) and chunks[-1].choices[0].finish_reason == "stop"


def test_structured_outputs_and_guided_fields(client, model):
    r = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8, temperature=0,
                                  extra_body={"structured_outputs": {"choice": ["Paris", "Lyon", "Nice"]}})
    assert r.choices[0].text in ("Paris", "Lyon", "Nice")
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "A code?"}], max_tokens=12,
                                       temperature=0, extra_body={"guided_regex": "[A-Z]{2}-[0-9]{3}"})
    assert re.fullmatch("[A-Z]{2}-[0-9]{3}", r.choices[0].message.content)


@pytest.mark.parametrize("body, param, words", [
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"type": 7}}}}}},
     "response_format", "response_format.json_schema.schema: does not compile"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format",
     "schema object is required"),
    ({"response_format": {"type": "xml"}}, "response_format", "'text', 'json_object' or 'json_schema'"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs", "structured_outputs.regex: does not compile"),
    ({"structured_outputs": {"yaml": "a: b"}}, "structured_outputs", "unknown keys ['yaml']"),
    ({"guided_json": "{not json"}, "guided_json", "guided_json: "),
    ({"guided_choice": ["a"], "response_format": {"type": "json_object"}}, "guided_choice", "at most one"),
])
def test_bad_grammar_is_a_400_naming_the_field(server, body, param, words):
    r = httpx.post(f"{server.url}/v1/chat/completions", headers={"Authorization": "Bearer sk-test"}, timeout=60,
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err


def test_after_a_bad_grammar_the_server_keeps_serving(client, model):
    with pytest.raises(BadRequestError, match="does not compile"):
        client.chat.completions.create(model=model, messages=ASK, max_tokens=4, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "required": 5}}})
    r = client.chat.completions.create(model=model, messages=ASK, max_tokens=4, temperature=0)
    assert r.choices[0].message.content
