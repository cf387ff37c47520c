"""Tools and reasoning end to end: a live `pipespec serve` with the hermes tool-call parser and the
qwen3 reasoning parser, the official `openai` client, and the default model answering with a
reasoning block and a tool call (tests/tool_template.py): real generated text goes through the
parsers, streamed and not, with MTP speculation off and on (K=3, the bundled head). Speculation
accepts several tokens a step, so tags arrive split in other places; it must not change any field."""
import json
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from openai import OpenAI

from tests.live_server import LiveServer
from tests.tool_template import ARGUMENTS, CITY, QUESTION, REASONING, TOOLS, tool_template

pytestmark = pytest.mark.slow       # three servers, a few answers of ~60 tokens each

FLAGS = ("--max-model-len", "1024", "--max-num-seqs", "4", "--enable-auto-tool-choice", "--reasoning-parser", "qwen3")
MTP = ("--speculative-config", '{"method": "mtp", "num_speculative_tokens": 3}')
ASK = dict(messages=QUESTION, tools=TOOLS, max_tokens=96, temperature=0)


@pytest.fixture(scope="module")
def template_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("templates")


def _server(folder, parser: str, *more: str):
    """A live server with `parser` and a template whose earlier turns call in its format."""
    path = folder / f"{parser}.jinja"
    path.write_text(tool_template(parser))
    s = LiveServer(*FLAGS, "--tool-call-parser", parser, "--chat-template", str(path), *more)
    return s, OpenAI(base_url=f"{s.url}/v1", api_key="none", timeout=300, max_retries=0)


@pytest.fixture(scope="module")
def plain(template_dir):
    s, client = _server(template_dir, "hermes")
    yield client
    s.stop()


@pytest.fixture(scope="module")
def mtp(template_dir):
    s, client = _server(template_dir, "hermes", *MTP)
    yield client
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


def whole_and_streamed(client) -> tuple[tuple[dict, str], tuple[dict, str, list]]:
    """Both answers at once: the server runs them in the same steps (half the steps of one after the other)."""
    with ThreadPoolExecutor(2) as pool:
        first, second = pool.submit(whole, client), pool.submit(streamed, client)
        return first.result(timeout=600), second.result(timeout=600)


def check(msg: dict, finish: str, parser: str = "hermes") -> None:
    assert finish == "tool_calls"
    assert msg["content"] is None                  # no markup, no blank text: the answer is the call
    assert msg["reasoning_content"] == REASONING
    [(kind, name, arguments)] = msg["calls"]
    assert (kind, name) == ("function", "get_weather")
    assert json.loads(arguments) == ARGUMENTS[parser]
    assert msg["ids"][0].startswith("call_")


def test_tool_call_and_reasoning_streamed_and_not_with_mtp_off_and_on(plain, mtp):
    results = {}
    for label, client in (("off", plain), ("mtp", mtp)):
        (msg, finish), (smsg, sfinish, kinds) = whole_and_streamed(client)
        check(msg, finish)
        check(smsg, sfinish)
        assert kinds[0] == "reasoning" and kinds[-1] == "call" and "content" not in kinds
        assert kinds.index("call") > max(i for i, k in enumerate(kinds) if k == "reasoning")
        results[label] = [{k: v for k, v in m.items() if k != "ids"} for m in (msg, smsg)]
    assert results["mtp"] == results["off"]        # speculation changes no field


def test_qwen3_coder_calls_typed_by_the_schema_with_mtp(template_dir):
    s, client = _server(template_dir, "qwen3_coder", *MTP)
    try:
        (msg, finish), (smsg, sfinish, _) = whole_and_streamed(client)
        check(msg, finish, "qwen3_coder")             # "days": 3, an integer as the tool's schema says
        check(smsg, sfinish, "qwen3_coder")
        assert smsg["calls"] == msg["calls"]
    finally:
        s.stop()


def test_tool_choice_none_keeps_the_reasoning_apart_and_the_markup_in_content(mtp):
    r = mtp.chat.completions.create(model=model(mtp), tool_choice="none", **ASK)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "stop" and not msg.tool_calls
    assert msg.reasoning_content == REASONING
    assert msg.content.startswith("<tool_call>") and '"get_weather"' in msg.content


def test_thinking_off_through_chat_template_kwargs(mtp):
    r = mtp.chat.completions.create(model=model(mtp), extra_body={"chat_template_kwargs": {"enable_thinking": False}},
                                    **ASK)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls"
    assert msg.reasoning_content is None and msg.content is None        # the prompt closed the block
    assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == \
        [("get_weather", {"city": CITY})]


def test_history_with_a_tool_call_and_its_result_is_accepted(plain):
    history = QUESTION + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "22 C and sunny"}]
    r = plain.chat.completions.create(model=model(plain), **{**ASK, "messages": history, "max_tokens": 1})
    assert r.choices[0].finish_reason in ("length", "stop", "tool_calls")
    assert r.usage.prompt_tokens > 100


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
def test_bad_flag_combinations_exit_2(flags, match, capsys):
    """Refused before any engine starts: `pipespec serve`'s own entry point, run in this process (a
    process each cost more than the check; tests/cli runs the command as a process)."""
    from pipespec.cli import main
    try:
        code = main(["serve", *flags])
    except SystemExit as e:                 # argparse's own refusals
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and match in err, err
