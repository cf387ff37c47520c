"""Command line: `pipespec generate ...` (serve, bench and train-mtp join as they land)."""
from __future__ import annotations

import argparse
import logging
import sys


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine flags shared by every command, named as vLLM names them."""
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None, help="Hugging Face folder or GGUF file (default: SmolLM2-135M-Instruct)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--num-kv-blocks", type=int, default=None)
    g.add_argument("--kv-cache-memory", type=int, default=None, help="bytes for the KV cache")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int, default=1024)
    g.add_argument("--no-chunked-prefill", action="store_true")


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(model=args.model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
                block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
                kv_cache_memory=args.kv_cache_memory, gpu_memory_utilization=args.gpu_memory_utilization,
                max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                enable_chunked_prefill=not args.no_chunked_prefill)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pipespec", description=__doc__)
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete prompts and print the completions")
    add_engine_args(gen)
    s = gen.add_argument_group("sampling")
    s.add_argument("--max-tokens", type=int, default=64)
    s.add_argument("--temperature", type=float, default=0.0)
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--top-k", type=int, default=-1)
    s.add_argument("--min-p", type=float, default=0.0)
    s.add_argument("--seed", type=int, default=None)
    s.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    s.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    gen.add_argument("prompts", nargs="+", metavar="PROMPT")
    gen.set_defaults(func=_generate)
    return parser


def _generate(args) -> int:
    from pipespec import LLM, SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, min_p=args.min_p, seed=args.seed, stop=args.stop,
                            ignore_eos=args.ignore_eos)
    with LLM(**engine_kwargs(args)) as llm:
        if args.chat:
            outs = llm.chat([[{"role": "user", "content": p}] for p in args.prompts], params)
        else:
            outs = llm.generate(args.prompts, params)
    for prompt, out in zip(args.prompts, outs):
        c = out.outputs[0]
        print(f"### prompt: {prompt!r}  ({len(out.prompt_token_ids)} tokens)")
        print(c.text)
        print(f"### {len(c.token_ids)} tokens, finish_reason={c.finish_reason}\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
