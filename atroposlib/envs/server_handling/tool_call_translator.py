"""Translate between raw model text with tool-call blocks and OpenAI ``tool_calls``.

``ManagedServer`` keeps the raw text in its nodes (that is what the model produced and
what the trainer sees) and hands callers OpenAI-shaped ``tool_calls``.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from atroposlib.utils.tool_call_parser import extract_tool_calls

SUPPORTED_PARSERS = ("hermes", "qwen", "qwen2_5", "qwen3")


class ToolCallTranslator:
    """Parse ``<tool_call>`` blocks (Hermes/Qwen format) into OpenAI tool calls and back."""

    def __init__(self, parser_name: str = "hermes"):
        if parser_name not in SUPPORTED_PARSERS:
            raise ValueError(
                f"unknown tool parser {parser_name!r}; supported: {', '.join(SUPPORTED_PARSERS)}"
            )
        self.parser_name = parser_name

    def parse_model_output(self, raw_text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """``(content or None, tool_calls)`` with tool calls in OpenAI's dict shape."""
        content, calls = extract_tool_calls(raw_text)
        tool_calls = [
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])},
            }
            for c in calls
        ]
        return (content or None) if tool_calls else raw_text, tool_calls

    @staticmethod
    def convert_messages_for_template(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Messages with ``tool_calls[].function.arguments`` as dicts, as chat templates expect."""
        out = []
        for message in messages:
            calls = message.get("tool_calls")
            if not calls:
                out.append(message)
                continue
            converted = []
            for call in calls:
                call = dict(call)
                fn = dict(call.get("function") or {})
                if isinstance(fn.get("arguments"), str):
                    try:
                        fn["arguments"] = json.loads(fn["arguments"])
                    except json.JSONDecodeError:
                        pass  # the template renders the string as is
                call["function"] = fn
                converted.append(call)
            out.append({**message, "tool_calls": converted})
        return out
