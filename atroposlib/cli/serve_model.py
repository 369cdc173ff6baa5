"""``atropos-serve-model MODEL``: serve a causal LM with an OpenAI-compatible API.

Example::

    atropos-serve-model "$(atropos-tiny-model)" --host 127.0.0.1 --port 9001
"""

from __future__ import annotations

import argparse
import logging
import typing
from collections.abc import Sequence

from atroposlib.serving.config import ServeModelConfig

SERVING_LIBRARIES = ("transformers", "tokenizers", "torch", "fastapi", "uvicorn", "pydantic")
"""Libraries whose internals the server depends on; checked against the declared ranges."""


def build_parser() -> argparse.ArgumentParser:
    """An argparse parser whose flags and help come from :class:`ServeModelConfig`."""
    parser = argparse.ArgumentParser(
        prog="atropos-serve-model",
        description="OpenAI-compatible inference server (CPU or one GPU) with a vLLM-style "
        "/generate endpoint and hot weight updates.",
    )
    for name, field in ServeModelConfig.model_fields.items():
        help_text = field.description or ""
        if name == "model":
            parser.add_argument("model", help=help_text)
            continue
        flag = "--" + name.replace("_", "-")
        args: dict[str, typing.Any] = {
            "help": f"{help_text} (default: {field.default})",
            "default": field.default,
        }
        anno = field.annotation
        choices = typing.get_args(anno) if typing.get_origin(anno) is typing.Literal else None
        if choices:
            args["choices"] = list(choices)
        elif name == "served_model_name":
            args["nargs"] = "+"
        elif anno == (list[str] | None):
            args["action"] = "append"
            args["metavar"] = name.split("_")[-1].upper()
        elif anno is bool:
            args["action"] = "store_true"
        elif anno is int or anno == (int | None):
            args["type"] = int
        elif anno is float:
            args["type"] = float
        parser.add_argument(flag, **args)
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    """Parse flags, load the model and run uvicorn until interrupted."""
    import uvicorn

    from atroposlib.serving.app import create_app
    from atroposlib.utils.dependencies import exit_if_unsupported
    from atroposlib.utils.http_security import is_loopback_host, load_api_key
    from atroposlib.utils.http_transport import http_protocol

    ns = build_parser().parse_args(argv)
    exit_if_unsupported("atropos-serve-model", SERVING_LIBRARIES)
    config = ServeModelConfig(**vars(ns))
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
