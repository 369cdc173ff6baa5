"""Translate between raw model text with tool-call blocks and OpenAI ``tool_calls``.

``ManagedServer`` keeps the raw text in its nodes (that is what the model produced and
what the trainer sees) and hands callers OpenAI-shaped ``tool_calls``.

The Hermes/Qwen ``<tool_call>{json}</tool_call>`` format (``hermes``, ``qwen``,
``qwen2_5``, ``qwen3``) is parsed here, without vLLM. Any other parser name is looked up
in vLLM's ``ToolParserManager`` when vLLM is installed. ``VLLM_AVAILABLE`` and
``ToolParserManager`` are module attributes read at call time, as in the original, so
tests can switch the vLLM path on or off with ``monkeypatch.setattr``.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import sys
import uuid
from types import SimpleNamespace
from typing import Any

from openai.types.chat import ChatCompletionMessageToolCall

from atroposlib.utils.tool_call_parser import extract_tool_calls

SUPPORTED_PARSERS = ("hermes", "qwen", "qwen2_5", "qwen3")
"""Parsers built in (no vLLM needed); every other name needs vLLM."""

VLLM_AVAILABLE: bool = importlib.util.find_spec("vllm") is not None
"""Whether vLLM is installed (checked without importing it; it is imported on first use)."""

_VLLM_TOOL_PARSERS = "vllm.entrypoints.openai.tool_parsers"


def __getattr__(name: str) -> Any:
    if name == "ToolParserManager":
        try:
            value = importlib.import_module(_VLLM_TOOL_PARSERS).ToolParserManager
        except (ImportError, AttributeError) as e:
            raise AttributeError(f"vLLM's ToolParserManager cannot be imported: {e}") from e
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _module() -> Any:
    return sys.modules[__name__]


def _openai_call(name: str, arguments: str, call_id: str | None = None) -> dict[str, Any]:
    return {
        "id": call_id or f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


class ToolCallTranslator:
    """Parse tool-call blocks in model output into OpenAI tool calls and back.

    ``tokenizer`` decodes token ids (:meth:`decode_with_tool_awareness`) and builds vLLM
    parsers. A string in the first position is taken as the parser name (the order some
    callers use; a tokenizer is never a string).

    Example::

        translator = ToolCallTranslator(tokenizer, "hermes")
        content, tool_calls, finish = translator.parse_model_output(raw_text)
    """

    def __init__(self, tokenizer: Any = None, parser_name: str = "hermes", **kwargs: Any):
        if isinstance(tokenizer, str):
            tokenizer, parser_name = kwargs.pop("tokenizer", None), tokenizer
        if kwargs:
            raise TypeError(f"unexpected arguments: {', '.join(sorted(kwargs))}")
        self.parser_name = parser_name
        self.tokenizer = tokenizer
        self._vllm_parser: Any = None
        if parser_name in SUPPORTED_PARSERS:
            return
        module = _module()
        if not module.VLLM_AVAILABLE:
            raise ValueError(
                f"tool parser {parser_name!r} needs vLLM, which is not installed; "
                f"built-in parsers: {', '.join(SUPPORTED_PARSERS)}"
            )
        try:
            parser_cls = module.ToolParserManager.get_tool_parser(parser_name)
        except (KeyError, ValueError) as e:
            raise ValueError(f"unknown tool parser {parser_name!r}: {e}") from e
        self._vllm_parser = parser_cls(tokenizer)

    def parse_model_output(
        self,
        raw_text: str,
        tool_choice: str | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> tuple[str | None, list[ChatCompletionMessageToolCall] | None, str]:
        """``(content, tool_calls, finish_reason)`` for ``raw_text``.

        Without tool calls (or with ``tool_choice="none"``) the content is ``raw_text``
        unchanged, ``tool_calls`` is None and the finish reason ``"stop"``; otherwise the
        content is the text around the calls (None when empty), the calls are OpenAI
        ``ChatCompletionMessageToolCall`` objects and the finish reason ``"tool_calls"``.
        """
        if isinstance(tool_choice, list):  # the earlier (raw_text, tools) order
            tool_choice, tools = None, tool_choice
        if tool_choice == "none":
            return raw_text, None, "stop"
        if self._vllm_parser is not None:
            content, calls = self._parse_with_vllm(raw_text, tools)
        else:
            content, found = extract_tool_calls(raw_text)
            calls = [_openai_call(c["name"], json.dumps(c["arguments"])) for c in found]
            content = (content or None) if calls else raw_text
        if not calls:
            return raw_text, None, "stop"
        return content, [ChatCompletionMessageToolCall(**c) for c in calls], "tool_calls"

    def _parse_with_vllm(
        self, raw_text: str, tools: list[dict[str, Any]] | None
    ) -> tuple[str | None, list[dict[str, Any]]]:
        request = SimpleNamespace(tools=tools, tool_choice="auto")
        info = self._vllm_parser.extract_tool_calls(raw_text, request)
        if not getattr(info, "tools_called", False):
            return raw_text, []
        tool_calls = []
        for call in info.tool_calls:
            fn = call.function
            arguments = fn.arguments if isinstance(fn.arguments, str) else json.dumps(fn.arguments)
            tool_calls.append(_openai_call(fn.name, arguments, getattr(call, "id", None)))
        return (info.content or None), tool_calls

    def reconstruct_raw_text_from_tool_calls(self, tool_calls: list[dict[str, Any]]) -> str:
        """The Hermes text a model writes for ``tool_calls`` (OpenAI dicts or objects):
        one ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` block per call."""
        blocks = []
        for call in tool_calls:
            if not isinstance(call, dict):
                call = call.model_dump() if hasattr(call, "model_dump") else dict(vars(call))
            fn = call.get("function") or call
            arguments: Any = fn.get("arguments", {})
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments)
                except json.JSONDecodeError:
                    pass  # kept as the string the caller gave
            payload = json.dumps({"name": fn.get("name"), "arguments": arguments})
            blocks.append(f"<tool_call>\n{payload}\n</tool_call>")
        return "\n".join(blocks)

    def decode_with_tool_awareness(self, token_ids: list[int], has_tools: bool = False) -> str:
        """Decode ``token_ids``; with tools, special tokens are kept, since some models'
        tool-call tags are special tokens that plain decoding would drop."""
        if self.tokenizer is None:
            raise ValueError("ToolCallTranslator needs a tokenizer to decode token ids")
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=not has_tools)

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
