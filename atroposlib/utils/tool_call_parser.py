"""Parse Hermes/Qwen-style tool calls (``<tool_call>{json}</tool_call>``) from model output.

Pure functions, no vLLM needed::

    content, calls = extract_tool_calls('Let me look.<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>')
    # content == "Let me look.", calls == [{"name": "f", "arguments": {"x": 1}}]
"""

from __future__ import annotations

import json
import re
from typing import Any, Sequence

DEFAULT_TAGS = ("tool_call",)


def _block_pattern(tag: str) -> re.Pattern[str]:
    # An unterminated last block (generation cut at max_tokens) still counts.
    return re.compile(rf"<{tag}>\s*(.*?)\s*(?:</{tag}>|$)", re.DOTALL)


def _loads_call(raw: str) -> dict[str, Any] | None:
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return {"name": obj["name"], "arguments": args}


def extract_tool_calls(
    text: str, tags: Sequence[str] = DEFAULT_TAGS
) -> tuple[str, list[dict[str, Any]]]:
    """Split ``text`` into the content outside tool-call blocks and the parsed calls.

    A block whose JSON does not parse (or lacks a string ``name``) is left in the content,
    so nothing the model wrote is silently dropped.
    """
    calls: list[dict[str, Any]] = []
    content = text
    for tag in tags:
        pattern = _block_pattern(tag)

        def _take(match: re.Match[str]) -> str:
            call = _loads_call(match.group(1))
            if call is None:
                return match.group(0)
            calls.append(call)
            return ""

        content = pattern.sub(_take, content)
    return content.strip(), calls


def extract_tool_call(text: str, preferred_tags: Sequence[str] | None = None) -> str | None:
    """The raw inside of the first tool-call block of ``text`` (``preferred_tags`` are tried
    in order, ``tool_call`` by default), stripped; None when there is none."""
    for tag in preferred_tags or DEFAULT_TAGS:
        match = _block_pattern(tag).search(text)
        if match and match.group(1).strip():
            return match.group(1).strip()
    return None


def parse_tool_call(
    response: str,
    available_tools: Sequence[dict[str, Any]] | None = None,
    preferred_tags: Sequence[str] | None = None,
) -> tuple[str, dict[str, Any], bool]:
    """The first tool call in ``response`` as ``(name, arguments, is_error)``.

    ``is_error`` is True when no well-formed call is found, or when its name is not among
    ``available_tools`` (OpenAI tool dicts or plain ``{"name": ...}`` dicts).
    """
    _, calls = extract_tool_calls(response, tuple(preferred_tags or DEFAULT_TAGS))
    if not calls:
        return "-ERROR-", {}, True
    call = calls[0]
    if available_tools:
        names = {(t.get("function") or {}).get("name") or t.get("name") for t in available_tools}
        if call["name"] not in names:
            return call["name"], call["arguments"], True
    return call["name"], call["arguments"], False
