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

Beside it, and importable from here as in the original: the node model (``sequence_node``),
the tokenizer choice (``managed_tokenizer``), the OpenAI-client adapter (``managed_adapter``)
and the stand-in for OpenAI-only endpoints (``dummy_managed_server``).
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import os
import time
import uuid
from typing import Any

from openai.types import Completion, CompletionChoice
from openai.types.chat import ChatCompletion, ChatCompletionMessage
from openai.types.chat.chat_completion import Choice

from atroposlib.envs.server_handling._common import (  # noqa: F401 - original import path
    config_tokenizer_name,
    load_tokenizer,
)
from atroposlib.envs.server_handling._continuations import (
    completion_texts,
    continued_text,
    special_token_ids,
)
from atroposlib.envs.server_handling.dummy_managed_server import (  # noqa: F401 - original import path
    DummyManagedServer,
)
from atroposlib.envs.server_handling.managed_adapter import (  # noqa: F401 - original import path
    _CLIENT_ONLY,
    _ROLLOUT_ORDER,
    ManagedServerAdapter,
    _openai_kwargs,
)
from atroposlib.envs.server_handling.managed_tokenizer import (  # noqa: F401 - original import path
    own_tokenizer,
    resolve_tokenizer,
    server_tokenizer,
)
from atroposlib.envs.server_handling.policy_version import merge_versions, output_versions
from atroposlib.envs.server_handling.sampling_record import note_request, note_sequence
from atroposlib.envs.server_handling.sequence_node import (  # noqa: F401 - original import path
    PROMPT_LOGPROB,
    PROMPT_MASK,
    SequenceNode,
    fit_logprobs,
)
from atroposlib.envs.server_handling.session_affinity import in_session, new_session_id
from atroposlib.envs.server_handling.tool_call_translator import ToolCallTranslator

logger = logging.getLogger(__name__)

OFFLOAD_CHARS = 32_768
"""Prompts (or message lists) longer than this many characters are rendered and tokenized
in a worker thread, so a large request does not stall the event loop (health probes,
other sessions) for the milliseconds to seconds that takes."""


class ManagedServer:
    """Wraps one server that implements ``tokens_and_logprobs_completion``.

    ``tokenizer`` is optional: without one the server's own ``tokenizer`` is used, else
    the one its config names (``tokenizer_name``, or ``model_name`` when that is
    ``"none"``) is loaded. ``tool_parser`` (e.g. ``"hermes"``) turns ``<tool_call>``
    blocks into OpenAI ``tool_calls`` in the returned completion; nodes keep the raw text.
    Unless ``preserve_think_blocks`` is set, ``<think>`` blocks in assistant messages
    are shielded with placeholders while the chat template renders, so templates that
    strip earlier reasoning cannot break prefix extension.

    Token sequences: a new sequence's prompt text is encoded with the tokenizer's special
    tokens (a Llama-style BOS is kept, as the server would add it), except that a prompt
    whose text already begins with the BOS (chat templates that write it) never gets a
    second one; a prompt that extends an existing node's text reuses that node's tokens
    and encodes only the new suffix, without special tokens. Nodes are listed in the order
    the requests were made (an extension keeps its node's place), whatever order the
    server answers in; nodes recorded through a ``ManagedServerAdapter`` instead take their
    place when the asyncio task that made them finishes (see the adapter).
    """

    _THINK_OPEN = "__MNGD_THINK__"
    _THINK_CLOSE = "__MNGD_ENDTHINK__"
    _specials_cache: tuple[Any, frozenset[int]] | None = None

    def __init__(
        self,
        server: Any,
        tokenizer: Any = None,
        track_tree: bool = False,
        tool_parser: str | None = None,
        preserve_think_blocks: bool = False,
        session_id: str | None = None,
    ):
        self.server = server
        self.session_id = session_id or new_session_id()
        """Sent as ``X-Session-ID`` with every upstream request (see ``session_affinity``)."""
        self.tokenizer = tokenizer
        self.track_tree = track_tree
        self.tool_parser = tool_parser
        self.preserve_think_blocks = preserve_think_blocks
        self._translator: ToolCallTranslator | None = None
        self._initialize_tokenizer()
        self._get_translator()  # an unknown parser fails here, not on the first request
        self.current_nodes: list[SequenceNode] = []
        self.sequences: dict[str, SequenceNode] = {}
        self._parents: dict[str, str | None] = {}
        # Request order of current_nodes (parallel list): nodes sort by the ticket their
        # request took when it was made, so answers arriving out of order keep their place.
        self._tickets: list[int] = []
        # The asyncio task that recorded each node through the adapter (None otherwise);
        # when it finishes, its nodes move to the ticket current at that moment.
        self._owners: list[asyncio.Task | None] = []
        self._next_ticket = 0

    def _initialize_tokenizer(self) -> None:
        """Load the tokenizer from the server when none was given (see the class doc)."""
        if self.tokenizer is None:
            self.tokenizer = server_tokenizer(self.server)

    def _get_translator(self) -> ToolCallTranslator | None:
        """The tool-call translator of ``tool_parser`` (made once), or None without one."""
        if self._translator is None and self.tool_parser:
            self._translator = ToolCallTranslator(self.tokenizer, self.tool_parser)
        return self._translator

    @property
    def translator(self) -> ToolCallTranslator | None:
        """The tool-call translator, or None when no ``tool_parser`` was given."""
        return self._get_translator()

    # ----------------------------------------------------------------- prompt rendering
    def _protect_think_blocks(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Copies of ``messages`` whose assistant ``<think>``/``</think>`` tags are replaced
        by placeholders (``_THINK_OPEN``/``_THINK_CLOSE``), so a chat template that strips
        earlier reasoning leaves them in; :meth:`_convert_messages_to_prompt` puts the tags
        back after rendering."""
        out = []
        for m in messages:
            content = m.get("content")
            if m.get("role") == "assistant" and isinstance(content, str) and "<think>" in content:
                content = content.replace("<think>", self._THINK_OPEN).replace(
                    "</think>", self._THINK_CLOSE
                )
                m = {**m, "content": content}
            out.append(m)
        return out

    def _convert_messages_to_prompt(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> str:
        """The prompt text the chat template renders for ``messages`` (and ``tools``)."""
        if not messages:
            raise ValueError("messages must not be empty")
        msgs = [dict(m) for m in messages]
        translator = self._get_translator()
        if translator is not None:
            msgs = translator.convert_messages_for_template(msgs)
        if not self.preserve_think_blocks:
            msgs = self._protect_think_blocks(msgs)
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
        if not self.preserve_think_blocks:
            prompt = prompt.replace(self._THINK_OPEN, "<think>").replace(
                self._THINK_CLOSE, "</think>"
            )
        return prompt

    def _debug_requests_enabled(self) -> bool:
        """Whether ``ATROPOS_DEBUG_REQUESTS=1`` asks for a log line per request."""
        return os.environ.get("ATROPOS_DEBUG_REQUESTS") == "1"

    def _encode(self, text: str) -> list[int]:
        return self._compute_input_ids(text, None)

    async def _aencode(self, text: str) -> list[int]:
        """The token ids of a new sequence's prompt ``text`` (off the event loop when long)."""
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

    # ----------------------------------------------------------------- sequences
    def _longest_prefix_node(self, input_text: str, candidates: Any) -> SequenceNode | None:
        """The node with the longest text (``full_text``, or the completion as the caller was
        shown it: special tokens dropped) that ``input_text`` starts with."""
        best: SequenceNode | None = None
        best_len = -1
        for node in candidates:
            text = continued_text(node.full_text, node._continuations, input_text)
            if text is not None and len(text) > best_len:
                best, best_len = node, len(text)
        return best

    def _find_extending_node(self, input_text: str) -> SequenceNode | None:
        """The node whose full text is the longest prefix of ``input_text`` (the sequence
        this prompt continues), or None. Looks at the current nodes (every node in tree
        mode)."""
        candidates = self.sequences.values() if self.track_tree else self.current_nodes
        return self._longest_prefix_node(input_text, candidates)

    def _find_parent_node(self, input_text: str) -> SequenceNode | None:
        """In tree mode, the node ``input_text`` continues (its parent in the tree); None in
        the default mode, where a continued node is replaced rather than kept as a parent."""
        if not self.track_tree:
            return None
        return self._longest_prefix_node(input_text, self.sequences.values())

    def _compute_input_ids(self, input_text: str, extending_node: SequenceNode | None) -> list[int]:
        """The prompt token ids for ``input_text``.

        Extending ``extending_node``: its tokens, then the new suffix encoded without
        special tokens (the suffix follows the longest of the node's texts the prompt starts
        with, so a reply shown without its special tokens is not encoded again). A new
        sequence: the text encoded with special tokens, minus a doubled BOS when the text
        already begins with the tokenizer's BOS.
        """
        tok = self.tokenizer
        if extending_node is not None:
            known = continued_text(
                extending_node.full_text, extending_node._continuations, input_text
            )
            suffix = input_text[len(known if known is not None else extending_node.full_text) :]
            suffix_ids = list(tok.encode(suffix, add_special_tokens=False)) if suffix else []
            return list(extending_node.tokens) + [int(t) for t in suffix_ids]
        ids = [int(t) for t in tok.encode(input_text, add_special_tokens=True)]
        bos_id = getattr(tok, "bos_token_id", None)
        bos = getattr(tok, "bos_token", None)
        if (
            bos_id is not None
            and bos
            and len(ids) >= 2
            and ids[0] == ids[1] == bos_id
            and input_text.startswith(bos)
        ):
            ids = ids[1:]
        return ids

    def _create_sequence_node(
        self,
        input_text: str,
        parent_node: SequenceNode | None,
        prompt_tokens: list[int],
        output_tokens: list[int],
        output_logprobs: list[float],
        completion_text: str,
        finish_reason: str = "stop",
        extending_node: SequenceNode | None = None,
    ) -> SequenceNode:
        """The node for one completion of ``input_text``.

        ``masked_tokens`` is -100 over the prompt and the token ids over the output;
        ``logprobs`` 1.0 over the prompt and the sampler's over the output. When the prompt
        extends ``extending_node``, that node's masks and logprobs are kept for its part
        (its generated turns stay trainable). The policy versions merge those of the node
        continued (``extending_node``, else ``parent_node``).
        """
        prompt_tokens = [int(t) for t in prompt_tokens]
        output_tokens = [int(t) for t in output_tokens]
        base = extending_node if extending_node is not None else None
        if base is not None and prompt_tokens[: len(base.tokens)] == list(base.tokens):
            new = len(prompt_tokens) - len(base.tokens)
            masked = list(base.masked_tokens) + [PROMPT_MASK] * new
            lps = list(base.logprobs) + [PROMPT_LOGPROB] * new
        else:
            masked = [PROMPT_MASK] * len(prompt_tokens)
            lps = [PROMPT_LOGPROB] * len(prompt_tokens)
        node = SequenceNode(
            full_text=input_text + completion_text,
            tokens=prompt_tokens + output_tokens,
            masked_tokens=masked + output_tokens,
            logprobs=lps + fit_logprobs(list(output_logprobs), len(output_tokens)),
            metadata={"finish_reason": finish_reason},
        )
        before = extending_node if extending_node is not None else parent_node
        if before is not None:
            node.policy_version = before.policy_version
            node.policy_version_max = before.policy_version_max
        return node

    # ----------------------------------------------------------------- core
    def _take_ticket(self) -> int:
        ticket = self._next_ticket
        self._next_ticket += 1
        return ticket

    async def _generate(
        self, prompt: str, kwargs: dict[str, Any], ticket: int | None = None
    ) -> tuple[list[SequenceNode], list[str], list[str]]:
        if ticket is None:
            ticket = self._take_ticket()
        extending = self._find_extending_node(prompt)
        parent = self._find_parent_node(prompt)
        if extending is None and len(prompt) > OFFLOAD_CHARS:
            input_ids = await asyncio.to_thread(self._compute_input_ids, prompt, None)
        else:
            input_ids = self._compute_input_ids(prompt, extending)
        if not input_ids:
            raise ValueError("the rendered prompt is empty")
        if self._debug_requests_enabled():
            logger.info(
                "managed request: %d prompt tokens, extends=%s",
                len(input_ids),
                extending is not None,
            )
        call_kwargs = {k: v for k, v in kwargs.items() if k not in ("prompt", "input_ids")}
        if call_kwargs.get("split", "train") != "eval":
            note_request(call_kwargs)  # also for backends that are not APIServers
        result = await in_session(
            self.session_id,
            self.server.tokens_and_logprobs_completion,
            prompt=prompt,
            input_ids=input_ids,
            **call_kwargs,
        )
        _, outputs, logprobs, finishes = result
        versions = output_versions(result, len(outputs))
        nodes, texts, finish_out = [], [], []
        specials = self._special_ids()
        for i, out_ids in enumerate(outputs):
            out_ids = [int(t) for t in out_ids]
            finish = finishes[i] if i < len(finishes) else "stop"
            raw, shown, others = completion_texts(self.tokenizer, out_ids, specials)
            node = self._create_sequence_node(
                prompt,
                parent,
                input_ids,
                out_ids,
                list(logprobs[i]) if i < len(logprobs) else [],
                raw,
                finish_reason=finish,
                extending_node=extending,
            )
            node._continuations = tuple(prompt + text for text in others)
            node.policy_version, node.policy_version_max = merge_versions(
                node.policy_version, node.policy_version_max, versions[i]
            )
            nodes.append(node)
            note_sequence(node.tokens, finish)  # carried into the group's overrides
            texts.append(shown)
            finish_out.append(finish)
        self._store(extending, parent, nodes, ticket)
        return nodes, texts, finish_out

    def _special_ids(self) -> frozenset[int]:
        """The current tokenizer's special token ids (worked out once per tokenizer)."""
        cached = self._specials_cache
        if cached is None or cached[0] is not self.tokenizer:
            cached = self._specials_cache = (self.tokenizer, special_token_ids(self.tokenizer))
        return cached[1]

    def _store(
        self,
        extending: SequenceNode | None,
        parent: SequenceNode | None,
        nodes: list[SequenceNode],
        ticket: int,
    ) -> None:
        if self.track_tree:
            for node in nodes:
                self.sequences[node.full_text] = node
                self._parents[node.full_text] = parent.full_text if parent else None
            return
        owner = self._rollout_owner()
        if extending is not None and nodes:
            for i, existing in enumerate(self.current_nodes):
                if existing is extending:
                    # The continued sequence keeps its place; further choices follow it.
                    self.current_nodes[i : i + 1] = nodes
                    self._tickets[i : i + 1] = [self._tickets[i]] * len(nodes)
                    self._owners[i : i + 1] = [owner or self._owners[i]] * len(nodes)
                    return
        # Insert after every node of an earlier (or the same) request: request order.
        pos = bisect.bisect_right(self._tickets, ticket)
        self.current_nodes[pos:pos] = nodes
        self._tickets[pos:pos] = [ticket] * len(nodes)
        self._owners[pos:pos] = [owner] * len(nodes)

    def _rollout_owner(self) -> asyncio.Task | None:
        """The running task when this call came through the adapter, watched so that its
        nodes move into completion order when it finishes; None for direct calls."""
        if not _ROLLOUT_ORDER.get():
            return None
        task = asyncio.current_task()
        if task is None or task.done():
            return None
        if task not in self._owners:
            task.add_done_callback(self._rollout_finished)
        return task

    def _rollout_finished(self, task: asyncio.Task) -> None:
        """Give the nodes of ``task`` the ticket current now: frameworks that run each
        rollout in its own task and collect them as they complete (verifiers'
        ``generate`` returns its states in that order) then find rollout ``i``'s tokens
        at node ``i``. The sort is stable, so a request's choices keep their order."""
        if task not in self._owners:
            return  # reset since
        ticket = self._take_ticket()
        keyed = [
            (ticket if owner is task else t, node, None if owner is task else owner)
            for t, node, owner in zip(self._tickets, self.current_nodes, self._owners, strict=True)
        ]
        keyed.sort(key=lambda entry: entry[0])
        self._tickets = [t for t, _, _ in keyed]
        self.current_nodes[:] = [node for _, node, _ in keyed]
        self._owners = [owner for _, _, owner in keyed]

    async def chat_completion(self, **kwargs: Any) -> ChatCompletion:
        """Chat completion through the tokens/logprobs backend; nodes are recorded."""
        ticket = self._take_ticket()
        messages = kwargs.pop("messages", None)
        if not messages:
            raise ValueError("chat_completion needs messages")
        tools = kwargs.pop("tools", None)
        tool_choice = kwargs.pop("tool_choice", None)
        prompt = await self._arender(messages, tools)
        _, texts, finishes = await self._generate(prompt, kwargs, ticket)
        translator = self._get_translator()
        choices = []
        for i, (text, finish) in enumerate(zip(texts, finishes, strict=False)):
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if translator is not None and tool_choice != "none":
                content, tool_calls, parsed_finish = translator.parse_model_output(
                    text, tool_choice if isinstance(tool_choice, str) else None, tools
                )
                if tool_calls:
                    message = {"role": "assistant", "content": content, "tool_calls": tool_calls}
                    finish = parsed_finish
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
        ticket = self._take_ticket()
        prompt = kwargs.pop("prompt", None)
        if not isinstance(prompt, str) or not prompt:
            raise ValueError("completion needs a non-empty string prompt")
        _, texts, finishes = await self._generate(prompt, kwargs, ticket)
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
        """Prompt top-k logprobs for ``messages``, ``prompt`` or ``input_ids`` (not recorded).

        A prompt is encoded as a new sequence's prompt is. NotImplementedError naming the
        server's type when the server has no ``get_logprobs``.
        """
        fetch = getattr(self.server, "get_logprobs", None)
        if not callable(fetch):
            raise NotImplementedError(
                f"{type(self.server).__name__} does not implement get_logprobs, so "
                "ManagedServer cannot return prompt logprobs through it"
            )
        messages = kwargs.pop("messages", None)
        if messages is not None:
            kwargs["prompt"] = await self._arender(messages, kwargs.pop("tools", None))
        if kwargs.get("input_ids") is None:
            if not kwargs.get("prompt"):
                raise ValueError("get_logprobs needs messages, prompt or input_ids")
            kwargs["input_ids"] = await self._aencode(kwargs["prompt"])
        return await in_session(self.session_id, fetch, **kwargs)

    # ----------------------------------------------------------------- state
    def get_state(self) -> dict[str, Any]:
        """``{"nodes": [...]}``, or ``{"sequences": {...}, "tree": {child: parent}}`` in tree mode."""
        if self.track_tree:
            return {"sequences": dict(self.sequences), "tree": dict(self._parents)}
        return {"nodes": list(self.current_nodes)}

    def reset(self) -> None:
        """Forget every tracked node."""
        self.current_nodes.clear()
        self._tickets.clear()
        self._owners.clear()
        self.sequences.clear()
        self._parents.clear()


_FINISH = ("stop", "length", "tool_calls", "content_filter", "function_call")
