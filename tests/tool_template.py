"""A chat template under which the default model (SmolLM2-135M-Instruct) answers with a reasoning
block and a tool call, so that tests see real generated text go through the parsers.

The template shows the model three earlier turns in which the assistant thought and then called the
first of the request's tools (its name and the tools' JSON come from the request: the tools reach
the template), then the request's own messages and a generation prompt that opens `<think>` itself
(as Qwen3.5's does). Greedy decoding copies the pattern: a short reasoning, `</think>`, a hermes
`<tool_call>` naming that tool, and `<|im_end|>` (its end-of-sequence token)."""

REASONING = "The user wants the weather, so I call the tool."
CITY = "Paris"

TOOL_TEMPLATE = (
    "{%- set fn = tools[0].function.name if tools else 'none' -%}"
    "<|im_start|>system\nYou may call these tools: {{ tools | tojson }}<|im_end|>\n"
    "{%- for i in range(3) %}"
    "<|im_start|>user\nWhat is the weather in " + CITY + "?<|im_end|>\n<|im_start|>assistant\n<think>\n"
    + REASONING + "\n</think>\n\n<tool_call>\n"
    '{"name": "{{ fn }}", "arguments": {"city": "' + CITY + '"}}\n</tool_call><|im_end|>\n'
    "{%- endfor %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n<think>\n{%- endif %}"
)

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
QUESTION = [{"role": "user", "content": "What is the weather in " + CITY + "?"}]
