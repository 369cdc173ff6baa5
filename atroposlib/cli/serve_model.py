"""``atropos-serve-model MODEL``: serve a causal LM with an OpenAI-compatible API.

Example::

    atropos-serve-model "$(atropos-tiny-model)" --host 127.0.0.1 --port 9001
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from atroposlib.serving.config import ServeModelConfig
from atroposlib.utils.settings_cli import add_fields, parse_values, validate

PROG = "atropos-serve-model"

SERVING_LIBRARIES = ("transformers", "tokenizers", "torch", "fastapi", "uvicorn", "pydantic")
"""Libraries whose internals the server depends on; checked against the declared ranges."""


def build_parser() -> argparse.ArgumentParser:
    """The ``atropos-serve-model`` flags: one per :class:`ServeModelConfig` field, its
    description the help."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="OpenAI-compatible inference server (CPU or one GPU) with a vLLM-style "
        "/generate endpoint and hot weight updates.",
    )
    add_fields(parser, ServeModelConfig)
    return parser


def check_before_loading(config: ServeModelConfig) -> None:
    """Exit 2 with one line naming the fix when the model cannot be found or the port is
    taken: both are known in a second, loading the model takes much longer."""
    from atroposlib.utils.model_check import model_problem
    from atroposlib.utils.ports import busy_port_message

    problem = model_problem(config.model, what="MODEL") or busy_port_message(
        config.host, config.port, "--port"
    )
    if problem:
        print(f"{PROG}: error: {problem}", file=sys.stderr)
        raise SystemExit(2)


def main(argv: Sequence[str] | None = None) -> None:
    """Parse flags, load the model and run uvicorn until interrupted."""
    import uvicorn

    from atroposlib.http.security import is_loopback_host, load_api_key
    from atroposlib.http.transport import http_protocol
    from atroposlib.utils.dependencies import exit_if_unsupported

    values = parse_values(build_parser(), argv)
    exit_if_unsupported(PROG, SERVING_LIBRARIES)
    config = validate(ServeModelConfig, values, prog=PROG)
    check_before_loading(config)
    from atroposlib.serving.app import create_app  # imports torch: after the quick checks

    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        key = load_api_key(
            config.api_key,
            config.api_key_file,
            env_var="ATROPOS_SERVE_MODEL_API_KEY",
            component="atropos-serve-model",
        )
    except ValueError as exc:
        raise SystemExit(f"atropos-serve-model: {exc}") from exc
    config = config.model_copy(update={"api_key": key})
    if not is_loopback_host(config.host) and not config.api_key:
        logging.getLogger(__name__).warning(
            "listening on %s without --api-key: anyone who can reach it can use the model",
            config.host,
        )
    uvicorn.run(
        create_app(config),
        host=config.host,
        port=config.port,
        log_level=config.log_level,
        http=http_protocol(),
        timeout_graceful_shutdown=5,
    )


if __name__ == "__main__":
    main()
