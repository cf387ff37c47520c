"""The `pipespec bench` command and its subcommands."""
from __future__ import annotations


def add_bench_parser(sub, add_engine_args) -> None:
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

