"""``run-api``: start the rollout API server (``python -m atroposlib.cli.run_api``).

Example::

    run-api --port 8000 --persist runs/api.db --api-key "$ATROPOS_API_KEY"
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from typing import Sequence

import uvicorn

from atroposlib.api.settings import APISettings
from atroposlib.utils.http_security import is_loopback_host, load_api_key
from atroposlib.utils.http_transport import http_protocol

logger = logging.getLogger(__name__)

__all__ = ["build_parser", "main", "parse_settings"]


def _help(field: str) -> str:
    info = APISettings.model_fields[field]
    return f"{info.description} (default: {info.get_default(call_default_factory=True)!r})"


# Numeric flags: (flag, settings field, type, metavar). Help texts come from the field.
_NUMBERS = (
    ("--max-buffer-mb", "max_buffer_mb", float, "N"),
    ("--env-timeout", "env_timeout", float, "S"),
    ("--max-inflight-mb", "max_inflight_mb", float, "N"),
    ("--body-timeout", "body_timeout", float, "S"),
    ("--max-queue-mb", "max_queue_mb", float, "N"),
    ("--max-request-mb", "max_request_mb", float, "N"),
    ("--pack-above-mb", "pack_above_mb", float, "N"),
    ("--gzip-level", "gzip_level", int, None),
    ("--max-staleness", "max_staleness", int, "K"),
)
# On/off flags: absent means "take the environment variable or the default".
_SWITCHES = (
    ("--reload", "reload"),
    ("--persist-recover", "persist_recover"),
    ("--access-log", "access_log"),
    ("--strict-groups", "strict_groups"),
)


def build_parser() -> argparse.ArgumentParser:
    """The ``run-api`` flags; help texts come from :class:`APISettings`."""
    p = argparse.ArgumentParser(prog="run-api", description="Start the Atropos rollout API server.")
    p.add_argument("--host", help=_help("host"))
    p.add_argument("--port", type=int, help=_help("port"))
    p.add_argument("--persist", metavar="PATH", help=_help("persist"))
    p.add_argument(
        "--api-key",
        dest="api_key",
        metavar="KEY",
        help=_help("api_key") + " Also read from ATROPOS_API_KEY.",
    )
    p.add_argument(
        "--api-key-file", dest="api_key_file", metavar="PATH", help=_help("api_key_file")
    )
    p.add_argument(
        "--cors-origin",
        dest="cors_origins",
        action="append",
        metavar="ORIGIN",
        help=_help("cors_origins"),
    )
    p.add_argument(
        "--log-level",
        dest="log_level",
        choices=["debug", "info", "warning", "error"],
        help=_help("log_level"),
    )
    for flag, field, kind, metavar in _NUMBERS:
        p.add_argument(flag, dest=field, type=kind, metavar=metavar, help=_help(field))
    for flag, field in _SWITCHES:
        p.add_argument(flag, dest=field, action="store_true", default=None, help=_help(field))
    return p


def parse_settings(argv: Sequence[str] | None = None) -> APISettings:
    """Flags override ``ATROPOS_*`` environment variables, which override defaults."""
    args = build_parser().parse_args(argv)
    given = {k: v for k, v in vars(args).items() if v is not None}
    return APISettings(**given)


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of ``run-api``."""
    settings = parse_settings(argv)
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    flag_key = build_parser().parse_args(argv).api_key
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
