"""``run-api``: start the rollout API server (``python -m atroposlib.cli.run_api``).

Example::

    run-api --port 8000 --persist runs/api.db --api-key "$ATROPOS_API_KEY"
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Sequence

import uvicorn

from atroposlib.api.settings import APISettings
from atroposlib.http.security import is_loopback_host, load_api_key
from atroposlib.http.transport import http_protocol
from atroposlib.utils.ports import busy_port_message
from atroposlib.utils.settings_cli import add_fields, parse_values, validate

logger = logging.getLogger(__name__)

__all__ = ["build_parser", "main", "parse_settings"]

PROG = "run-api"


def build_parser() -> argparse.ArgumentParser:
    """The ``run-api`` flags: one per :class:`APISettings` field, its description the help."""
    parser = argparse.ArgumentParser(prog=PROG, description="Start the Atropos rollout API server.")
    add_fields(parser, APISettings)
    return parser


def parse_settings(argv: Sequence[str] | None = None) -> APISettings:
    """Flags override ``ATROPOS_*`` environment variables, which override defaults; a bad
    value exits 2 naming the flag."""
    return validate(APISettings, parse_values(build_parser(), argv), prog=PROG)


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of ``run-api``."""
    values = parse_values(build_parser(), argv)
    settings = validate(APISettings, values, prog=PROG)
    busy = busy_port_message(settings.host, settings.port, "--port")
    if busy:
        print(f"{PROG}: error: {busy}", file=sys.stderr)
        raise SystemExit(2)
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    flag_key = values.get("api_key")
    try:
        # Flag > --api-key-file > ATROPOS_API_KEY; a key given as a flag is warned about (ps).
        api_key = load_api_key(flag_key, settings.api_key_file, component="run-api")
    except ValueError as e:
        logger.error("%s", e)
        raise SystemExit(2) from None
    settings = settings.model_copy(update={"api_key": api_key or settings.api_key})
    if is_loopback_host(settings.host):
        logger.info(
            "listening on %s only; pass --host 0.0.0.0 to accept remote environments", settings.host
        )
    elif not settings.api_key:
        logger.warning(
            "listening on %s WITHOUT an API key: anyone who can reach this port can read and "
            "write rollouts; pass --api-key or set ATROPOS_API_KEY",
            settings.host,
        )
    common = dict(
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        access_log=settings.access_log,
        loop="auto",
        http=http_protocol(),
        proxy_headers=False,
        timeout_graceful_shutdown=5,
    )
    if settings.reload:
        # The reloader imports the app by name, so hand the settings over as ATROPOS_* variables.
        for name, value in settings.model_dump(exclude_none=True).items():
            os.environ[f"ATROPOS_{name.upper()}"] = (
                json.dumps(value) if isinstance(value, list) else str(value)
            )
        uvicorn.run("atroposlib.api:app", reload=True, **common)
        return
    from atroposlib.api.errors import StorageError
    from atroposlib.api.server import create_app

    try:
        app = create_app(settings)
    except StorageError as e:
        logger.error("%s", e.message)
        raise SystemExit(2) from None
    uvicorn.run(app, **common)


if __name__ == "__main__":
    main()
