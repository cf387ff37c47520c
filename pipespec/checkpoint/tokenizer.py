"""Tokenizer and chat template, from a Hugging Face folder or rebuilt from GGUF metadata."""
from __future__ import annotations

import datetime
import functools
import json
import os
from pathlib import Path
from typing import Callable

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, processors

# Split patterns of the BPE pre-tokenizers named by GGUF's tokenizer.ggml.pre (public facts).
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                 r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GGUF_SPLITS = {"gpt-2": None, "smollm": None, "default": None,
                "llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}
_CONTROL, _USER_DEFINED = 3, 4
_LONG_TEXT = 16384      # characters from which encoding releases the GIL


def read_chat_template(value: str) -> str:
    """vLLM's --chat-template: a file's path, or the template itself."""
    path = Path(value).expanduser()
    try:
        if path.is_file():
            return path.read_text()
    except OSError:           # a long inline template is no valid path
        pass
    if "{{" in value or "{%" in value:
        return value
    raise FileNotFoundError(f"chat template {value!r}: no such file, and not a template either "
                            "(an inline template contains {{ or {%)")


def read_tokenizer_file(path: Path) -> HFTokenizer:
    """A tokenizer.json, parsed once a process per version of the file: parsing a large vocabulary is
    slow, and every engine a process builds reads it (RESULTS.md). Shared: nothing in pipespec changes a
    parsed tokenizer."""
    stat = path.stat()
    return _parsed_tokenizer(str(path.resolve()), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=8)
def _parsed_tokenizer(path: str, mtime_ns: int, size: int) -> HFTokenizer:
    return HFTokenizer.from_file(path)


def _raise(message):
    raise TemplateError(message)


class Tokenizer:
    def __init__(self, tok: HFTokenizer, eos_token_ids: list[int], bos_token: str | None,
                 eos_token: str | None, chat_template: str | None):
        self._tok = tok
        self.eos_token_ids = eos_token_ids
        self.eos_token_id = eos_token_ids[0] if eos_token_ids else None
        self.bos_token, self.eos_token = bos_token, eos_token
        self.chat_template = chat_template
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
        env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False, sort_keys=False: json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, sort_keys=sort_keys)
        self._template = env.from_string(chat_template) if chat_template else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) < _LONG_TEXT:
            return self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        # `encode` holds the GIL throughout (seconds for megabytes of text, freezing every other
        # thread: a server's event loop, the engine loop); `encode_batch` releases it. One text gains
        # nothing from tokenizers' thread pool, which would only make a later fork() warn.
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def decode_stream(self, skip_special_tokens: bool = True) -> Callable[[int], str | None]:
        """Incremental decoding: a function of the next token id that returns the text it completes,
        or None while a character is still partial (tokenizers' DecodeStream, called without a
        Python frame of ours: the driver calls it for every token of every request)."""
        return functools.partial(decoders.DecodeStream(skip_special_tokens=skip_special_tokens).step, self._tok)

    def with_chat_template(self, template: str) -> "Tokenizer":
        """The same tokenizer with another chat template (ValueError if it does not compile)."""
        from jinja2.exceptions import TemplateSyntaxError
        try:
            return Tokenizer(self._tok, self.eos_token_ids, self.bos_token, self.eos_token, template)
        except TemplateSyntaxError as e:
            raise ValueError(f"the chat template does not compile: {e.message} (line {e.lineno})") from None

    def backend_json(self) -> str:
        """The tokenizer as tokenizers' JSON (what a grammar library builds its token view from)."""
        return self._tok.to_str()

    def save_json(self, path: Path) -> None:
        self._tok.save(str(path))

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, **kwargs) -> str:
        """Render a conversation. `tools`: OpenAI tool definitions, for templates that list them;
        other keywords reach the template as variables (e.g. enable_thinking=False for Qwen3,
        thinking=True for DeepSeek-V3.1)."""
        template = self._template
        if template is None:
            raise ValueError("this model has no chat template; use generate() with a plain prompt")
        return template.render(**kwargs, messages=messages, tools=tools, add_generation_prompt=add_generation_prompt,
                               bos_token=self.bos_token or "", eos_token=self.eos_token or "")

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def from_folder(cls, folder: Path) -> "Tokenizer":
        path = folder / "tokenizer.json"
        if not path.exists():
            raise FileNotFoundError(f"{folder} has no tokenizer.json")
        tok = read_tokenizer_file(path)
        cfg = _read_json(folder / "tokenizer_config.json")
        template = cfg.get("chat_template")
        if isinstance(template, list):   # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if (folder / "chat_template.jinja").exists():
            template = (folder / "chat_template.jinja").read_text()
        bos, eos = _token_str(cfg.get("bos_token")), _token_str(cfg.get("eos_token"))
        eos_ids = []
        gen_eos = _read_json(folder / "generation_config.json").get("eos_token_id")
        for value in ([gen_eos] if isinstance(gen_eos, int) else gen_eos or []):
            eos_ids.append(int(value))
        if eos is not None and tok.token_to_id(eos) is not None and tok.token_to_id(eos) not in eos_ids:
            eos_ids.insert(0, tok.token_to_id(eos))
        return cls(tok, eos_ids, bos, eos, template)

    @classmethod
    def from_gguf(cls, meta: dict) -> "Tokenizer":
        kind = meta.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(f"GGUF tokenizer model {kind!r} is not supported (only BPE 'gpt2'); "
                             "load the Hugging Face folder instead")
        pre = meta.get("tokenizer.ggml.pre", "default")
        if pre not in _GGUF_SPLITS:
            raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported; known: {', '.join(_GGUF_SPLITS)}")
        tokens: list[str] = meta["tokenizer.ggml.tokens"]
        types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
        vocab = {t: i for i, t in enumerate(tokens)}
        tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
        split = _GGUF_SPLITS[pre]
        if split is None:
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        else:
            tok.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, ty in zip(tokens, types) if ty == _CONTROL])
        tok.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, ty in zip(tokens, types) if ty == _USER_DEFINED])

        def token_at(key):
            idx = meta.get(key)
            return tokens[idx] if idx is not None and 0 <= idx < len(tokens) else None

        bos = token_at("tokenizer.ggml.bos_token_id")
        if meta.get("tokenizer.ggml.add_bos_token", False) and bos is not None:
            bos_id = meta["tokenizer.ggml.bos_token_id"]
            tok.post_processor = processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)])
        eos_id = meta.get("tokenizer.ggml.eos_token_id")
        eos_ids = [eos_id] if eos_id is not None else []
        eot = meta.get("tokenizer.ggml.eot_token_id")
        if eot is not None and eot not in eos_ids:
            eos_ids.append(eot)
        return cls(tok, eos_ids, bos, token_at("tokenizer.ggml.eos_token_id"),
                   meta.get("tokenizer.chat_template"))


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def _token_str(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value
