"""``view-run-multimodal``: ``view-run`` with an image pane and a text-prompt box.

The image is ``group["images"][0]`` (base64, optionally a data URL, or a PIL
image), or a ``data:image/...;base64`` URL found in the decoded text. Same flags
as ``view-run``, including the API-free ``--file`` mode.
"""

from __future__ import annotations

import sys

from atroposlib.cli.view_run import build_parser, run


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``view-run-multimodal``."""
    parser = build_parser(
        prog="view-run-multimodal",
        description="Inspect multimodal Atropos rollouts (image + text) in a browser.",
    )
    return run(parser.parse_args(argv), multimodal=True)


if __name__ == "__main__":
    sys.exit(main())
