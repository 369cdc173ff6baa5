"""An environment that samples at a chosen temperature, for the sampling-record tests.

``--env.mode managed`` samples through ``ManagedServer`` (one request, ``n =
group_size``, ``--env.max_new_tokens`` tokens) and sends the nodes' tokens; ``plain``
asks ``server.completion`` and tokenizes the text itself. ``--env.own_params true`` sets
``generation_params`` and the first sequence's ``finish_reason`` itself (they must be
kept). Run as ``python tests/envs/sampling_env.py process [flags]``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, List, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pydantic import Field  # noqa: E402

from atroposlib.envs.base import BaseEnv, BaseEnvConfig, ScoredDataGroup  # noqa: E402
from atroposlib.envs.server_handling.server_baseline import APIServerConfig  # noqa: E402


class SamplingEnvConfig(BaseEnvConfig):
    """How the env samples."""

    mode: str = Field("managed", description="managed or plain.")
    sample_temperature: float | None = Field(0.7, description="None: name no temperature.")
    max_new_tokens: int = Field(3, description="Generation limit per sequence.")
    own_params: bool = Field(False, description="Set generation_params/overrides itself.")


class SamplingEnv(BaseEnv):
    """Groups of ``group_size`` completions of one short prompt per item."""

    name = "sampling"
    env_config_cls = SamplingEnvConfig

    @classmethod
    def config_init(cls) -> Tuple[SamplingEnvConfig, APIServerConfig]:
        return (
            SamplingEnvConfig(
                group_size=4,
                use_wandb=False,
                total_steps=2,
                steps_per_eval=0,
                max_token_length=512,
                ensure_scores_are_not_same=False,
            ),
            APIServerConfig(server_type="vllm", api_key="x"),
        )

    async def setup(self) -> None:
        self.count = 0

    async def get_next_item(self) -> int:
        self.count += 1
        return self.count

    def _sampling(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"n": self.config.group_size}
        kwargs["max_tokens"] = self.config.max_new_tokens
        if self.config.sample_temperature is not None:
            kwargs["temperature"] = self.config.sample_temperature
        return kwargs

    async def collect_trajectories(self, item: int) -> Tuple[ScoredDataGroup | None, List[Any]]:
        prompt = f"Item {item}: say something."
        if self.config.mode == "managed":
            async with self.server.managed_server(tokenizer=self.tokenizer) as managed:
                await managed.completion(prompt=prompt, **self._sampling())
                nodes = managed.get_state()["nodes"]
            tokens = [n.tokens for n in nodes]
            masks = [n.masked_tokens for n in nodes]
        else:
            completion = await self.server.completion(prompt=prompt, **self._sampling())
            tokens, masks = [], []
            for choice in completion.choices:
                p = self.tokenizer.encode(prompt)
                c = self.tokenizer.encode(choice.text, add_special_tokens=False) or [0]
                tokens.append(p + c)
                masks.append([-100] * len(p) + c)
        group = ScoredDataGroup(
            tokens=tokens, masks=masks, scores=[float(j) for j in range(len(tokens))]
        )
        if self.config.own_params:
            group["generation_params"] = {"temperature": 0.25, "top_p": 0.9}
            group["overrides"] = [{"finish_reason": "stop"}] + [{} for _ in tokens[1:]]
        return group, []

    async def evaluate(self, *args: Any, **kwargs: Any) -> None:
        return None


if __name__ == "__main__":
    os.environ.setdefault("WANDB_MODE", "disabled")
    SamplingEnv.cli()
