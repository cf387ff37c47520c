"""pipespec's tokenizer rebuilt from GGUF metadata encodes like transformers' reading of the same GGUF,
and its chat template renders the same ids."""
from __future__ import annotations

import pytest

TEXTS = [
    "Hello world",
    "The year 2024 had 366 days; pi is 3.14159 and 1,000,000 is a million.",
    "naïve café — déjà vu, Ünïcödé ✓ ∑ αβγ",
    "日本語のテキストと中文文本",
    "rocket 🚀 party 🎉🎊 family 👩‍👩‍👧",
    "line one\nline two\n\n\ttabbed  double  space   \n",
    "   leading and trailing spaces   ",
    "x = f'{a!r:>10}' + \"quotes\" # comment\r\nwindows line",
    "<|im_start|>user\nWhat's up?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text after a special token<|im_end|>",
    "don't, I'll, we've, they're, she'd, it's",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": "Count to 3."},
     {"role": "assistant", "content": "1, 2, 3."},
     {"role": "user", "content": "Now in French, with ünïcödé 🙂"}],
]


def _ids(encoded):
    # transformers 5 may return a BatchEncoding / dict from apply_chat_template(tokenize=True)
    if hasattr(encoded, "keys") and "input_ids" in encoded:
        encoded = encoded["input_ids"]
    if hasattr(encoded, "tolist"):
        encoded = encoded.tolist()
    if encoded and isinstance(encoded[0], list):
        assert len(encoded) == 1
        encoded = encoded[0]
    return list(encoded)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(tokenizer, hf_tokenizer, text):
    ours = tokenizer.encode(text)
    assert ours == hf_tokenizer.encode(text)
    assert tokenizer.encode(text, add_special_tokens=False) == hf_tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ours, skip_special_tokens=False) == hf_tokenizer.decode(ours, skip_special_tokens=False)
    assert tokenizer.decode(ours, skip_special_tokens=True) == hf_tokenizer.decode(ours, skip_special_tokens=True)
    assert tokenizer.decode(ours, skip_special_tokens=False) == text


def test_special_tokens_are_single_ids(tokenizer, hf_tokenizer):
    for special in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"):
        ids = tokenizer.encode(special, add_special_tokens=False)
        assert ids == [hf_tokenizer.convert_tokens_to_ids(special)]
    assert tokenizer.eos_token == hf_tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.eos_token_id == hf_tokenizer.eos_token_id
    assert tokenizer.vocab_size == len(hf_tokenizer)


@pytest.mark.parametrize("gen_prompt", [True, False])
@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
def test_chat_template_matches_transformers(tokenizer, hf_tokenizer, conv, gen_prompt):
    messages = CONVERSATIONS[conv]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=gen_prompt)
    ref_text = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=gen_prompt, tokenize=False)
    assert text == ref_text
    ours = tokenizer.encode(text, add_special_tokens=False)
    ref = _ids(hf_tokenizer.apply_chat_template(messages, add_generation_prompt=gen_prompt, tokenize=True))
    assert ours == ref
    assert text.endswith("<|im_start|>assistant\n") == gen_prompt


def test_llm_chat_uses_the_template(llm, hf_tokenizer):
    from pipespec import SamplingParams
    out = llm.chat(CONVERSATIONS[1], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)[0]
    assert out.prompt_token_ids == _ids(hf_tokenizer.apply_chat_template(CONVERSATIONS[1],
                                                                          add_generation_prompt=True, tokenize=True))


# -- --tokenizer and --chat-template (vLLM's flags) ----------------------------------------------


def test_chat_template_inline_file_and_errors(tmp_path):
    from pipespec.checkpoint.tokenizer import read_chat_template
    inline = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    assert read_chat_template(inline) == inline
    path = tmp_path / "t.jinja"
    path.write_text(inline)
    assert read_chat_template(str(path)) == inline
    with pytest.raises(FileNotFoundError, match="no such file, and not a template"):
        read_chat_template(str(tmp_path / "missing.jinja"))


def test_engine_applies_tokenizer_and_chat_template(tiny_models, tmp_path):
    import json
    import shutil

    from pipespec import LLM
    tok_folder = tmp_path / "tok"
    shutil.copytree(tiny_models["qwen2"][0], tok_folder)
    cfg = json.loads((tok_folder / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "TOK:{{ messages[0]['content'] }}"
    (tok_folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    kwargs = dict(model=str(tiny_models["qwen2"][0]), dtype="float32", device="cpu", max_model_len=64,
                  num_kv_blocks=16)
    messages = [{"role": "user", "content": "hi"}]
    with LLM(tokenizer=str(tok_folder), **kwargs) as llm:
        assert llm.get_tokenizer().apply_chat_template(messages) == "TOK:hi"
    with LLM(tokenizer=str(tok_folder), chat_template="<{{ messages[0]['content'] }}>", **kwargs) as llm:
        assert llm.get_tokenizer().apply_chat_template(messages) == "<hi>"
        out = llm.chat(messages, use_tqdm=False)[0]
        assert out.prompt_token_ids == llm.get_tokenizer().encode("<hi>")
    with pytest.raises(ValueError, match="chat template does not compile"):
        LLM(chat_template="{% for %}", **kwargs)


def test_a_tokenizer_file_is_parsed_once_per_version(tmp_path, tokenizer):
    """Engines of one process share the parsed tokenizer.json; a rewritten file is read again."""
    from tokenizers import Tokenizer as HFTokenizer

    from pipespec.checkpoint.tokenizer import read_tokenizer_file

    path = tmp_path / "tokenizer.json"
    tokenizer._tok.save(str(path))
    first = read_tokenizer_file(path)
    assert read_tokenizer_file(path) is first
    assert first.encode(TEXTS[1], add_special_tokens=False).ids == tokenizer.encode(TEXTS[1], add_special_tokens=False)
    edited = HFTokenizer.from_file(str(path))
    edited.add_tokens(["<|new_tool|>"])
    edited.save(str(path))
    again = read_tokenizer_file(path)
    assert again is not first
    assert again.token_to_id("<|new_tool|>") is not None and first.token_to_id("<|new_tool|>") is None
