"""Why structured output uses llguidance: compile time and the driver's time to compute one step's
token masks for a batch of constrained requests, llguidance against xgrammar, on the default model's
tokenizer (49,152 tokens). Each request follows the same valid output token by token (a JSON object
for the schema, a code for the regex); a step computes every request's mask (llguidance: its thread
pool over the batch, as pipespec's driver does; xgrammar: one matcher after another, as its
documented loop does, and its batch helper where it has one). Medians over the steps.

    pip install llguidance xgrammar   # xgrammar also needs apache-tvm-ffi
    python benchmarks/grammar_masks.py --batch 1 64
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "skills"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                         "skills": {"type": "array", "items": {"type": "string"}}}}
OUTPUTS = {"json_schema": json.dumps({"name": "Ada Lovelace", "age": 36, "skills": ["maths", "poetry", "engines"]}),
           "regex": "123-abcdef"}
REGEX = r"[0-9]{3}-[a-z]{2,6}"


def run_llguidance(tok, vocab, kind, batch, ids):
    import llguidance
    t = time.perf_counter()
    ll_tok = llguidance.LLTokenizer(tok.backend_json(), n_vocab=vocab, eos_token=list(tok.eos_token_ids))
    tok_secs = time.perf_counter() - t
    t = time.perf_counter()
    grammar = (llguidance.LLMatcher.grammar_from_json_schema(SCHEMA) if kind == "json_schema"
               else llguidance.LLMatcher.grammar_from_regex(REGEX))
    matchers = [llguidance.LLMatcher(ll_tok, grammar) for _ in range(batch)]
    compile_secs = (time.perf_counter() - t) / batch
    ex = llguidance.LLExecutor()
    masks = np.zeros((batch, (vocab + 31) // 32), dtype=np.int32)
    steps = []
    for token in ids:
        t = time.perf_counter()
        ex.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], masks.ctypes.data, masks.shape[1] * 4,
                                   batch)
        steps.append(time.perf_counter() - t)
        for m in matchers:
            assert m.consume_token(token)
    return tok_secs, compile_secs, steps


def run_xgrammar(tok, vocab, kind, batch, ids, hf_tok):
    import xgrammar as xgr
    t = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(hf_tok, vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info)
    tok_secs = time.perf_counter() - t
    t = time.perf_counter()
    compiled = (compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False) if kind == "json_schema"
                else compiler.compile_regex(REGEX))
    compile_secs = time.perf_counter() - t            # one compile; matchers share it
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(batch)]
    masks = xgr.allocate_token_bitmask(batch, vocab)
    batch_fill = xgr.BatchGrammarMatcher() if hasattr(xgr, "BatchGrammarMatcher") else None
    steps = []
    for token in ids:
        t = time.perf_counter()
        if batch_fill is not None and batch > 1:
            batch_fill.batch_fill_next_token_bitmask(matchers, masks)
        else:
            for i, m in enumerate(matchers):
                m.fill_next_token_bitmask(masks, i)
        steps.append(time.perf_counter() - t)
        for m in matchers:
            assert m.accept_token(token)
    return tok_secs, compile_secs, steps


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    args = ap.parse_args()
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer as HFTokenizer
    from pipespec import LLM
    llm = LLM(device="cpu", dtype="float32", max_model_len=256, num_kv_blocks=32)
    tok, vocab = llm.get_tokenizer(), llm.engine.arch.vocab_size
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=HFTokenizer.from_str(tok.backend_json()))
    llm.shutdown()
    print(f"torch threads {torch.get_num_threads()}")
    for kind, text in OUTPUTS.items():
        ids = tok.encode(text, add_special_tokens=False)
        for batch in args.batch:
            for name, fn in (("llguidance", lambda: run_llguidance(tok, vocab, kind, batch, ids)),
                             ("xgrammar", lambda: run_xgrammar(tok, vocab, kind, batch, ids, hf_tok))):
                tok_secs, compile_secs, steps = fn()
                print(json.dumps({"library": name, "grammar": kind, "batch": batch, "tokens": len(ids),
                                  "tokenizer_setup_s": round(tok_secs, 3), "compile_ms": round(compile_secs * 1e3, 2),
                                  "step_mask_ms_median": round(statistics.median(steps) * 1e3, 3),
                                  "step_mask_ms_max": round(max(steps) * 1e3, 3)}), flush=True)


if __name__ == "__main__":
    main()
