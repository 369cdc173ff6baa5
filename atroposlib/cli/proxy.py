"""The managed-server proxy's command (:mod:`atroposlib.proxy`): parse flags, load the
servers and tokenizer, run uvicorn.

Run as ``python -m atroposlib.envs.server_handling.managed_server_proxy`` (the original's
path) or ``python -m atroposlib.cli.proxy``::

    python -m atroposlib.cli.proxy --config servers.json --port 9100
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

from atroposlib.envs.server_handling._common import load_tokenizer
from atroposlib.envs.server_handling.server_baseline import APIServerConfig
from atroposlib.envs.server_handling.server_manager import ServerManager
from atroposlib.http.security import is_loopback_host, load_api_key
from atroposlib.proxy.app import create_app
from atroposlib.proxy.protocol import SetupRequest
from atroposlib.proxy.state import SessionLimits

logger = logging.getLogger(__name__)


def load_config(path: str) -> tuple[list[APIServerConfig], str | None, str | None]:
    """Read a servers file: a list of server configs, or an object with ``servers``."""
    data = json.loads(Path(path).read_text())
    if isinstance(data, list):
        data = {"servers": data}
    setup = SetupRequest.model_validate(data)
    return setup.servers, setup.tokenizer, setup.tool_parser


def build_parser() -> argparse.ArgumentParser:
    """The proxy's flags; one per :class:`SessionLimits` field, its ``help`` metadata the help."""
    parser = argparse.ArgumentParser(
        description="OpenAI-compatible proxy over ManagedServer sessions."
    )
    parser.add_argument(
        "--config", help="JSON file with the server configs (or POST /setup later)."
    )
    parser.add_argument("--host", default="127.0.0.1", help="Address to listen on (loopback).")
    parser.add_argument("--port", type=int, default=9100)
    parser.add_argument(
        "--tokenizer", default=None, help="Tokenizer name or path for all sessions."
    )
    parser.add_argument("--tool-parser", default=None, help="Tool-call parser, e.g. hermes.")
    parser.add_argument(
        "--model-name",
        default=None,
        help="Model name reported by /health and /v1/models (default: the first server's).",
    )
    parser.add_argument(
        "--api-key",
        default=None,
        help="Require 'Authorization: Bearer KEY' on every path but /health (visible in ps: "
        "prefer ATROPOS_API_KEY or --api-key-file).",
    )
    parser.add_argument("--api-key-file", default=None, help="File holding the API key.")
    parser.add_argument(
        "--allow-upstream",
        action="append",
        default=[],
        metavar="HOST[:PORT]",
        help="Non-loopback host POST /setup may point the proxy at (repeatable; '*.domain' "
        "for subdomains, '*' for any). Loopback is always allowed.",
    )
    parser.add_argument(
        "--max-request-mb",
        type=float,
        default=64.0,
        help="Largest request body accepted (413 above it).",
    )
    for limit in dataclasses.fields(SessionLimits):
        parser.add_argument(
            "--" + limit.name.replace("_", "-"),
            type=type(limit.default),
            default=limit.default,
            help=limit.metadata["help"],
        )
    parser.add_argument(
        "--max-upstream-mb",
        type=float,
        default=64.0,
        help="Largest inference server answer read (a larger one is a 502).",
    )
    parser.add_argument(
        "--cors-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="Browser origin allowed to call the proxy (repeatable).",
    )
    return parser


def _servers(
    args: argparse.Namespace, parser: argparse.ArgumentParser
) -> tuple[ServerManager | None, Any, str | None, str | None]:
    """The server pool, tokenizer, tool parser and model name the flags and config give."""
    manager, tokenizer, tool_parser = None, None, args.tool_parser
    model_name = args.model_name
    if args.config:
        servers, tok_name, cfg_parser = load_config(args.config)
        manager = ServerManager(servers)
        model_name = model_name or servers[0].model_name
        tok_name = args.tokenizer or tok_name
        tool_parser = tool_parser or cfg_parser
        if tok_name:
            tokenizer = load_tokenizer(tok_name)
            if tokenizer is None:
                parser.error(f"could not load tokenizer {tok_name!r}")
    elif args.tokenizer:
        tokenizer = load_tokenizer(args.tokenizer)
    return manager, tokenizer, tool_parser, model_name


def main(argv: list[str] | None = None) -> None:
    """``python -m atroposlib.cli.proxy --config servers.json``: serve the proxy."""
    parser = build_parser()
    args = parser.parse_args(argv)
    import uvicorn

    from atroposlib.http.transport import http_protocol

    try:
        api_key = load_api_key(args.api_key, args.api_key_file, component="managed-server proxy")
    except ValueError as e:
        parser.error(str(e))
    if not is_loopback_host(args.host) and not api_key:
        logger.warning(
            "the managed-server proxy listens on %s without an API key: anyone who can reach "
            "it can read and delete sessions; set ATROPOS_API_KEY or --api-key-file",
            args.host,
        )
    manager, tokenizer, tool_parser, model_name = _servers(args, parser)
    app = create_app(
        manager,
        tokenizer,
        model_name or "unknown",
        tool_parser=tool_parser,
        api_key=api_key,
        bind_host=args.host,
        allow_upstream=args.allow_upstream,
        allowed_origins=args.cors_origin,
        max_request_mb=args.max_request_mb,
        limits=SessionLimits(
            **{limit.name: getattr(args, limit.name) for limit in dataclasses.fields(SessionLimits)}
        ),
        max_upstream_mb=args.max_upstream_mb,
    )
    # The bounded protocol: a client that pipelines requests and never reads the answers
    # is no longer read from, instead of growing the proxy's memory.
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", http=http_protocol())


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    main()
