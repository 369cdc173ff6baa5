"""Force diversity in a group by giving each sample a different first token.

GRPO learns nothing from a group whose samples are identical. Sampling the first
token *without replacement* from the model's top-k first-token distribution, then
letting the model continue from each, spreads a group over distinct openings.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
from typing import Any, Dict, List, Mapping

logger = logging.getLogger(__name__)


def select_diverse_first_tokens(
    top_logprobs: Mapping[str, float],
    n: int,
    temperature: float = 1.0,
    rng: random.Random | None = None,
) -> List[str]:
    """Sample up to ``n`` distinct tokens from ``{token: logprob}`` without replacement.

    Probabilities are ``softmax(logprob / temperature)``; ``temperature <= 0`` takes the
    most likely tokens in order. Returns ``min(n, len(top_logprobs))`` tokens.
    """
    if n <= 0 or not top_logprobs:
        return []
    rng = rng or random.Random()
    pool: Dict[str, float] = dict(top_logprobs)
    chosen: List[str] = []
    while pool and len(chosen) < n:
        if temperature <= 0:
            token = max(pool, key=lambda t: pool[t])
        else:
            top = max(pool.values())
            weights = {t: math.exp((lp - top) / temperature) for t, lp in pool.items()}
            total = sum(weights.values())
            threshold = rng.random() * total
            running = 0.0
            candidates = list(weights.items())
            token = candidates[-1][0]
            for candidate, w in candidates:
                running += w
                if running >= threshold:
                    token = candidate
                    break
        chosen.append(token)
        del pool[token]
    return chosen


def _top_logprobs_of_first_token(completion: Any) -> Dict[str, float]:
    logprobs = completion.choices[0].logprobs
    top = getattr(logprobs, "top_logprobs", None) if logprobs is not None else None
    if not top:
        return {}
    return {str(k): float(v) for k, v in dict(top[0]).items()}


async def generate_with_diverse_first_tokens(
    self: Any,
    messages: Any,
    prefill: str = "",
    n: int = 8,
    max_tokens: int = 4096,
    temperature: float = 1.0,
    top_logprobs: int = 20,
    seed: int | None = None,
    **kwargs: Any,
) -> List[str]:
    """Generate ``n`` completions that start with different tokens.

    Written, as the original, to be bound to an environment (``self`` with ``server`` and
    ``tokenizer``): ``messages`` (a chat) is rendered with the tokenizer's chat template
    and ``prefill`` appended. ``self`` may also be the server itself (anything with an
    OpenAI-style async ``completion(prompt=..., ...)``: a ``ServerManager`` or an
    ``APIServer``) and ``messages`` a prompt string. One 1-token call with
    ``logprobs=top_logprobs`` gives the first-token distribution; each chosen token is
    appended to the prompt and continued concurrently. When fewer than ``n`` distinct
    tokens are available, the rest are ordinary samples.

    Returns the completion texts after the prefill (first token included), ``n`` of them.
    """
    if n <= 0:
        return []
    server = getattr(self, "server", None) or self
    if isinstance(messages, str):
        prompt = messages + prefill
    else:
        tokenizer = getattr(self, "tokenizer", None)
        if tokenizer is None:
            raise ValueError("chat messages need self.tokenizer to render them into a prompt")
        prompt = (
            tokenizer.apply_chat_template(
                list(messages), tokenize=False, add_generation_prompt=True
            )
            + prefill
        )
    rng = random.Random(seed)
    first = await server.completion(
        prompt=prompt, n=1, max_tokens=1, logprobs=top_logprobs, temperature=temperature, **kwargs
    )
    tokens = select_diverse_first_tokens(_top_logprobs_of_first_token(first), n, temperature, rng)
    if len(tokens) < n:
        logger.info(
            "only %d distinct first tokens for n=%d; sampling the rest freely", len(tokens), n
        )
    remaining = max(0, max_tokens - 1)

    async def continue_from(token: str) -> str:
        if remaining == 0:
            return token
        out = await server.completion(
            prompt=prompt + token, n=1, max_tokens=remaining, temperature=temperature, **kwargs
        )
        return token + out.choices[0].text

    texts = list(await asyncio.gather(*(continue_from(t) for t in tokens)))
    if len(texts) < n:
        extra = await server.completion(
            prompt=prompt,
            n=n - len(texts),
            max_tokens=max_tokens,
            temperature=temperature,
            **kwargs,
        )
        texts.extend(choice.text for choice in extra.choices)
    return texts[:n]


__all__ = ["generate_with_diverse_first_tokens", "select_diverse_first_tokens"]
