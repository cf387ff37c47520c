import pytest

from pipespec.server.parsers.reasoning import REASONING_PARSERS, reasoning_format
from tests.server.parsers.conftest import splits


def streamed(fmt, pieces, prompt=""):
    s = fmt.stream(prompt)
    reasoning, content = "", ""
    for p in pieces:
        r, c = s.feed(p)
        assert not (c and s._state == "reasoning")
        reasoning, content = reasoning + r, content + c
    r, c = s.finish()
    return reasoning + r, content + c


CASES = [
    # (parser, prompt tail, output, reasoning, content)
    ("qwen3", "<|im_start|>assistant\n", "<think>\nLet me think: 2+2=4.\n</think>\n\nIt is 4.", "Let me think: 2+2=4.",
     "It is 4."),
    ("qwen3", "<|im_start|>assistant\n<think>\n", "Hmm, héllo 天气.\n</think>\n\nDone é.", "Hmm, héllo 天气.", "Done é."),
    ("qwen3", "<think>\n\n</think>\n\n", "Just the answer.", "", "Just the answer."),    # enable_thinking=False
    ("qwen3", "<|im_start|>assistant\n", "No block at all <think> here.", "", "No block at all <think> here."),
    ("glm45", "<|assistant|>", "<think>short</think>answer", "short", "answer"),
    ("glm45", "<|assistant|><think>", "inside from the prompt</think>\nanswer", "inside from the prompt", "answer"),
    ("deepseek_r1", "<｜Assistant｜>", "reasoning without an opening tag</think>\n\nanswer",
     "reasoning without an opening tag", "answer"),
    ("deepseek_r1", "<｜Assistant｜><think>\n", "<think>\nboth</think>answer", "both", "answer"),
    ("deepseek_v3", "<｜Assistant｜><think>", "thinking mode</think>answer", "thinking mode", "answer"),
    ("deepseek_v3", "<｜Assistant｜></think>", "non-thinking answer", "", "non-thinking answer"),
    ("qwen3", "<think>\n", "cut short by max_tokens, still thinking", "cut short by max_tokens, still thinking", ""),
    ("qwen3", "<think>\n", "a</think>b </think> c", "a", "b </think> c"),     # a later end tag is content
    # Qwen3 calling a tool without closing the block: the call ends the reasoning
    ("qwen3", "<think>\n", "let me call it\n<tool_call>\n{}\n</tool_call>", "let me call it",
     "<tool_call>\n{}\n</tool_call>"),
    ("glm45", "<think>", "glm has no such rule <tool_call>", "glm has no such rule <tool_call>", ""),
]


@pytest.mark.parametrize("name,prompt,output,reasoning,content", CASES)
def test_split_whole_and_every_way_of_streaming(name, prompt, output, reasoning, content):
    fmt = reasoning_format(name)
    assert fmt.split(output, prompt) == (reasoning, content)
    for pieces in splits(output):
        assert streamed(fmt, pieces, prompt) == (reasoning, content), pieces


def test_reasoning_is_streamed_before_the_block_ends():
    s = reasoning_format("qwen3").stream("")
    assert s.feed("<think>") == ("", "")
    assert s.feed("step one") == ("step one", "")
    assert s.feed(" and two</th") == (" and two", "")       # the partial end tag is held
    assert s.feed("ink>\n\nAns") == ("", "Ans")
    assert s.feed("wer") == ("", "wer")


def test_every_parser_is_registered_and_unknown_names_are_refused():
    assert set(REASONING_PARSERS) == {"qwen3", "glm45", "deepseek_r1", "deepseek_v3"}
    with pytest.raises(ValueError, match="unknown reasoning parser 'nope'"):
        reasoning_format("nope")
