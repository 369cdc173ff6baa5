"""Render client-supplied chat templates in a sandbox, in a process of its own.

A chat template sent by a client is untrusted code: Jinja's sandbox stops it from reaching
Python internals, but not from looping for minutes (nested loops over ``range``) or building
huge strings (``'ab' * 5000000``, repeated ``~``). So templates are rendered here, in a
separate process that the server kills when it overruns its time, under an address-space
limit, with the output size checked as it is produced and string repetition refused before it
allocates.

The module imports only the standard library and Jinja, so the worker starts in a fraction of
a second; the server runs it as a script (``python -I template_worker.py MEM_BYTES``) and
exchanges one JSON line per render over stdin/stdout::

    -> {"template": "...", "variables": {...}, "max_chars": 1000000,
        "continue_final_message": false}
    <- {"text": "..."}  or  {"error": "..."}

:func:`render` is the pure function both sides share (tests call it directly).
"""

from __future__ import annotations

import json
import os
import sys
from datetime import datetime
from typing import Any

from jinja2 import nodes
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


class TemplateLimitError(TemplateError):
    """The template would produce more output than allowed."""


class _GenerationTag(Extension):
    """Accept ``{% generation %}...{% endgeneration %}`` (assistant-mask markers) as plain output."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body).set_lineno(lineno)


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox that also refuses oversized ``*``, ``+`` and ``**`` results."""

    intercepted_binops = frozenset({"*", "+", "**"})

    def __init__(self, max_chars: int) -> None:
        super().__init__(
            trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _GenerationTag]
        )
        self.max_chars = max_chars
        self.filters["tojson"] = _tojson
        self.globals["raise_exception"] = _raise_exception
        self.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for seq, times in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(times, int):
                    self._check(len(seq) * times)
        elif operator == "+" and isinstance(left, (str, list, tuple)):
            if isinstance(right, (str, list, tuple)):
                self._check(len(left) + len(right))
        elif operator == "**" and isinstance(left, int) and isinstance(right, int):
            if abs(left) > 1 and right > 4096:
                raise SecurityError("integer power too large for a chat template")
        return super().call_binop(context, operator, left, right)

    def _check(self, size: int) -> None:
        if size > self.max_chars:
            raise TemplateLimitError(
                f"the template builds a value of {size} items; the limit is {self.max_chars}"
            )


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _final_text(messages: list[dict[str, Any]]) -> str:
    content = messages[-1].get("content") if messages else None
    if isinstance(content, list):
        texts = [p.get("text", "") for p in content if isinstance(p, dict)]
        return texts[-1] if texts else ""
    return content or ""


def render(
    template: str,
    variables: dict[str, Any],
    max_chars: int,
    continue_final_message: bool = False,
) -> str:
    """Render ``template`` with ``variables`` in the bounded sandbox.

    Raises :class:`jinja2.TemplateError` (syntax, ``raise_exception``, limits) or whatever the
    template's own expressions raise (``{{ 1/0 }}``); the caller reports either as a client error.
    ``continue_final_message`` cuts the output right after the last message's content, so the
    model continues that message instead of starting a new one.
    """
    env = _BoundedSandbox(max_chars)
    parts: list[str] = []
    size = 0
    for chunk in env.from_string(template).generate(**variables):
        size += len(chunk)
        if size > max_chars:
            raise TemplateLimitError(f"the rendered template exceeds {max_chars} characters")
        parts.append(chunk)
    text = "".join(parts)
    if continue_final_message:
        final = _final_text(variables.get("messages") or [])
        stripped = final.strip()
        if not stripped or stripped not in text:
            raise TemplateError("the final message does not appear in the rendered template")
        start = text.rindex(stripped)
        keep = len(final.lstrip()) if text[start:].startswith(final.lstrip()) else len(stripped)
        text = text[: start + keep]
    return text


def _limit_memory(max_bytes: int) -> None:
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (max_bytes, max_bytes))
    except (ImportError, ValueError, OSError) as exc:  # not every platform has RLIMIT_AS
        print(f"template worker: no memory limit ({exc})", file=sys.stderr)


def main() -> None:
    """Serve render requests from stdin until it closes."""
    if len(sys.argv) > 1:
        _limit_memory(int(sys.argv[1]))
    if hasattr(os, "nice"):
        os.nice(10)  # a runaway template yields the CPU to the model and the event loop
    for line in sys.stdin:
        try:
            job = json.loads(line)
            text = render(
                job["template"],
                job["variables"],
                int(job["max_chars"]),
                bool(job.get("continue_final_message")),
            )
            reply: dict[str, str] = {"text": text}
        except MemoryError:
            reply = {"error": "the template needed more memory than allowed"}
        except Exception as exc:  # any failure of client code is reported to that client
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
