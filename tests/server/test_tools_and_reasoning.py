"""Tools and reasoning end to end: a live `pipespec serve` with the hermes tool-call parser and the
qwen3 reasoning parser, the official `openai` client, and the default model answering with a
reasoning block and a tool call (tests/tool_template.py): real generated text goes through the
parsers, streamed and not, with MTP speculation off and on (K=3, the bundled head). Speculation
accepts several tokens a step, so tags arrive split in other places; it must not change any field."""
import json
import subprocess
import sys

import openai
import pytest
from openai import OpenAI

from tests.live_server import REPO, LiveServer, pipespec_env
from tests.tool_template import CITY, QUESTION, REASONING, TOOL_TEMPLATE, TOOLS

FLAGS = ("--max-model-len", "1024", "--max-num-seqs", "4", "--enable-auto-tool-choice",
         "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3")
MTP = ("--speculative-config", '{"method": "mtp", "num_speculative_tokens": 3}')
ASK = dict(messages=QUESTION, tools=TOOLS, max_tokens=64, temperature=0)


@pytest.fixture(scope="module")
def template_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("template") / "tool_template.jinja"
    path.write_text(TOOL_TEMPLATE)
    return str(path)


def _client(server):
    return OpenAI(base_url=f"{server.url}/v1", api_key="none", timeout=300, max_retries=0)


@pytest.fixture(scope="module")
def plain(template_file):
    s = LiveServer(*FLAGS, "--chat-template", template_file)
    yield _client(s)
    s.stop()


@pytest.fixture(scope="module")
def mtp(template_file):
    s = LiveServer(*FLAGS, *MTP, "--chat-template", template_file)
    yield _client(s)
    s.stop()


def model(client):
    return client.models.list().data[0].id


def whole(client) -> tuple[dict, str]:
    r = client.chat.completions.create(model=model(client), **ASK)
    msg = r.choices[0].message
    return {"content": msg.content, "reasoning_content": getattr(msg, "reasoning_content", "missing"),
            "calls": [(c.type, c.function.name, c.function.arguments) for c in msg.tool_calls or ()],
            "ids": [c.id for c in msg.tool_calls or ()]}, r.choices[0].finish_reason


def streamed(client) -> tuple[dict, str, list]:
    chunks = list(client.chat.completions.create(model=model(client), stream=True, **ASK))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    content = "".join(d.content or "" for d in deltas)
    reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    calls: dict[int, list] = {}
    for d in deltas:
        for tc in d.tool_calls or ():
            if tc.index not in calls:     # the first delta of a call: its id, type and name
                assert tc.id and tc.function.name and tc.type == "function", tc
                calls[tc.index] = [tc.type, tc.function.name, tc.function.arguments or "", tc.id]
            else:
                assert tc.id is None and not tc.function.name
                calls[tc.index][2] += tc.function.arguments or ""
    kinds = [("reasoning" if getattr(d, "reasoning_content", None) else "content" if d.content else
              "call" if d.tool_calls else None) for d in deltas]
    kinds = [k for k in kinds if k]
    return ({"content": content or None, "reasoning_content": reasoning or None,
             "calls": [tuple(c[:3]) for _, c in sorted(calls.items())], "ids": [c[3] for c in calls.values()]},
            finishes[-1], kinds)


def check(msg: dict, finish: str) -> None:
    assert finish == "tool_calls"
    assert msg["content"] is None                  # no markup, no blank text: the answer is the call
    assert msg["reasoning_content"] == REASONING
    [(kind, name, arguments)] = msg["calls"]
    assert (kind, name) == ("function", "get_weather")
    assert json.loads(arguments) == {"city": CITY}
    assert msg["ids"][0].startswith("call_")


def test_tool_call_and_reasoning_streamed_and_not_with_mtp_off_and_on(plain, mtp):
    results = {}
    for label, client in (("off", plain), ("mtp", mtp)):
        msg, finish = whole(client)
        check(msg, finish)
        smsg, sfinish, kinds = streamed(client)
        check(smsg, sfinish)
        assert kinds[0] == "reasoning" and kinds[-1] == "call" and "content" not in kinds
        assert kinds.index("call") > max(i for i, k in enumerate(kinds) if k == "reasoning")
        results[label] = [{k: v for k, v in m.items() if k != "ids"} for m in (msg, smsg)]
    assert results["mtp"] == results["off"]        # speculation changes no field


def test_tool_choice_none_keeps_the_reasoning_apart_and_the_markup_in_content(mtp):
    r = mtp.chat.completions.create(model=model(mtp), tool_choice="none", **ASK)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "stop" and not msg.tool_calls
    assert msg.reasoning_content == REASONING
    assert msg.content.startswith("<tool_call>") and '"get_weather"' in msg.content


@pytest.mark.parametrize("extra,match", [
    ({"tool_choice": "required"}, 'tool_choice "required" needs constrained decoding'),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "names function 'nope', which is not"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "thing"}}}]},
     "not a valid JSON Schema"),
])
def test_bad_tool_requests_get_400_naming_the_problem(plain, extra, match):
    with pytest.raises(openai.BadRequestError, match=match):
        plain.chat.completions.create(model=model(plain), **{**ASK, **extra})


@pytest.mark.parametrize("flags,match", [
    (["--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser"),
    (["--tool-call-parser", "hermes"], "is used with --enable-auto-tool-choice"),
    (["--reasoning-parser", "r9"], "invalid choice: 'r9'"),
])
def test_bad_flag_combinations_exit_2(flags, match):
    p = subprocess.run([sys.executable, "-m", "pipespec", "serve", *flags], cwd=REPO, env=pipespec_env(),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and match in p.stderr, p.stderr
