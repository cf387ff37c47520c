"""Structured output on the driver: each constrained request's grammar matcher is request state (I1).

The matcher advances through the tokens the request accepts (`RequestGrammar.advance`). For each step
the driver computes the token bitmask of every verify row of each constrained line: row 0 from the
matcher's state, row j after the line's first j drafts, advanced through tentatively and rolled back;
past a draft the grammar refuses, rows keep an all-allowed mask (that draft is masked at the row
before it, so it is never accepted and the rows after it are never used). The plan carries the masks
(`StepPlan.grammar_masks`) to the last stage, which sets what they forbid to -inf before verifying
(`pipespec.sampling.apply_token_bitmask`), so the MTP drafter can stay unconstrained and greedy
output is the same with and without it.

The grammar library is llguidance (an optional dependency, extra `structured`), imported only when a
request asks for structured output; benchmarks/RESULTS.md says why this one.
"""
from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict

import numpy as np
import torch

from pipespec.sampling import StructuredOutputsParams

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'pipespec[structured]' (or pip install llguidance)"
# JSON as json.dumps writes it (one space after ',' and ':', no newlines): flexible whitespace lets a
# small model emit whitespace until max_tokens instead of closing the object
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
COMPILED_CACHE = 64      # distinct grammars kept compiled (a tool's schema comes with every call)


class GrammarCompiler:
    """The engine's grammar compiler: the tokenizer's llguidance view (built on the first request
    that needs it, ~0.4 s for a 49k vocabulary), a thread pool computing a step's masks, and the
    last COMPILED_CACHE grammars' fresh matchers, which a request with the same grammar copies
    (compiling and validating took ~1.8 ms a request, copying costs a fraction of it)."""

    def __init__(self, tokenizer, vocab_size: int):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.mask_width = (vocab_size + 31) // 32       # int32 words of one row's bitmask
        self._lock = threading.Lock()                   # the server compiles on worker threads
        self._ll_tokenizer = None
        self.executor = None
        self._compiled: OrderedDict[tuple, object] = OrderedDict()   # (kind, spec) -> unused matcher
        self.cache_hits = 0

    def _library(self):
        try:
            import llguidance
        except ImportError:
            raise ValueError(f"structured_outputs: structured output needs the llguidance library, which is not "
                             f"installed: {INSTALL_HINT}") from None
        with self._lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = llguidance.LLTokenizer(self._tokenizer.backend_json(), n_vocab=self.vocab_size,
                                                            eos_token=list(self._tokenizer.eos_token_ids))
                self.executor = llguidance.LLExecutor()
        return llguidance

    def compile(self, spec: StructuredOutputsParams) -> "RequestGrammar":
        """A fresh matcher for `spec`; ValueError naming the field when it does not compile."""
        llguidance = self._library()
        kind = spec.kind
        value = getattr(spec, kind)
        key = (kind, json.dumps(value, sort_keys=True) if isinstance(value, (dict, list)) else value)
        with self._lock:
            fresh = self._compiled.get(key)
            if fresh is not None:
                self._compiled.move_to_end(key)
                self.cache_hits += 1
                return RequestGrammar(fresh.deep_copy(), self)
        matcher = self._compile(llguidance, spec)
        with self._lock:
            self._compiled[key] = matcher.deep_copy()
            if len(self._compiled) > COMPILED_CACHE:
                self._compiled.popitem(last=False)
        return RequestGrammar(matcher, self)

    def _compile(self, llguidance, spec: StructuredOutputsParams):
        matcher_cls = llguidance.LLMatcher
        kind = spec.kind
        field = f"structured_outputs.{kind}"
        try:
            if kind == "json":
                schema = json.loads(spec.json) if isinstance(spec.json, str) else spec.json
                if not isinstance(schema, dict):
                    raise ValueError(f"a JSON schema is a JSON object, got {type(schema).__name__}")
                grammar = matcher_cls.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
            elif kind == "json_object":
                grammar = matcher_cls.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)
            elif kind == "regex":
                grammar = matcher_cls.grammar_from_regex(spec.regex)
            elif kind == "choice":
                grammar = matcher_cls.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice))
            else:                                        # Lark, or GBNF (converted to Lark)
                grammar = llguidance.grammar_from("grammar", spec.grammar)
        except ValueError as e:                          # (json.JSONDecodeError is one)
            raise ValueError(f"{field}: {e}") from None
        is_error, messages = matcher_cls.validate_grammar_with_warnings(grammar, self._ll_tokenizer)
        if is_error:
            raise ValueError(f"{field}: does not compile: {messages[0]}")
        matcher = matcher_cls(self._ll_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"{field}: does not compile: {matcher.get_error()}")
        return matcher


class RequestGrammar:
    """One request's matcher, at the end of its accepted tokens."""

    __slots__ = ("matcher", "compiler")

    def __init__(self, matcher, compiler: GrammarCompiler):
        self.matcher = matcher
        self.compiler = compiler

    def advance(self, token: int) -> bool:
        """Take an accepted token; False if the grammar refuses it (then the matcher is broken: the
        masks allow only tokens it takes, so this is a bug, and the request ends)."""
        return self.matcher.consume_token(token)

    @property
    def complete(self) -> bool:
        """Nothing but an end token can follow: the output is whole (the request finishes, "stop")."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str:
        return self.matcher.get_error()


def grammar_inputs(samplers: list, drafts: list[list[int]], num_rows: int) -> dict:
    """StepPlan fields (`grammar_lines`, `grammar_masks`) for sampling lines `samplers` verifying
    `drafts` (each line's real drafts) in lines of `num_rows` = 1 + K rows; empty when no line is
    constrained. One call computes every row's mask, drafts included, on the library's threads."""
    lines = [i for i, req in enumerate(samplers) if req.grammar is not None]
    if not lines:
        return {}
    compiler = samplers[lines[0]].grammar.compiler
    masks = np.full((len(lines) * num_rows, compiler.mask_width), -1, dtype=np.int32)
    jobs = [(samplers[i].grammar.matcher, j * num_rows, drafts[i]) for j, i in enumerate(lines)]
    args = (masks.ctypes.data, masks.shape[1] * 4, masks.shape[0])
    with_drafts = [job for job in jobs if job[2]]
    if with_drafts:
        compiler.executor.unsafe_compute_mask_ptr_with_draft_token(with_drafts, *args)
    if len(with_drafts) < len(jobs):             # (the library takes no empty draft list)
        compiler.executor.unsafe_compute_mask_ptr([job[:2] for job in jobs if not job[2]], *args)
    return {"grammar_lines": torch.tensor(lines, dtype=torch.int64), "grammar_masks": torch.from_numpy(masks)}
