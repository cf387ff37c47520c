"""Chat templates under which the default model (SmolLM2-135M-Instruct) answers with a reasoning
block and a tool call, so that tests see real generated text go through the parsers.

A template shows the model three earlier turns in which the assistant thought and then called the
first of the request's tools in a family's markup (the tool's name and the tools' JSON come from the
request: the tools reach the template), then the request's own messages and a generation prompt
that opens `<think>` itself (as Qwen3.5's does). Greedy decoding copies the pattern: a short
reasoning, `</think>`, the call naming that tool, and `<|im_end|>` (its end-of-sequence token).
With the template variable enable_thinking=False (from chat_template_kwargs) the earlier turns have
empty reasoning blocks and the prompt closes the block itself (`<think></think>`, as GLM-4.5's does
with thinking off): the model answers with the call alone."""

REASONING = "The user wants the weather, so I call the tool."
CITY = "Paris"

# the call of the earlier turns, per tool-call parser ({{ fn }}: the first tool's name)
CALLS = {
    "hermes": '<tool_call>\n{"name": "{{ fn }}", "arguments": {"city": "' + CITY + '"}}\n</tool_call>',
    "qwen3_coder": "<tool_call>\n<function={{ fn }}>\n<parameter=city>\n" + CITY + "\n</parameter>\n"
                   "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
}
# the arguments the model's call carries (qwen3_coder's `days` typed as the schema's integer)
ARGUMENTS = {"hermes": {"city": CITY}, "qwen3_coder": {"city": CITY, "days": 3}}


def tool_template(parser: str = "hermes") -> str:
    return (
        "{%- set fn = tools[0].function.name if tools else 'none' -%}"
        "{%- set thinking = enable_thinking is not defined or enable_thinking -%}"
        "<|im_start|>system\nYou may call these tools: {{ tools | tojson }}<|im_end|>\n"
        "{%- for i in range(3) %}"
        "<|im_start|>user\nWhat is the weather in " + CITY + "?<|im_end|>\n<|im_start|>assistant\n"
        "<think>{% if thinking %}\n" + REASONING + "\n{% endif %}</think>\n\n" + CALLS[parser] + "<|im_end|>\n"
        "{%- endfor %}"
        "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor %}"
        "{%- if add_generation_prompt %}<|im_start|>assistant\n<think>{% if not thinking %}</think>{% endif %}"
        "{%- endif %}"
    )


TOOL_TEMPLATE = tool_template()
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}]
QUESTION = [{"role": "user", "content": "What is the weather in " + CITY + "?"}]
