"""``atropos-sandbox-server``: the original's code-execution API (``POST /execute``, port 5002)
with every program run in the bubblewrap sandbox.

Example::

    atropos-sandbox-server --port 5002 --timeout-s 5
    curl -s localhost:5002/execute -H 'content-type: application/json' \\
        -d '{"code": "print(int(input()) ** 2)", "input": "7"}'
"""

from __future__ import annotations

import argparse
import logging
from typing import Sequence

from atroposlib.sandbox.settings import SandboxServerSettings
from atroposlib.utils.settings_cli import add_fields, parse_values, validate

PROG = "atropos-sandbox-server"

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The flags: one per :class:`SandboxServerSettings` field, its description the help."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Run Python programs sent to POST /execute in a bubblewrap sandbox.",
    )
    add_fields(parser, SandboxServerSettings)
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of ``atropos-sandbox-server``."""
    import uvicorn

    from atroposlib.http.security import is_loopback_host, load_api_key
    from atroposlib.http.transport import http_protocol
    from atroposlib.sandbox.errors import SandboxUnavailable
    from atroposlib.sandbox.server import create_app

    values = parse_values(build_parser(), argv)
    settings = validate(SandboxServerSettings, values, prog=PROG)
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        # Flag > --api-key-file > ATROPOS_SANDBOX_API_KEY; only a flag is warned about (ps).
        key = load_api_key(
            values.get("api_key"),
            settings.api_key_file,
            env_var="ATROPOS_SANDBOX_API_KEY",
            component=PROG,
        )
    except ValueError as e:
        raise SystemExit(f"{PROG}: {e}") from None
    settings = settings.model_copy(update={"api_key": key})
    if not is_loopback_host(settings.host) and not settings.api_key:
        logging.getLogger(__name__).warning(
            "listening on %s without an API key: anyone who can reach this port can run code "
            "here; pass --api-key-file or set ATROPOS_SANDBOX_API_KEY",
            settings.host,
        )
    try:
        app = create_app(settings)
    except SandboxUnavailable as e:
        raise SystemExit(f"{PROG}: {e}") from None
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        http=http_protocol(),
        timeout_graceful_shutdown=5,
    )


if __name__ == "__main__":
    main()
