"""Chat-template inputs from clients: which are allowed, and where client templates render.

The model's own template is trusted and rendered by ``transformers`` (in a worker thread).
A template sent by a client (``chat_template``, or ``chat_template_kwargs["chat_template"]``)
is untrusted code: it is refused unless the server runs with ``--allow-client-chat-template``,
and then rendered by :class:`ClientTemplateRenderer` in a separate sandboxed process with a time
limit (the process is killed when it overruns), an address-space limit and an output limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
from pathlib import Path
from typing import Any

from atroposlib.http.openai_protocol import InvalidRequest
from atroposlib.utils.aio import within

logger = logging.getLogger(__name__)

_WORKER = Path(__file__).with_name("template_worker.py")

RESERVED_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)
"""``apply_chat_template`` parameters (and body fields) that are not template variables."""


def split_template_kwargs(
    kwargs: dict[str, Any] | None, chat_template: str | None, allow_client: bool
) -> tuple[str | None, dict[str, Any]]:
    """Return ``(client_template, template_variables)`` from a chat request, or raise a 400.

    Template variables (``enable_thinking`` and the like) are always allowed, as in vLLM; a
    client template only with ``--allow-client-chat-template``.
    """
    variables = dict(kwargs or {})
    for key in variables:
        if key in RESERVED_KWARGS:
            raise InvalidRequest(
                f"'chat_template_kwargs.{key}' is not a template variable; use the request "
                "field of that name where there is one",
                param=f"chat_template_kwargs.{key}",
            )
        if not key.isidentifier():
            raise InvalidRequest(
                f"'chat_template_kwargs' key {key!r} is not a valid variable name",
                param="chat_template_kwargs",
            )
    nested = variables.pop("chat_template", None)
    template = chat_template if chat_template is not None else nested
    if template is None:
        return None, variables
    param = "chat_template" if chat_template is not None else "chat_template_kwargs.chat_template"
    if not allow_client:
        raise InvalidRequest(
            "client-supplied chat templates are disabled on this server (start it with "
            "--allow-client-chat-template to allow them)",
            param=param,
        )
    if not isinstance(template, str) or not template:
        raise InvalidRequest("the chat template must be a non-empty string", param=param)
    return template, variables


class ClientTemplateRenderer:
    """A small pool of sandboxed template worker processes.

    Each render has ``timeout`` seconds; a worker that overruns, dies or is abandoned is killed
    and replaced, so a looping template costs at most one worker for ``timeout`` seconds and
    never touches the event loop or the model.

    Example::

        renderer = ClientTemplateRenderer(timeout=2.0, max_chars=1_000_000)
        text = await renderer.render("{{ messages[0].content }}", {"messages": [...]})
        await renderer.close()
    """

    def __init__(
        self,
        *,
        timeout: float,
        max_chars: int,
        memory_bytes: int = 512 * 2**20,
        workers: int = 2,
    ) -> None:
        self.timeout = timeout
        self.max_chars = max_chars
        self.memory_bytes = memory_bytes
        self._slots = asyncio.Semaphore(workers)
        self._idle: list[asyncio.subprocess.Process] = []
        self._busy: set[asyncio.subprocess.Process] = set()
        self.killed = 0

    async def _spawn(self) -> asyncio.subprocess.Process:
        return await asyncio.create_subprocess_exec(
            sys.executable,
            "-I",
            str(_WORKER),
            str(self.memory_bytes),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            limit=self.max_chars * 8 + 65536,  # a JSON-escaped character takes at most 6 bytes
        )

    async def _kill(self, proc: asyncio.subprocess.Process) -> None:
        self.killed += 1
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()

    async def render(
        self, template: str, variables: dict[str, Any], continue_final_message: bool = False
    ) -> str:
        """Render in a worker; any failure of the template is an :class:`InvalidRequest`."""
        job = json.dumps(
            {
                "template": template,
                "variables": variables,
                "max_chars": self.max_chars,
                "continue_final_message": continue_final_message,
            }
        )
        async with self._slots:
            proc = self._idle.pop() if self._idle else await self._spawn()
            self._busy.add(proc)
            healthy = False
            try:
                assert proc.stdin is not None and proc.stdout is not None
                proc.stdin.write(job.encode() + b"\n")
                await proc.stdin.drain()
                line = await within(proc.stdout.readline(), self.timeout)
                if not line:
                    raise InvalidRequest(
                        "the chat template exhausted the renderer (it was stopped)",
                        param="chat_template",
                    )
                reply = json.loads(line)
                healthy = True
            except asyncio.TimeoutError:
                raise InvalidRequest(
                    f"the chat template did not finish rendering within {self.timeout:g}s",
                    param="chat_template",
                ) from None
            except (ConnectionError, ValueError) as exc:
                raise InvalidRequest(
                    f"the chat template could not be rendered: {exc}", param="chat_template"
                ) from exc
            finally:
                self._busy.discard(proc)
                if healthy:
                    self._idle.append(proc)
                else:
                    await self._kill(proc)
        if "error" in reply:
            raise InvalidRequest(
                f"cannot render the chat template: {reply['error']}", param="chat_template"
            )
        return reply["text"]

    async def close(self) -> None:
        """Stop every worker."""
        for proc in self._idle + list(self._busy):
            if proc.returncode is None:
                await self._kill(proc)
        self._idle.clear()
        self._busy.clear()
