"""pipespec: an LLM inference engine with MTP speculative decoding under pipeline parallelism.

Commands: generate (complete prompts), serve (OpenAI-compatible server), bench (latency, throughput,
serve load), train-mtp and eval-mtp (draft heads). `pipespec COMMAND --help` lists each one's flags.
"""
from __future__ import annotations

import argparse
import logging
import sys
import time

from pipespec.engine.args import add_engine_args, engine_kwargs


LOG_LEVELS = ["DEBUG", "INFO", "WARNING", "ERROR"]


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Every flag's help ends with its default (vLLM's --help shows them too); switches and flags
    without a default say nothing."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (default is None or default is argparse.SUPPRESS or isinstance(default, bool)
                or not action.option_strings or "default" in text):
            return text
        return f"{text} (default: %(default)s)" if text else "(default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    from pipespec import __version__

    parser = argparse.ArgumentParser(prog="pipespec", description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"pipespec {__version__}")
    parser.add_argument("--log-level", default="INFO", choices=LOG_LEVELS,
                        help="also accepted after the command (`pipespec serve --log-level DEBUG`)")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete prompts and print the completions")
    add_engine_args(gen)
    s = gen.add_argument_group("sampling")
    s.add_argument("--max-tokens", type=int, default=None,
                   help="tokens to generate per prompt at most (default: until the model ends its answer, "
                        "bounded by --max-model-len)")
    s.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    s.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    s.add_argument("--top-k", type=int, default=-1, help="-1: all tokens")
    s.add_argument("--min-p", type=float, default=0.0, help="drop tokens below this fraction of the top one")
    s.add_argument("--seed", type=int, default=None,
                   help="seed of each prompt's sampling: the same seed draws the same text "
                        "(default: fresh randomness every run)")
    s.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    s.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    gen.add_argument("prompts", nargs="+", metavar="PROMPT")
    gen.set_defaults(func=_generate)

    from pipespec.train.args import add_draft_vocab_args, add_eval_args, add_train_args

    train = sub.add_parser("train-mtp", help="train an MTP draft head on top of a frozen target")
    add_train_args(train)
    train.set_defaults(func=_train_mtp)
    ev = sub.add_parser("eval-mtp", help="teacher-forced agreement of an MTP head with its target, per step")
    add_eval_args(ev)
    ev.set_defaults(func=_eval_mtp)
    dv = sub.add_parser("draft-vocab", help="write a draft vocabulary: the tokens most frequent in a model's answers")
    add_draft_vocab_args(dv)
    dv.set_defaults(func=_draft_vocab)
    from pipespec.server.serve import add_serve_parser
    add_serve_parser(sub, add_engine_args)
    _add_bench_parser(sub, add_engine_args)
    _use_formatter(parser)
    return parser


def _add_bench_parser(sub, add_engine_args) -> None:
    """`pipespec bench latency | throughput | serve`."""
    import pipespec.bench
    from pipespec.bench import latency, serve, throughput

    bench = sub.add_parser("bench", help="measure latency, throughput or a server under load",
                           description=pipespec.bench.__doc__)
    kinds = bench.add_subparsers(dest="bench_command", required=True, metavar="{latency,throughput,serve}")
    for name, module, text, engine in (
            ("latency", latency, "time one batch of fixed-length requests, over iterations", True),
            ("throughput", throughput, "tokens per second over many requests at once", True),
            ("serve", serve, "load a running OpenAI-compatible server: TTFT, TPOT, ITL", False)):
        p = kinds.add_parser(name, help=text, description=module.__doc__)
        if engine:
            add_engine_args(p)
        module.add_args(p)
        p.set_defaults(func=module.run)


def _use_formatter(parser: argparse.ArgumentParser) -> None:
    """Give every subcommand's parser (at any depth) the formatter that shows defaults, and --log-level
    (kept from before the command unless given after it)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                sub.formatter_class = HelpFormatter
                if "--log-level" not in sub._option_string_actions:
                    sub.add_argument("--log-level", default=argparse.SUPPRESS, choices=LOG_LEVELS,
                                     help="as before the command (default: INFO)")
                _use_formatter(sub)


def _option_strings(parser: argparse.ArgumentParser) -> set[str]:
    """Every flag any command (at any depth) defines."""
    names = set(parser._option_string_actions)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                names |= _option_strings(sub)
    return names


def _train_mtp(args) -> int:
    from pipespec.train.recipe import train_command

    return train_command(args)


def _eval_mtp(args) -> int:
    from pipespec.train.recipe import eval_command

    return eval_command(args)


def _draft_vocab(args) -> int:
    from pipespec.train.recipe import draft_vocab_command

    return draft_vocab_command(args)


def _generate(args) -> int:
    from pipespec import LLM, SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, min_p=args.min_p, seed=args.seed, stop=args.stop,
                            ignore_eos=args.ignore_eos)
    with LLM(**engine_kwargs(args)) as llm:
        t0 = time.perf_counter()
        if args.chat:
            outs = llm.chat([[{"role": "user", "content": p}] for p in args.prompts], params)
        else:
            outs = llm.generate(args.prompts, params)
        elapsed = time.perf_counter() - t0
        spec = llm.engine.spec_stats if llm.engine.spec_stats.num_spec_tokens else None
    for prompt, out in zip(args.prompts, outs):
        c = out.outputs[0]
        print(f"### prompt: {prompt!r}  ({len(out.prompt_token_ids)} tokens)")
        print(c.text)
        print(f"### {len(c.token_ids)} tokens, finish_reason={c.finish_reason}\n")
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"### {generated} tokens generated in {elapsed:.2f} s: {generated / elapsed:.1f} tokens/s "
          f"(prefill included)")
    if spec is not None:
        print(f"### {spec.summary()}")
    return 0


def main(argv: list[str] | None = None) -> int:
    from pipespec.engine.refused_flags import refused_flag

    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    refused = refused_flag(argv, _option_strings(parser))
    if refused is not None:
        print(f"pipespec: error: {refused[0]} is not supported: {refused[1]}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        worker = _torchrun_worker(args)
        if worker is not None:
            return worker
        return args.func(args)
    except KeyboardInterrupt:       # Ctrl-C: the engine has stopped its stages on the way out
        print("\ninterrupted", file=sys.stderr)
        return 130
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        from pipespec.engine.llm_engine import EngineDeadError
        from pipespec.runtime.transport import StageError
        if not isinstance(e, (EngineDeadError, StageError)):
            raise
        print(f"error: {e}", file=sys.stderr)
        return 1


def _torchrun_worker(args) -> int | None:
    """Under torchrun, ranks > 0 of an engine command serve a pipeline stage instead of running it."""
    from pipespec.runtime.launch import torchrun_env
    env = torchrun_env()
    if env is None or env.rank == 0 or not hasattr(args, "pipeline_parallel_size"):
        return None
    from pipespec.config import EngineConfig
    from pipespec.engine.stages import run_stage_worker
    return run_stage_worker(EngineConfig.from_kwargs(**engine_kwargs(args)))


if __name__ == "__main__":
    sys.exit(main())
