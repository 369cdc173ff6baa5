"""``DummyManagedServer``: the ``ManagedServer`` stand-in for OpenAI-only endpoints, which
give no token access."""

from __future__ import annotations

from typing import Any

from atroposlib.envs.server_handling.sequence_node import PROMPT_MASK, SequenceNode
from atroposlib.envs.server_handling.session_affinity import in_session, new_session_id


class DummyManagedServer:
    """``ManagedServer`` stand-in for OpenAI-only endpoints (no token access).

    Completions are real; nodes hold the placeholder tokens ``0..127``
    (``DUMMY_TOKENS``), the first one masked (``DUMMY_MASKED_TOKENS``), and logprobs
    -0.5 (``DUMMY_LOGPROBS``). Useful to run an env end to end against a hosted API;
    useless for training.
    """

    DUMMY_TOKENS = list(range(128))
    DUMMY_MASKED_TOKENS = [PROMPT_MASK] + DUMMY_TOKENS[1:]
    DUMMY_LOGPROBS = [-0.5] * 128

    def __init__(
        self,
        server: Any,
        tokenizer: Any = None,
        track_tree: bool = False,
        session_id: str | None = None,
        **_: Any,
    ):
        self.server = server
        self.session_id = session_id or new_session_id()
        self.tokenizer = tokenizer
        self.track_tree = track_tree
        self.current_nodes: list[SequenceNode] = []
        self.sequences: dict[str, SequenceNode] = {}

    def _messages_to_text(self, messages: list[dict[str, Any]]) -> str:
        """The prompt text of ``messages``: the tokenizer's chat template when there is
        one, else ``role: content`` lines."""
        apply = getattr(self.tokenizer, "apply_chat_template", None)
        if callable(apply) and getattr(self.tokenizer, "chat_template", None):
            return apply(list(messages), tokenize=False, add_generation_prompt=True)
        return "\n".join(f"{m.get('role', '')}: {m.get('content') or ''}" for m in messages)

    def _create_dummy_node(self, full_text: str, finish_reason: str = "stop") -> SequenceNode:
        """A placeholder node for ``full_text`` (prompt and completion)."""
        return SequenceNode(
            full_text=full_text,
            tokens=list(self.DUMMY_TOKENS),
            masked_tokens=list(self.DUMMY_MASKED_TOKENS),
            logprobs=list(self.DUMMY_LOGPROBS),
            metadata={"finish_reason": finish_reason, "placeholder": True},
        )

    def _record(self, node: SequenceNode) -> None:
        if self.track_tree:
            self.sequences[node.full_text] = node
        else:
            self.current_nodes.append(node)

    async def chat_completion(self, **kwargs: Any) -> Any:
        """Forward to the server and record placeholder nodes."""
        prompt = self._messages_to_text(kwargs.get("messages") or [])
        completion = await in_session(self.session_id, self.server.chat_completion, **kwargs)
        for choice in completion.choices:
            text = prompt + (choice.message.content or "")
            self._record(self._create_dummy_node(text, choice.finish_reason or "stop"))
        return completion

    async def completion(self, **kwargs: Any) -> Any:
        """Forward to the server and record placeholder nodes."""
        prompt = str(kwargs.get("prompt") or "")
        completion = await in_session(self.session_id, self.server.completion, **kwargs)
        for choice in completion.choices:
            self._record(
                self._create_dummy_node(prompt + choice.text, choice.finish_reason or "stop")
            )
        return completion

    async def get_logprobs(self, **kwargs: Any) -> dict[str, Any]:
        """The server's prompt logprobs when it has ``get_logprobs``; NotImplementedError
        naming the server's type otherwise."""
        fetch = getattr(self.server, "get_logprobs", None)
        if not callable(fetch):
            raise NotImplementedError(
                f"{type(self.server).__name__} does not implement get_logprobs"
            )
        messages = kwargs.pop("messages", None)
        if messages is not None:
            kwargs["prompt"] = self._messages_to_text(messages)
        return await in_session(self.session_id, fetch, **kwargs)

    def get_state(self) -> dict[str, Any]:
        """``{"nodes": [...]}`` with placeholder nodes (``{"sequences": ...}`` in tree mode)."""
        if self.track_tree:
            return {"sequences": dict(self.sequences)}
        return {"nodes": list(self.current_nodes)}

    def reset(self) -> None:
        """Forget every node."""
        self.current_nodes.clear()
        self.sequences.clear()
