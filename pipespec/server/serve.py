"""`pipespec serve`: build the engine, wrap it, and run uvicorn.

The process exits 0 after a SIGTERM or Ctrl-C, once in-flight requests got their answers (they may
run for --shutdown-timeout seconds, then the ones still running end with finish_reason "abort") and
every pipeline stage stopped. If the engine dies (a stage crashed), every request in flight gets
an error, then the process exits with status 1, so that a supervisor restarts it.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import threading

from pipespec.server.body_limit import DEFAULT_MAX_BODY_BYTES

logger = logging.getLogger(__name__)

EXIT_ENGINE_DEAD = 1


def add_serve_parser(sub, add_engine_args) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    p.add_argument("model_path", nargs="?", default=None, metavar="MODEL",
                   help="HF folder or GGUF file (default: the default model; --model works too)")
    add_engine_args(p)
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on")
    s.add_argument("--port", type=int, default=8000, help="port to listen on")
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes")
    s.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="model name in the API; more names are accepted as aliases (default: the model's, "
                        "or the Hub id it was given as)")
    s.add_argument("--max-queued-requests", type=int, default=256,
                   help="requests waiting to run (not yet running) beyond which new ones get 503")
    s.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help="larger request bodies get 413 before they are read or parsed")
    s.add_argument("--seed", type=int, default=None,
                   help="engine seed: requests without a seed then draw the same text on every run "
                        "(default: fresh randomness per run)")
    s.add_argument("--shutdown-timeout", type=float, default=5.0,
                   help="seconds requests in flight may run on after SIGTERM or Ctrl-C; then each still "
                        "running ends with finish_reason 'abort' (streams get a last chunk and [DONE])")
    lg = p.add_argument_group("logging")
    lg.add_argument("--disable-log-requests", action="store_true",
                    help="no INFO line per finished request (id, tokens, finish reason, latency)")
    lg.add_argument("--enable-log-requests", action="store_true",
                    help="accepted for vLLM compatibility: request lines are on unless --disable-log-requests")
    lg.add_argument("--log-stats-interval", type=float, default=10.0,
                    help="seconds between stats lines (token rates, running and waiting requests, KV cache "
                         "usage, prefix-cache hit rate), written while the server has work")
    lg.add_argument("--disable-log-stats", action="store_true", help="no periodic stats line")
    lg.add_argument("--uvicorn-log-level", default="warning",
                    choices=["critical", "error", "warning", "info", "debug", "trace"],
                    help="uvicorn's own log (info adds its access log and startup lines)")
    lg.add_argument("--disable-uvicorn-access-log", action="store_true", help="no access log lines from uvicorn")
    _add_chat_args(p)
    p.set_defaults(func=run)


def _add_chat_args(p) -> None:
    from pipespec.server.parsers.reasoning import REASONING_PARSERS
    from pipespec.server.parsers.tool_calls import TOOL_CALL_PARSERS

    t = p.add_argument_group("tools and reasoning (vLLM's flags; README: Tools and reasoning)")
    t.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="parse tool calls out of chat answers (tool_choice \"auto\"); needs --tool-call-parser")
    t.add_argument("--tool-call-parser", choices=list(TOOL_CALL_PARSERS), default=None,
                   help="the model's tool-call format")
    t.add_argument("--reasoning-parser", choices=list(REASONING_PARSERS), default=None,
                   help="put the model's <think> block in reasoning_content instead of content")


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from pipespec.engine.args import engine_kwargs
    from pipespec.config import EngineConfig
    from pipespec.engine.llm_engine import LLMEngine
    from pipespec.server.app import build_app
    from pipespec.server.async_engine import AsyncEngine
    from pipespec.server.chat_request import ChatOptions
    from pipespec.server.graceful import GracefulServer
    from pipespec.server.request_log import StatsLogger

    if args.shutdown_timeout < 0:
        raise ValueError(f"--shutdown-timeout must be >= 0 seconds, got {args.shutdown_timeout:g}")
    if not args.disable_log_stats and args.log_stats_interval <= 0:
        raise ValueError(f"--log-stats-interval must be > 0 seconds, got {args.log_stats_interval:g}")
    if args.max_request_body_bytes < 1:
        raise ValueError(f"--max-request-body-bytes must be >= 1, got {args.max_request_body_bytes}")
    chat_options = ChatOptions.from_args(args.enable_auto_tool_choice, args.tool_call_parser, args.reasoning_parser)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    kwargs = engine_kwargs(args)
    if args.model_path is not None:
        kwargs["model"] = args.model_path
    engine = LLMEngine(EngineConfig.from_kwargs(seed=args.seed, **kwargs))
    server = None
    died = threading.Event()

    def on_dead(error: str) -> None:       # engine thread: the server stops after answering what it holds
        logger.error("the engine died (%s); the server stops, exit status %d", error, EXIT_ENGINE_DEAD)
        died.set()
        if server is not None:
            server.should_exit = True

    async_engine = AsyncEngine(engine, max_queued_requests=args.max_queued_requests, on_dead=on_dead)
    names = args.served_model_name or [engine.model_name]
    name = names[0]
    app = build_app(async_engine, name, api_key=args.api_key, max_body_bytes=args.max_request_body_bytes,
                    log_requests=not args.disable_log_requests, model_aliases=tuple(names[1:]), chat_options=chat_options)

    def on_deadline() -> None:
        if async_engine.engine.has_unfinished_requests() or async_engine.num_waiting:
            logger.info("shutdown: %g s grace period over, aborting the requests still running",
                        args.shutdown_timeout)
        async_engine.abort_all()

    server = GracefulServer(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                                           access_log=not args.disable_uvicorn_access_log),
                            shutdown_timeout=args.shutdown_timeout, on_deadline=on_deadline)
    stats = None
    if not args.disable_log_stats:
        registry = app.state.metrics.registry

        def read():
            def total(metric):
                return registry.get_sample_value(f"pipespec:{metric}_total", {"model_name": name}) or 0.0
            return total("prompt_tokens"), total("generation_tokens"), async_engine.stats, async_engine.num_waiting

        stats = StatsLogger(args.log_stats_interval, read).start()
    logger.info("serving %s on http://%s:%d", name, args.host, args.port)
    try:
        server.run()
    finally:
        if stats is not None:
            stats.stop()
        async_engine.shutdown()
    if died.is_set():
        return EXIT_ENGINE_DEAD
    if server.stop_signal is not None:
        logger.info("stopped by %s", signal.Signals(server.stop_signal).name)
    return 0

