"""``ManagedServer``: chat/completion calls that record exact tokens, masks and logprobs.

Each completion becomes a ``SequenceNode`` holding the prompt and output tokens,
``masked_tokens`` (-100 on prompt positions, the token id on generated ones) and
``logprobs`` (1.0 on prompt positions, the sampler's logprob on generated ones), so an
environment can hand the trainer exactly what the policy produced.

Multi-turn: in the default mode a new prompt that starts with an existing node's
``full_text`` extends that node (its tokens are reused verbatim and only the new suffix
is tokenized), so a whole conversation stays one trainable sequence. With
``track_tree=True`` every node is kept, keyed by its full text.

Every node records the weight version that generated it (``policy_version``); a node
that extends another across a weight swap keeps the oldest and the newest version
(``policy_version`` and ``policy_version_max``).

Example::

    async with server_manager.managed_server(tokenizer=tok) as managed:
        completion = await managed.chat_completion(messages=messages, n=4, max_tokens=256)
        nodes = managed.get_state()["nodes"]   # 4 SequenceNodes
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time
import uuid
from typing import Any

from openai.types import Completion, CompletionChoice
from openai.types.chat import ChatCompletion, ChatCompletionMessage
from openai.types.chat.chat_completion import Choice
from pydantic import BaseModel, Field

from atroposlib.envs.server_handling._common import config_tokenizer_name, load_tokenizer
from atroposlib.envs.server_handling.policy_version import merge_versions, output_versions
from atroposlib.envs.server_handling.tool_call_translator import ToolCallTranslator

logger = logging.getLogger(__name__)

PROMPT_MASK = -100
PROMPT_LOGPROB = 1.0
OFFLOAD_CHARS = 32_768
"""Prompts (or message lists) longer than this many characters are rendered and tokenized
in a worker thread, so a large request does not stall the event loop (health probes,
other sessions) for the milliseconds to seconds that takes."""
_THINK_RE = re.compile(r"<think>.*?</think>", re.DOTALL)


class SequenceNode(BaseModel):
    """One tracked sequence: prompt plus completion."""

    full_text: str = Field(..., description="Prompt text followed by the decoded completion.")
    tokens: list[int] = Field(..., description="Prompt and completion token ids.")
    masked_tokens: list[int] = Field(..., description="tokens with -100 on prompt positions.")
    logprobs: list[float] = Field(..., description="Logprobs, 1.0 on prompt positions.")
    metadata: dict[str, Any] | None = Field(None, description="finish_reason and extras.")
    policy_version: int | None = Field(
        None,
        description="Oldest weight version that generated any of this sequence's tokens "
        "(None when the server reports none).",
    )
    policy_version_max: int | None = Field(
        None,
        description="Newest weight version that generated any of its tokens; differs from "
        "policy_version when a multi-turn sequence spans a weight swap.",
    )


def _debug(msg: str, *args: Any) -> None:
    if os.environ.get("ATROPOS_DEBUG_REQUESTS") == "1":
        logger.info(msg, *args)


def fit_logprobs(logprobs: list[float], length: int) -> list[float]:
    """Pad ``logprobs`` with 1.0 or truncate it to ``length`` entries."""
    if len(logprobs) >= length:
        return list(logprobs[:length])
    return list(logprobs) + [PROMPT_LOGPROB] * (length - len(logprobs))


def server_tokenizer(server: Any) -> Any:
    """The tokenizer for ``server``: its own ``tokenizer`` attribute when it has one, else
    the one its config names (``tokenizer_name``, or ``model_name``); ValueError naming
    what was tried when there is none."""
    try:
        tokenizer = getattr(server, "tokenizer", None)
    except ValueError:  # a backend whose lazily loaded tokenizer failed to load
        tokenizer = None
    if tokenizer is not None:
        return tokenizer
    name = config_tokenizer_name(getattr(server, "config", None))
    if name is None:
        raise ValueError(
            "ManagedServer needs a tokenizer: pass tokenizer=..., or use a server that has one "
            "or whose config names one (tokenizer_name or model_name)"
        )
    tokenizer = load_tokenizer(name)
    if tokenizer is None:
        raise ValueError(
            f"ManagedServer could not load the tokenizer {name!r} named by the server config; "
            "pass tokenizer=..."
        )
    return tokenizer


class ManagedServer:
    """Wraps one server that implements ``tokens_and_logprobs_completion``.

    ``tokenizer`` is optional: without one the server's own ``tokenizer`` is used, else
    the one its config names (``tokenizer_name``, or ``model_name`` when that is
    ``"none"``) is loaded. ``tool_parser`` (e.g. ``"hermes"``) turns ``<tool_call>``
    blocks into OpenAI ``tool_calls`` in the returned completion; nodes keep the raw text.
    Unless ``preserve_think_blocks`` is set, ``<think>`` blocks in assistant messages
    are shielded with placeholders while the chat template renders, so templates that
    strip earlier reasoning cannot break prefix extension.
    """

    def __init__(
        self,
        server: Any,
        tokenizer: Any = None,
        track_tree: bool = False,
        tool_parser: str | None = None,
        preserve_think_blocks: bool = False,
    ):
        self.server = server
        self.tokenizer = tokenizer if tokenizer is not None else server_tokenizer(server)
        self.track_tree = track_tree
        self.preserve_think_blocks = preserve_think_blocks
        self.translator = (
            ToolCallTranslator(tool_parser, tokenizer=self.tokenizer) if tool_parser else None
        )
        self.current_nodes: list[SequenceNode] = []
        self.sequences: dict[str, SequenceNode] = {}
        self._parents: dict[str, str | None] = {}

    # ----------------------------------------------------------------- prompt rendering
    def _convert_messages_to_prompt(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> str:
        if not messages:
            raise ValueError("messages must not be empty")
        msgs = [dict(m) for m in messages]
        if self.translator is not None:
            msgs = self.translator.convert_messages_for_template(msgs)
        shields: dict[str, str] = {}
        if not self.preserve_think_blocks:
            for m in msgs:
                if m.get("role") == "assistant" and isinstance(m.get("content"), str):

                    def _shield(match: re.Match[str]) -> str:
                        key = f"\x00ATROPOS_THINK_{len(shields)}\x00"
                        shields[key] = match.group(0)
                        return key

                    m["content"] = _THINK_RE.sub(_shield, m["content"])
        add_generation_prompt = msgs[-1].get("role") != "assistant"
        extra: dict[str, Any] = {"tools": tools} if tools else {}
        prompt = self.tokenizer.apply_chat_template(
            msgs, tokenize=False, add_generation_prompt=add_generation_prompt, **extra
        )
        if not add_generation_prompt:
            # Continuing the assistant's turn: drop the end-of-turn the template appended.
            eos = getattr(self.tokenizer, "eos_token", None)
            last = msgs[-1].get("content")
            if isinstance(last, str) and eos:
                stripped = prompt.rstrip()
                if stripped.endswith(eos):
                    prompt = stripped[: -len(eos)]
        for key, block in shields.items():
            prompt = prompt.replace(key, block)
        return prompt

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    async def _aencode(self, text: str) -> list[int]:
        if len(text) > OFFLOAD_CHARS:
            return await asyncio.to_thread(self._encode, text)
        return self._encode(text)

    async def _arender(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> str:
        size = sum(len(str(m.get("content") or "")) for m in messages if isinstance(m, dict))
        if size > OFFLOAD_CHARS:
            return await asyncio.to_thread(self._convert_messages_to_prompt, messages, tools)
        return self._convert_messages_to_prompt(messages, tools)

    def _find_extendable(self, prompt: str) -> SequenceNode | None:
        candidates = self.sequences.values() if self.track_tree else self.current_nodes
        best: SequenceNode | None = None
        for node in candidates:
            if prompt.startswith(node.full_text) and (
                best is None or len(node.full_text) > len(best.full_text)
            ):
                best = node
        return best

    # ----------------------------------------------------------------- core
    async def _generate(
        self, prompt: str, kwargs: dict[str, Any]
    ) -> tuple[list[SequenceNode], list[str], list[str]]:
        parent = self._find_extendable(prompt)
        if parent is not None:
            suffix_ids = await self._aencode(prompt[len(parent.full_text) :])
            input_ids = list(parent.tokens) + suffix_ids
            prefix_masked = list(parent.masked_tokens) + [PROMPT_MASK] * len(suffix_ids)
            prefix_logprobs = list(parent.logprobs) + [PROMPT_LOGPROB] * len(suffix_ids)
        else:
            input_ids = await self._aencode(prompt)
            prefix_masked = [PROMPT_MASK] * len(input_ids)
            prefix_logprobs = [PROMPT_LOGPROB] * len(input_ids)
        if not input_ids:
            raise ValueError("the rendered prompt is empty")
        _debug("managed request: %d prompt tokens, extends=%s", len(input_ids), parent is not None)
        call_kwargs = {k: v for k, v in kwargs.items() if k not in ("prompt", "input_ids")}
        result = await self.server.tokens_and_logprobs_completion(
            prompt=prompt, input_ids=input_ids, **call_kwargs
        )
        _, outputs, logprobs, finishes = result
        versions = output_versions(result, len(outputs))
        base = (parent.policy_version, parent.policy_version_max) if parent else (None, None)
        nodes, texts, finish_out = [], [], []
        for i, out_ids in enumerate(outputs):
            out_ids = [int(t) for t in out_ids]
            out_lps = fit_logprobs(list(logprobs[i]) if i < len(logprobs) else [], len(out_ids))
            finish = finishes[i] if i < len(finishes) else "stop"
            raw = self.tokenizer.decode(out_ids, skip_special_tokens=False)
            node = SequenceNode(
                full_text=prompt + raw,
                tokens=input_ids + out_ids,
                masked_tokens=prefix_masked + out_ids,
                logprobs=prefix_logprobs + out_lps,
                metadata={"finish_reason": finish},
            )
            node.policy_version, node.policy_version_max = merge_versions(*base, versions[i])
            nodes.append(node)
            texts.append(self.tokenizer.decode(out_ids, skip_special_tokens=True))
            finish_out.append(finish)
        self._store(parent, nodes)
        return nodes, texts, finish_out

    def _store(self, parent: SequenceNode | None, nodes: list[SequenceNode]) -> None:
        if self.track_tree:
            for node in nodes:
                self.sequences[node.full_text] = node
                self._parents[node.full_text] = parent.full_text if parent else None
            return
        if parent is not None and nodes:
            for i, existing in enumerate(self.current_nodes):
                if existing is parent:
                    self.current_nodes[i] = nodes[0]
                    self.current_nodes.extend(nodes[1:])
                    return
        self.current_nodes.extend(nodes)

    async def chat_completion(self, **kwargs: Any) -> ChatCompletion:
        """Chat completion through the tokens/logprobs backend; nodes are recorded."""
        messages = kwargs.pop("messages", None)
        if not messages:
            raise ValueError("chat_completion needs messages")
        tools = kwargs.pop("tools", None)
        kwargs.pop("tool_choice", None)
        prompt = await self._arender(messages, tools)
        _, texts, finishes = await self._generate(prompt, kwargs)
        choices = []
        for i, (text, finish) in enumerate(zip(texts, finishes, strict=False)):
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if self.translator is not None:
                content, tool_calls = self.translator.parse_model_output(text, tools)
                if tool_calls:
                    message = {"role": "assistant", "content": content, "tool_calls": tool_calls}
                    finish = "tool_calls"
            choices.append(
                Choice(
                    index=i,
                    finish_reason=finish if finish in _FINISH else "stop",  # type: ignore[arg-type]
                    message=ChatCompletionMessage(**message),
                )
            )
        return ChatCompletion(
            id=f"chatcmpl-{uuid.uuid4().hex}",
            object="chat.completion",
            created=int(time.time()),
            model=str(getattr(getattr(self.server, "config", None), "model_name", "managed")),
            choices=choices,
        )

    async def completion(self, **kwargs: Any) -> Completion:
        """Text completion through the tokens/logprobs backend; nodes are recorded."""
        prompt = kwargs.pop("prompt", None)
        if not isinstance(prompt, str) or not prompt:
            raise ValueError("completion needs a non-empty string prompt")
        _, texts, finishes = await self._generate(prompt, kwargs)
        return Completion(
            id=f"cmpl-{uuid.uuid4().hex}",
            object="text_completion",
            created=int(time.time()),
            model=str(getattr(getattr(self.server, "config", None), "model_name", "managed")),
            choices=[
                CompletionChoice(
                    index=i,
                    text=text,
                    finish_reason=finish if finish in _FINISH else "stop",  # type: ignore[arg-type]
                )
                for i, (text, finish) in enumerate(zip(texts, finishes, strict=False))
            ],
        )

    async def get_logprobs(self, **kwargs: Any) -> dict[str, Any]:
        """Prompt top-k logprobs for ``messages``, ``prompt`` or ``input_ids`` (not recorded)."""
        messages = kwargs.pop("messages", None)
        if messages is not None:
            kwargs["prompt"] = await self._arender(messages, kwargs.pop("tools", None))
        if kwargs.get("input_ids") is None:
            if not kwargs.get("prompt"):
                raise ValueError("get_logprobs needs messages, prompt or input_ids")
            kwargs["input_ids"] = await self._aencode(kwargs["prompt"])
        return await self.server.get_logprobs(**kwargs)

    # ----------------------------------------------------------------- state
    def get_state(self) -> dict[str, Any]:
        """``{"nodes": [...]}``, or ``{"sequences": {...}, "tree": {child: parent}}`` in tree mode."""
        if self.track_tree:
            return {"sequences": dict(self.sequences), "tree": dict(self._parents)}
        return {"nodes": list(self.current_nodes)}

    def reset(self) -> None:
        """Forget every tracked node."""
        self.current_nodes.clear()
        self.sequences.clear()
        self._parents.clear()


_FINISH = ("stop", "length", "tool_calls", "content_filter", "function_call")


class DummyManagedServer:
    """``ManagedServer`` stand-in for OpenAI-only endpoints (no token access).

    Completions are real; nodes hold placeholder tokens ``0..127`` (the first one
    masked as the "prompt") and logprobs -0.5. Useful to run an env end to end against
    a hosted API; useless for training.
    """

    PLACEHOLDER_TOKENS = list(range(128))

    def __init__(self, server: Any, tokenizer: Any = None, **_: Any):
        self.server = server
        self.tokenizer = tokenizer
        self.current_nodes: list[SequenceNode] = []

    def _placeholder(self, text: str, finish: str | None) -> SequenceNode:
        toks = list(self.PLACEHOLDER_TOKENS)
        return SequenceNode(
            full_text=text,
            tokens=toks,
            masked_tokens=[PROMPT_MASK] + toks[1:],
            logprobs=[PROMPT_LOGPROB] + [-0.5] * (len(toks) - 1),
            metadata={"finish_reason": finish, "placeholder": True},
        )

    async def chat_completion(self, **kwargs: Any) -> Any:
        """Forward to the server and record placeholder nodes."""
        completion = await self.server.chat_completion(**kwargs)
        for choice in completion.choices:
            self.current_nodes.append(
                self._placeholder(choice.message.content or "", choice.finish_reason)
            )
        return completion

    async def completion(self, **kwargs: Any) -> Any:
        """Forward to the server and record placeholder nodes."""
        completion = await self.server.completion(**kwargs)
        for choice in completion.choices:
            self.current_nodes.append(self._placeholder(choice.text, choice.finish_reason))
        return completion

    def get_state(self) -> dict[str, Any]:
        """``{"nodes": [...]}`` with placeholder nodes."""
        return {"nodes": list(self.current_nodes)}

    def reset(self) -> None:
        """Forget every node."""
        self.current_nodes.clear()


class _Create:
    def __init__(self, fn: Any):
        self.create = fn


class _Chat:
    def __init__(self, fn: Any):
        self.completions = _Create(fn)


class ManagedServerAdapter:
    """Duck-types ``openai.AsyncOpenAI`` over a ``ManagedServer``.

    ``adapter.chat.completions.create(...)`` and ``adapter.completions.create(...)``
    go through the managed server (and are recorded); ``base_url`` is informative.
    """

    def __init__(self, managed_server: Any, base_url: str = "http://managed-server/v1"):
        self.managed_server = managed_server
        self.base_url = base_url
        self.chat = _Chat(self._chat_create)
        self.completions = _Create(self._completion_create)

    async def _chat_create(self, **kwargs: Any) -> Any:
        return await self.managed_server.chat_completion(**kwargs)

    async def _completion_create(self, **kwargs: Any) -> Any:
        return await self.managed_server.completion(**kwargs)
