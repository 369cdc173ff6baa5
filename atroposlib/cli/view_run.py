"""``view-run``: look at rollouts, live from the API or from ``process`` jsonl files.

Live mode (the original): registers with the rollout API as a trainer and shows
the first group of each batch pulled with "Grab Next Batch". It consumes those
batches, so point it at an API no real trainer is reading from. The API is
wiped first only with ``--reset-api``.

File mode (``--file rollouts.jsonl``, repeatable): browses the groups without
touching any API; filter by environment, score range and text, and see which
tokens are trained and their inference logprobs.

Examples::

    view-run --api-url http://localhost:8000 --tokenizer ./tiny-model --reset-api
    view-run --file data/gsm8k.jsonl --tokenizer ./tiny-model --port 7861

The UI listens on 7860 (Gradio's usual port) rather than the original's 9001, which
is also ``atropos-serve-model``'s default, so the README's sequence of commands does
not collide. Like every server here it refuses requests from foreign web pages
(``Origin`` not its own or a ``--cors-origin``: 403; a non-loopback ``Host`` while
bound to loopback: 403), so a site open in the same browser cannot drive it.

Exit codes: 1 API unreachable or port in use; 2 bad input (malformed or empty file,
tokenizer cannot be loaded).
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import logging
import socket
import sys
from typing import Any

from atroposlib.frontend.api_client import (
    DEFAULT_API_URL,
    ApiError,
    TrainerClient,
    add_trainer_arguments,
)
from atroposlib.frontend.dataset_gen import DEFAULT_TOKENIZER, ToolError, load_display_tokenizer
from atroposlib.frontend.rollouts import RolloutFileError, RolloutIndex
from atroposlib.frontend.trainer_helpers import find_common_prefix  # noqa: F401 - original name

logger = logging.getLogger(__name__)

DEFAULT_PORT = 7860
# The original viewer registered batches of ``group_size * 8`` for 69 steps.
_TASKS_PER_STEP = 8
_NUM_STEPS = 69


def build_parser(
    prog: str = "view-run", description: str = "Inspect Atropos rollouts in a browser."
) -> argparse.ArgumentParser:
    """Arguments shared by ``view-run`` and ``view-run-multimodal``."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help="port of the web UI (default %(default)s)"
    )
    parser.add_argument(
        "--host", default="127.0.0.1", help="address of the web UI (default 127.0.0.1)"
    )
    add_trainer_arguments(
        parser,
        group_size_help="rollouts per group shown in live mode (default 2)",
        tokenizer_default=None,
        tokenizer_help=f"tokenizer name or local directory (live default: {DEFAULT_TOKENIZER}; "
        "file mode shows token ids without one)",
    )
    parser.add_argument(
        "--file",
        action="append",
        default=[],
        metavar="JSONL",
        help="browse this process jsonl instead of the live API (repeat for several files)",
    )
    parser.add_argument(
        "--poll-timeout",
        type=float,
        default=300.0,
        help="seconds one 'Grab Next Batch' waits for a batch (default 300)",
    )
    parser.add_argument(
        "--share", action="store_true", help="ask Gradio for a public share link (needs internet)"
    )
    parser.add_argument(
        "--cors-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="a web origin (e.g. http://localhost:3000) whose pages may call the UI; repeatable",
    )
    return parser


def port_problem(host: str, port: int) -> str | None:
    """A one-line explanation when ``host:port`` cannot be listened on, else None.

    Checked before anything heavy starts, so a taken port is reported with the flag that
    fixes it instead of Gradio's advice about its environment variables.
    """
    if not 0 < port < 65536:
        return f"--port {port} is not a TCP port (1-65535)"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return (
                    f"port {port} on {host} is already in use (another view-run or server?); "
                    f"choose another with --port, e.g. --port {port + 1 if port < 65535 else 7861}"
                )
            return f"cannot listen on {host}:{port}: {e.strerror or e}; check --host and --port"
    return None


def _registered_client(
    api_url: str, group_size: int, max_token_len: int, reset: bool
) -> TrainerClient:
    """A client of the API at ``api_url``, checked and registered as the viewer's trainer
    (wiping the API first only with ``reset``); closed again when that fails."""
    client = TrainerClient(api_url)
    try:
        client.check()
        client.ensure_registered(
            batch_size=group_size * _TASKS_PER_STEP,
            max_token_len=max_token_len,
            num_steps=_NUM_STEPS,
            reset=reset,
        )
    except BaseException:
        client.close()
        raise
    return client


def run(args: argparse.Namespace, multimodal: bool = False) -> int:
    """Start the UI for parsed ``args``; return an exit code."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    problem = port_problem(args.host, args.port)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 1
    try:
        if args.file:
            index = RolloutIndex.build(args.file)
            tokenizer = load_display_tokenizer(args.tokenizer) if args.tokenizer else None
            from atroposlib.frontend.viewer_app import build_file_app, launch

            demo = build_file_app(index, tokenizer)
        else:
            tokenizer = load_display_tokenizer(args.tokenizer or DEFAULT_TOKENIZER)
            client = _registered_client(
                args.api_url, args.group_size, args.max_token_len, args.reset_api
            )
            from atroposlib.frontend.viewer_app import build_live_app, launch

            demo = build_live_app(
                client,
                tokenizer,
                args.group_size,
                poll_timeout=args.poll_timeout,
                multimodal=multimodal,
            )
    except (RolloutFileError, ToolError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ApiError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    try:
        launch(demo, args.host, args.port, args.share, allowed_origins=args.cors_origin)
    except KeyboardInterrupt:
        return 0
    except OSError:
        problem = port_problem(args.host, args.port) or f"cannot serve on {args.host}:{args.port}"
        print(f"error: {problem}", file=sys.stderr)
        return 1
    return 0


async def register_to_api(group_size: int, max_token_len: int) -> dict[str, Any]:
    """Register with the API at its default URL as the viewer's trainer (batches of
    ``group_size * 8``)."""
    from atroposlib.frontend.trainer_helpers import register_trainer

    return await register_trainer(
        DEFAULT_API_URL, group_size * _TASKS_PER_STEP, max_token_len, _NUM_STEPS
    )


async def check_for_batch() -> list[dict[str, Any]]:
    """Wait for the next batch from the API at its default URL and return its groups."""
    from atroposlib.frontend.trainer_helpers import check_for_batch as wait

    return await wait(DEFAULT_API_URL)


async def build_interface(
    group_size: int,
    max_token_len: int,
    tokenizer: Any,
    port: int,
    multimodal: bool = False,
) -> None:
    """Register with the API at its default URL, build the live viewer (``tokenizer``: a
    name or a loaded tokenizer) and serve it on 127.0.0.1:``port`` until stopped."""
    from atroposlib.frontend.viewer_app import build_live_app, launch

    if isinstance(tokenizer, str):
        tokenizer = load_display_tokenizer(tokenizer)
    client = await asyncio.to_thread(
        _registered_client, DEFAULT_API_URL, group_size, max_token_len, False
    )
    try:
        demo = build_live_app(client, tokenizer, group_size, multimodal=multimodal)
        await asyncio.to_thread(launch, demo, "127.0.0.1", port, False)
    finally:
        client.close()


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``view-run``."""
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
