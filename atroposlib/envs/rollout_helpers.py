"""Single-turn chat rollouts through ``ManagedServer``, and the group they make.

Environments that ask one chat question and score each answer (gsm8k, mcqa, tool
calling, dataset) all open a ``managed_server`` context, request ``group_size``
completions, and copy each completion's tokens, mask and inference logprobs next to its
text. These two functions do that, so an environment file keeps only its prompt and its
score. ``environments/TUTORIAL.md`` shows the same steps written out.

Example::

    rollouts = await managed_chat_rollouts(self, messages, temperature=1.0)
    scores = [my_score(r["text"], item) for r in rollouts]
    return scored_group(rollouts, scores), []
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence

from atroposlib.envs.config import ScoredDataGroup

__all__ = ["managed_chat_rollouts", "scored_group"]


async def managed_chat_rollouts(
    env: Any,
    messages: List[Dict[str, Any]],
    *,
    n: int | None = None,
    max_tokens: int | None = None,
    temperature: float = 1.0,
    **kwargs: Any,
) -> List[Dict[str, Any]]:
    """``n`` (default ``group_size``) answers to ``messages``, tracked token by token.

    Each rollout is ``{"messages", "text", "finish_reason", "tokens", "masks", "logprobs"}``:
    the conversation with the answer appended, the answer's text, and the full sequence
    with the prompt masked as -100 and logprob 1.0 on the prompt tokens.
    """
    async with env.server.managed_server(tokenizer=env.tokenizer) as managed:
        completion = await managed.chat_completion(
            messages=messages,
            n=n or env.config.group_size,
            max_tokens=max_tokens or env.config.max_token_length,
            temperature=temperature,
            **kwargs,
        )
        nodes = managed.get_state()["nodes"]
    rollouts = []
    for choice, node in zip(completion.choices, nodes, strict=False):
        text = choice.message.content or ""
        rollouts.append(
            {
                "messages": list(messages) + [{"role": "assistant", "content": text}],
                "text": text,
                "finish_reason": choice.finish_reason,
                "tokens": list(node.tokens),
                "masks": list(node.masked_tokens),
                "logprobs": list(node.logprobs),
            }
        )
    return rollouts


def scored_group(rollouts: Sequence[Dict[str, Any]], scores: Sequence[float]) -> ScoredDataGroup:
    """The ``ScoredDataGroup`` of ``rollouts`` (tokens, masks, logprobs, messages) with ``scores``.

    Raises:
        ValueError: when there is not exactly one score per rollout.
    """
    if len(scores) != len(rollouts):
        raise ValueError(f"{len(scores)} scores for {len(rollouts)} rollouts")
    return ScoredDataGroup(
        tokens=[r["tokens"] for r in rollouts],
        masks=[r["masks"] for r in rollouts],
        scores=[float(s) for s in scores],
        inference_logprobs=[r["logprobs"] for r in rollouts],
        messages=[r["messages"] for r in rollouts],
    )
