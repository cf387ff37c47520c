"""LLM.chat with tools: the tools, template variables and tool-call history reach the chat template,
and the default model's answer under tests/tool_template.py parses into a reasoning and a call."""
import json

import pytest

from pipespec import SamplingParams
from pipespec.server.parsers.chat_output import ChatOutputParser
from pipespec.server.parsers.reasoning import reasoning_format
from pipespec.server.parsers.tool_calls import tool_call_format
from tests.tool_template import CITY, QUESTION, REASONING, TOOL_TEMPLATE, TOOLS

PROBE = ("{{ tools | map(attribute='function') | map(attribute='name') | join(',') }}|{{ enable_thinking }}|"
         "{% for m in messages %}{{ m.role }}:{% if m.tool_calls %}{{ m.tool_calls[0].function.name }}"
         "{{ m.tool_calls[0].function.arguments | tojson }}{% else %}{{ m.content }}{% endif %};{% endfor %}")


def test_tools_kwargs_and_history_reach_the_template(tokenizer):
    history = QUESTION + [
        {"role": "assistant", "content": None,
         "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}]},
        {"role": "tool", "content": "22 C"}]
    text = tokenizer.with_chat_template(PROBE).apply_chat_template(history, False, tools=TOOLS,
                                                                    enable_thinking=False)
    assert text == ('get_weather|False|user:What is the weather in Paris?;assistant:get_weather{"city": "Zürich"};'
                    "tool:22 C;")


def test_chat_answers_with_a_reasoning_and_a_tool_call(llm):
    out = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=64, skip_special_tokens=False),
                   use_tqdm=False, tools=TOOLS, chat_template=TOOL_TEMPLATE)[0]
    prompt = llm.get_tokenizer().decode(out.prompt_token_ids, skip_special_tokens=False)
    assert prompt.endswith("<think>") and '"name": "get_weather"' in prompt
    completion = out.outputs[0]
    assert completion.finish_reason == "stop"
    assert "<|im_end|>" not in completion.text          # the end token's text is not output
    parser = ChatOutputParser(reasoning_format("qwen3"), tool_call_format("hermes"), prompt, TOOLS)
    msg, finish = parser.message(completion.text, completion.finish_reason)
    assert finish == "tool_calls" and msg["content"] is None
    assert msg["reasoning_content"] == REASONING
    [call] = msg["tool_calls"]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": CITY}


def test_chat_refuses_a_message_without_content(llm):
    with pytest.raises(ValueError, match="message 0: needs a string 'role' and a string 'content'"):
        llm.chat([{"role": "user", "content": None}], use_tqdm=False)
