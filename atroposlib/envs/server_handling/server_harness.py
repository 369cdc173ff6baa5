"""``ServerHarness``: an in-process mock server that replays canned responses.

Usable directly or through ``ServerManager(..., testing=True)`` (it is a real
``APIServer``, with the same semaphores and request path, minus the network).

Example::

    harness = ServerHarness()
    messages = [{"role": "user", "content": "hi"}]
    harness.set_desired_response(messages, create_chat_completion(["hello", "hey"], n=2))
    completion = await harness.chat_completion(messages=messages, n=2)
"""

from __future__ import annotations

from typing import Any, Sequence, Union

from openai.types import Completion, CompletionChoice
from openai.types.chat import ChatCompletion, ChatCompletionMessage
from openai.types.chat.chat_completion import Choice

from atroposlib.envs.server_handling.server_baseline import APIServer, APIServerConfig
from atroposlib.http.openai_protocol import completion_body

TokensResponse = tuple[list[int], list[list[int]], list[list[float]], list[str]]


class _GetLogprobsOnceSet:
    """``ServerHarness.get_logprobs``: present only once ``set_logprobs_response`` gave it
    an answer, so a bare harness is a backend without prompt logprobs (``hasattr`` is
    false, and ``ManagedServer.get_logprobs`` raises NotImplementedError over it, as
    test code built for the original expects). A non-data descriptor: a test may still
    assign its own ``harness.get_logprobs``."""

    def __get__(self, obj: Any, objtype: type | None = None) -> Any:
        if obj is None:
            return self
        if not obj.__dict__.get("logprobs_map"):
            raise AttributeError(
                f"{type(obj).__name__} has no get_logprobs until set_logprobs_response "
                "gives it an answer"
            )
        return APIServer.get_logprobs.__get__(obj, objtype)


def _as_list(value: Union[str, Sequence[str]], n: int) -> list[str]:
    if isinstance(value, str):
        return [value] * n
    values = list(value)
    if len(values) != n:
        raise ValueError(f"expected {n} values, got {len(values)}")
    return values


def _canned_choices(
    resp: Union[str, Sequence[str]], n: int, finish_reason: Union[str, Sequence[str]]
) -> list[tuple[int, str, str]]:
    """``(index, text, finish_reason)`` of each of ``n`` canned choices."""
    return list(zip(range(n), _as_list(resp, n), _as_list(finish_reason, n), strict=True))


def create_chat_completion(
    resp: Union[str, Sequence[str]], n: int = 1, finish_reason: Union[str, Sequence[str]] = "stop"
) -> ChatCompletion:
    """A ``ChatCompletion`` with ``n`` assistant choices (``resp`` one text or a list of n)."""
    choices = [
        Choice(
            index=i,
            finish_reason=reason,  # type: ignore[arg-type]
            message=ChatCompletionMessage(role="assistant", content=text),
        )
        for i, text, reason in _canned_choices(resp, n, finish_reason)
    ]
    return ChatCompletion(**completion_body("chat.completion", "harness", choices))


def create_completion(
    resp: Union[str, Sequence[str]], n: int = 1, finish_reason: Union[str, Sequence[str]] = "stop"
) -> Completion:
    """A ``Completion`` with ``n`` text choices."""
    choices = [
        CompletionChoice(index=i, finish_reason=reason, text=text)  # type: ignore[arg-type]
        for i, text, reason in _canned_choices(resp, n, finish_reason)
    ]
    return Completion(**completion_body("text_completion", "harness", choices))


def _positional(args: tuple[Any, ...], name: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` with a lone positional argument taken as ``name``."""
    if not args:
        return kwargs
    if len(args) > 1 or name in kwargs:
        raise TypeError(
            f"ServerHarness takes {name} once: as the one positional argument or by name"
        )
    return {**kwargs, name: args[0]}


class ServerHarness(APIServer):
    """A mock inference server answering from maps set by the test."""

    retry_attempts = 1  # a missing canned response is a test bug: fail at once

    def __init__(self, config: APIServerConfig | None = None, **_: Any):
        super().__init__(
            config or APIServerConfig(model_name="harness", health_check=False, base_url="")
        )
        self.response_map: dict[str, Any] = {}
        self.tokens_map: dict[Union[str, tuple[int, ...]], TokensResponse] = {}
        self.logprobs_map: dict[Union[str, tuple[int, ...]], dict[str, Any]] = {}

    @staticmethod
    def conv_to_dictkey(input_message: Sequence[dict[str, Any]]) -> str:
        """The lookup key of a conversation: ``role:...``/``content:...`` lines."""
        lines = []
        for item in input_message:
            lines.append(f"role:{item['role']}")
            lines.append(f"content:{item['content']}")
        return "\n".join(lines)

    def set_desired_response(
        self, input_message: Sequence[dict[str, Any]], desired_response: ChatCompletion
    ) -> None:
        """Answer ``desired_response`` to a chat request with these messages."""
        self.response_map[self.conv_to_dictkey(input_message)] = desired_response

    def set_desired_completion(self, input_message: str, completion: Completion) -> None:
        """Answer ``completion`` to a completion request with this prompt."""
        self.response_map[input_message] = completion

    def set_tokens_and_logprobs_response(
        self,
        prompt: Union[str, Sequence[int]],
        prompt_tokens: list[int] | None = None,
        output_tokens_list: list[list[int]] | None = None,
        output_logprobs_list: list[list[float]] | None = None,
        finish_reasons: list[str] | None = None,
    ) -> None:
        """Answer a ``tokens_and_logprobs_completion`` for ``prompt`` (text or token ids).

        Missing logprobs default to -0.5 per token, finish reasons to ``"stop"``.
        """
        outputs = output_tokens_list or [[]]
        lps = output_logprobs_list or [[-0.5] * len(o) for o in outputs]
        reasons = finish_reasons or ["stop"] * len(outputs)
        if not (len(outputs) == len(lps) == len(reasons)):
            raise ValueError(
                "output_tokens_list, output_logprobs_list and finish_reasons differ in length"
            )
        key = prompt if isinstance(prompt, str) else tuple(int(t) for t in prompt)
        tokens = (
            list(prompt_tokens)
            if prompt_tokens is not None
            else (
                [] if isinstance(prompt, str) else list(key)  # type: ignore[arg-type]
            )
        )
        self.tokens_map[key] = (tokens, outputs, lps, reasons)

    def set_logprobs_response(
        self, prompt: Union[str, Sequence[int]], response: dict[str, Any]
    ) -> None:
        """Answer a ``get_logprobs`` call for ``prompt``."""
        key = prompt if isinstance(prompt, str) else tuple(int(t) for t in prompt)
        self.logprobs_map[key] = response

    get_logprobs = _GetLogprobsOnceSet()

    async def chat_completion(self, *args: Any, **kwargs: Any) -> ChatCompletion:
        """The canned answer for ``messages`` (which may also come as the one positional
        argument)."""
        return await super().chat_completion(**_positional(args, "messages", kwargs))

    async def completion(self, *args: Any, **kwargs: Any) -> Completion:
        """The canned answer for ``prompt`` (which may also come as the one positional
        argument)."""
        return await super().completion(**_positional(args, "prompt", kwargs))

    async def _chat_completion_wrapper(self, **kwargs: Any) -> ChatCompletion:
        key = self.conv_to_dictkey(kwargs.get("messages") or [])
        if key not in self.response_map:
            raise KeyError(f"ServerHarness has no response for the conversation:\n{key}")
        return self.response_map[key]

    async def _completion_wrapper(self, **kwargs: Any) -> Completion:
        prompt = kwargs.get("prompt")
        if prompt not in self.response_map:
            raise KeyError(f"ServerHarness has no completion for the prompt {prompt!r}")
        return self.response_map[prompt]

    def _lookup(self, table: dict[Any, Any], kwargs: dict[str, Any], what: str) -> Any:
        prompt = kwargs.get("prompt")
        if isinstance(prompt, str) and prompt in table:
            return table[prompt]
        ids = kwargs.get("input_ids")
        if ids is not None and tuple(int(t) for t in ids) in table:
            return table[tuple(int(t) for t in ids)]
        raise KeyError(
            f"ServerHarness has no {what} response for prompt={prompt!r} input_ids={ids!r}"
        )

    async def _tokens_and_logprobs_completion_wrapper(self, **kwargs: Any) -> TokensResponse:
        tokens, outputs, lps, reasons = self._lookup(self.tokens_map, kwargs, "tokens/logprobs")
        if not tokens and kwargs.get("input_ids") is not None:
            tokens = [int(t) for t in kwargs["input_ids"]]
        return list(tokens), [list(o) for o in outputs], [list(lp) for lp in lps], list(reasons)

    async def _get_logprobs_wrapper(self, **kwargs: Any) -> dict[str, Any]:
        return self._lookup(self.logprobs_map, kwargs, "get_logprobs")
