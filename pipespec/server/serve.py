"""`pipespec serve`: build the engine, wrap it, and run uvicorn."""
from __future__ import annotations

import argparse
import logging

logger = logging.getLogger(__name__)


def add_serve_parser(sub, add_engine_args) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    p.add_argument("model_path", nargs="?", default=None, metavar="MODEL",
                   help="HF folder or GGUF file (default: the default model; --model works too)")
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes")
    p.add_argument("--served-model-name", default=None, help="model name in the API (default: the model's)")
    p.add_argument("--max-queued-requests", type=int, default=256,
                   help="pending requests beyond which new ones get 503")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from pipespec.engine.args import engine_kwargs
    from pipespec.config import EngineConfig
    from pipespec.engine.llm_engine import LLMEngine
    from pipespec.server.app import build_app
    from pipespec.server.async_engine import AsyncEngine

    kwargs = engine_kwargs(args)
    if args.model_path is not None:
        kwargs["model"] = args.model_path
    engine = LLMEngine(EngineConfig.from_kwargs(**kwargs))
    async_engine = AsyncEngine(engine, max_queued_requests=args.max_queued_requests)
    name = args.served_model_name or engine.model_name
    app = build_app(async_engine, name, api_key=args.api_key)
    logger.info("serving %s on http://%s:%d", name, args.host, args.port)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=5)
    finally:
        async_engine.shutdown()
    return 0
