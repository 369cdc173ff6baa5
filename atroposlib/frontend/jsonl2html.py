"""Render a rollouts jsonl file (one ScoredDataGroup per line) as a static HTML report.

``BaseEnv``'s ``process`` mode writes ``<stem>.jsonl`` and then calls
``generate_html(path)``, which writes ``<stem>.html`` next to it. Every line needs
``messages`` and ``scores``; other lines are skipped with a warning. ``messages``
entries are either plain strings or lists of chat messages, rendered as
``**Role**: content`` through Markdown (fenced code, tables, line breaks).

Raw HTML inside rollouts is shown as text, never executed: model output is
untrusted.

Example::

    from atroposlib.frontend.jsonl2html import generate_html
    generate_html("data/gsm8k.jsonl")            # -> data/gsm8k.html

    python -m atroposlib.frontend.jsonl2html data/gsm8k.jsonl [out.html]
"""

from __future__ import annotations

import argparse
import functools
import html
import json
import logging
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from xml.etree.ElementTree import Element

import markdown
from markdown.extensions import Extension
from markdown.treeprocessors import Treeprocessor

from atroposlib.frontend.rollouts import loads_line
from atroposlib.frontend.viewer import policy_version_label

logger = logging.getLogger(__name__)

SCRIPT_DIR = Path(__file__).parent.resolve()
TEMPLATE_FILE = SCRIPT_DIR / "template.html"
TEMPLATE_PATH = TEMPLATE_FILE
_DATA_IMAGE = re.compile(r"^data:image/(png|jpeg|jpg|gif|webp);base64,[A-Za-z0-9+/=\s]+$")
_SAFE_URL = re.compile(r"^(https?:|mailto:|#|/|\.)", re.IGNORECASE)


class _DropUnsafeUrls(Treeprocessor):
    """Remove ``href``/``src`` values whose scheme could run script (``javascript:`` ...)."""

    def run(self, root: Element) -> None:
        for element in root.iter():
            for attr in ("href", "src"):
                value = element.get(attr)
                if value is not None and not _SAFE_URL.match(value.strip()):
                    element.set(attr, "#")


class _SafeMarkdown(Extension):
    """Markdown without raw-HTML pass-through: tags in rollouts are escaped, not rendered."""

    def extendMarkdown(self, md: markdown.Markdown) -> None:  # noqa: N802 (markdown API name)
        md.preprocessors.deregister("html_block")
        md.inlinePatterns.deregister("html")
        md.treeprocessors.register(_DropUnsafeUrls(md), "drop_unsafe_urls", 0)


def _markdown() -> markdown.Markdown:
    return markdown.Markdown(extensions=["fenced_code", "tables", "nl2br", _SafeMarkdown()])


_MD = _markdown()


def _render_markdown(text: str) -> str:
    _MD.reset()
    return _MD.convert(text)


@functools.lru_cache(maxsize=1024)
def _render_turn(role: str, text: str) -> str:
    # Rollouts of a group share their prompt turns: render each distinct turn once.
    return _render_markdown(f"**{role}**: {text}")


def _content_to_markdown(content: Any) -> tuple[str, list[str]]:
    """Return (markdown text, data-URL images) for a message ``content``.

    ``content`` may be a string or a list of OpenAI-style parts
    (``{"type": "text", "text": ...}``, ``{"type": "image_url", "image_url": {"url": ...}}``).
    """
    if content is None:
        return "", []
    if isinstance(content, str):
        return content, []
    if isinstance(content, list):
        texts: list[str] = []
        images: list[str] = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, dict):
                kind = part.get("type")
                if kind == "text":
                    texts.append(str(part.get("text", "")))
                elif kind in ("image_url", "image"):
                    url = part.get("image_url", part.get("image"))
                    if isinstance(url, dict):
                        url = url.get("url")
                    if isinstance(url, str) and _DATA_IMAGE.match(url):
                        images.append(url)
                    texts.append("[image]")
                else:
                    texts.append(json.dumps(part, ensure_ascii=False))
            else:
                texts.append(str(part))
        return "\n".join(texts), images
    return str(content), []


def _message_to_html(message: Any) -> str:
    """Render one rollout: a string, or a list of chat messages."""
    if isinstance(message, list):
        chunks: list[str] = []
        images: list[str] = []
        for turn in message:
            if isinstance(turn, dict):
                role = str(turn.get("role", "unknown")).capitalize()
                text, turn_images = _content_to_markdown(turn.get("content"))
                images.extend(turn_images)
                chunks.append(_render_turn(role, text))
            else:
                chunks.append(_render_markdown(str(turn)))
        body = "\n".join(chunks)
        body += "".join(
            f'<img class="inline-image" alt="image" src="{html.escape(url, quote=True)}">'
            for url in images
        )
        return body
    if isinstance(message, dict):
        return _message_to_html([message])
    return _render_markdown(str(message))


def get_score_class(score: Any) -> str:
    """The CSS class of a score: ``reward-positive``, ``reward-negative`` or ``reward-zero``
    (also for anything that is not a number)."""
    try:
        value = float(score)
    except (TypeError, ValueError):
        return "reward-zero"
    if value > 0:
        return "reward-positive"
    if value < 0:
        return "reward-negative"
    return "reward-zero"


def create_html_for_group(group_data: dict[str, Any], index: int) -> str:
    """Return the collapsible ``<details>`` block for one group.

    Rollouts and scores are paired up to ``min(len(messages), len(scores))``;
    extra entries on either side are ignored. A group with nothing to show (no
    messages) gives ``""``, as in the original, so callers can skip it.

    Example::

        create_html_for_group({"messages": ["hi"], "scores": [1.0]}, 0)
    """
    messages = group_data.get("messages") or []
    scores = group_data.get("scores") or []
    count = min(len(messages), len(scores))
    if len(messages) != len(scores):
        logger.warning(
            "group %d: %d messages but %d scores; showing the first %d",
            index,
            len(messages),
            len(scores),
            count,
        )
    items: list[str] = []
    for i, (message, score) in enumerate(zip(messages[:count], scores[:count], strict=False)):
        items.append(
            f'<div class="item {get_score_class(score)}">'
            f'<div class="content">{_message_to_html(message)}</div>'
            f'<p class="reward">Reward: {html.escape(str(score))}'
            f"{html.escape(policy_version_label(group_data, i))}</p>"
            "</div>"
        )
    if not items:
        return ""
    return (
        f"<details><summary>Group {index}</summary>"
        f'<div class="group-content">{"".join(items)}</div></details>\n'
    )


@dataclass
class RenderStats:
    """What ``render_jsonl`` saw: groups written and lines skipped (with reasons)."""

    groups: int = 0
    skipped: int = 0
    malformed: int = 0


def render_jsonl(input_path: str | Path, output_path: str | Path) -> RenderStats:
    """Stream ``input_path`` into the HTML report ``output_path``; return counts.

    Lines that are not JSON objects with ``messages`` and ``scores`` are skipped
    with a warning naming the line number.
    """
    input_path = Path(input_path)
    output_path = Path(output_path)
    template = TEMPLATE_PATH.read_text(encoding="utf-8")
    head, _, tail = template.partition("{groups_html}")
    title = html.escape(f"Rollouts: {input_path.name}")
    stats = RenderStats()
    output_path.parent.mkdir(parents=True, exist_ok=True)
    # Written beside the output and renamed when complete: a failure leaves no partial report.
    partial = output_path.with_name(f".{output_path.name}.partial")
    try:
        with (
            input_path.open("r", encoding="utf-8", errors="replace") as src,
            partial.open("w", encoding="utf-8") as out,
        ):
            _render_lines(src, out, input_path, title, head, tail, stats)
        os.replace(partial, output_path)
    finally:
        partial.unlink(missing_ok=True)
    return stats


def _render_lines(
    src: Any, out: Any, input_path: Path, title: str, head: str, tail: str, stats: RenderStats
) -> None:
    """Write the report's head, one block per renderable line, and its tail to ``out``."""
    out.write(head.replace("{title}", title))
    for line_no, line in enumerate(src, start=1):
        if not line.strip():
            continue
        try:
            group = loads_line(line)
        except json.JSONDecodeError as e:
            logger.warning("%s:%d: not valid JSON (%s); skipped", input_path, line_no, e)
            stats.malformed += 1
            stats.skipped += 1
            continue
        if not isinstance(group, dict) or "messages" not in group or "scores" not in group:
            logger.warning("%s:%d: needs 'messages' and 'scores'; skipped", input_path, line_no)
            stats.skipped += 1
            continue
        if not isinstance(group["messages"], list) or not isinstance(group["scores"], list):
            logger.warning(
                "%s:%d: 'messages' and 'scores' must be lists; skipped", input_path, line_no
            )
            stats.skipped += 1
            continue
        try:
            block = create_html_for_group(group, stats.groups)
        except RecursionError:
            logger.warning("%s:%d: nested too deeply to show; skipped", input_path, line_no)
            stats.skipped += 1
            continue
        if not block:
            logger.warning("%s:%d: no messages to show; skipped", input_path, line_no)
            stats.skipped += 1
            continue
        out.write(block)
        stats.groups += 1
    if stats.groups == 0:
        out.write('<p class="empty">No groups with messages and scores in this file.</p>\n')
    out.write(tail.replace("{title}", title))


def generate_html(input_path: str, output_path: str | None = None) -> str:
    """Write the HTML report for ``input_path``; return the output path.

    The default output is ``<input stem>.html`` next to the input.
    """
    src = Path(input_path)
    dst = Path(output_path) if output_path else src.with_suffix(".html")
    stats = render_jsonl(src, dst)
    logger.info("wrote %d groups to %s (%d lines skipped)", stats.groups, dst, stats.skipped)
    return str(dst)


def main(argv: list[str] | None = None) -> int:
    """CLI: ``python -m atroposlib.frontend.jsonl2html INPUT [OUTPUT]``.

    Exit codes: 0 written; 1 nothing to render (empty file or no valid group);
    2 input missing or unreadable; 3 some lines skipped with ``--strict``.
    """
    parser = argparse.ArgumentParser(
        prog="python -m atroposlib.frontend.jsonl2html",
        description="Render a rollouts jsonl (one ScoredDataGroup per line) as HTML.",
    )
    parser.add_argument("input_path", nargs="?", help="rollouts jsonl file")
    parser.add_argument(
        "output_path", nargs="?", default=None, help="output HTML (default: <stem>.html)"
    )
    parser.add_argument("--input_path", "--input-path", dest="input_opt", help=argparse.SUPPRESS)
    parser.add_argument("--output_path", "--output-path", dest="output_opt", help=argparse.SUPPRESS)
    parser.add_argument("--strict", action="store_true", help="exit 3 when any line was skipped")
    args = parser.parse_args(argv)
    input_path = args.input_opt or args.input_path
    output_path = args.output_opt or args.output_path
    if not input_path:
        parser.error("an input jsonl path is required")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s")
    src = Path(input_path)
    if not src.is_file():
        print(f"error: {src} does not exist or is not a file", file=sys.stderr)
        return 2
    dst = Path(output_path) if output_path else src.with_suffix(".html")
    try:
        stats = render_jsonl(src, dst)
    except OSError as e:
        print(f"error: cannot render {src} to {dst}: {e}", file=sys.stderr)
        return 2
    if stats.groups == 0:
        reason = (
            "the file is empty" if stats.skipped == 0 else f"all {stats.skipped} lines were skipped"
        )
        print(
            f"error: no groups with 'messages' and 'scores' in {src} ({reason}); wrote {dst}",
            file=sys.stderr,
        )
        return 1
    print(
        f"wrote {stats.groups} groups to {dst}"
        + (f" ({stats.skipped} lines skipped)" if stats.skipped else "")
    )
    if args.strict and stats.skipped:
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
