"""``view-run-multimodal``: ``view-run`` with an image pane and a text-prompt box.

The image is ``group["images"][0]`` (base64, optionally a data URL, or a PIL
image), or a ``data:image/...;base64`` URL found in the decoded text. Same flags
as ``view-run``, including the API-free ``--file`` mode.
"""

from __future__ import annotations

import sys
from typing import Any

from atroposlib.cli.view_run import build_interface as _build_interface
from atroposlib.cli.view_run import build_parser, check_for_batch, register_to_api, run
from atroposlib.frontend.multimodal import extract_text_prompt, group_image
from atroposlib.frontend.trainer_helpers import find_common_prefix

__all__ = [
    "build_interface",
    "check_for_batch",
    "extract_image_from_chat",
    "extract_text_from_chat",
    "find_common_prefix",
    "main",
    "register_to_api",
]


def extract_image_from_chat(chat_text: str) -> Any | None:
    """The first ``data:image/...;base64`` image in ``chat_text`` as a PIL image, or None."""
    return group_image({}, chat_text)


def extract_text_from_chat(chat_text: str) -> str:
    """The text prompt of a multimodal chat rendering (its text parts, the text after
    ``[Image]``, or the text with embedded images replaced by ``[image]``)."""
    return extract_text_prompt(chat_text)


async def build_interface(group_size: int, max_token_len: int, tokenizer: Any, port: int) -> None:
    """The multimodal live viewer (image pane and text prompt), served on ``port``."""
    await _build_interface(group_size, max_token_len, tokenizer, port, multimodal=True)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``view-run-multimodal``."""
    parser = build_parser(
        prog="view-run-multimodal",
        description="Inspect multimodal Atropos rollouts (image + text) in a browser.",
    )
    return run(parser.parse_args(argv), multimodal=True)


if __name__ == "__main__":
    sys.exit(main())
