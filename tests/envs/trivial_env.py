"""A trivial environment for tests and the benchmark.

Every group gets a unique id, written as the first token of each of its sequences,
so a test can check that each group the env produced reached the trainer exactly
once. One completion request per group goes to the configured inference server
(``n = group_size``), so inference latency is part of every rollout.

Run as ``python tests/envs/trivial_env.py serve|process|evaluate [flags]``.
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


class ByteTokenizer:
    """Decodes byte-valued ids, like the fake inference server's tokens."""

    def decode(self, ids: List[int], **_: Any) -> str:
        return bytes(i % 256 for i in ids).decode("latin-1")


class TrivialEnvConfig(BaseEnvConfig):
    """Adds the sequence length of the fake rollouts."""

    seq_len: int = Field(16, description="Tokens per fake sequence.")
    max_items: int = Field(-1, description="Stop handing out items after this many (-1 = never).")
    id_offset: int = Field(0, description="First group id minus one (to tell runs apart).")


class TrivialEnv(BaseEnv):
    """Groups of ``group_size`` sequences ``[group_id, j, <completion bytes>...]``."""

    name = "trivial"
    env_config_cls = TrivialEnvConfig

    @classmethod
    def config_init(cls) -> Tuple[TrivialEnvConfig, APIServerConfig]:
        return (
            TrivialEnvConfig(
                group_size=4,
                use_wandb=False,
                wandb_name="trivial",
                tokenizer_name="none",
                total_steps=10,
                steps_per_eval=0,
                max_token_length=512,
            ),
            APIServerConfig(model_name="fake", base_url="http://127.0.0.1:9001/v1", api_key="x"),
        )

    async def setup(self) -> None:
        self.tokenizer = ByteTokenizer()
        self.next_id = self.config.id_offset
        self.eval_calls = 0

    async def get_next_item(self) -> int | None:
        if (
            self.config.max_items >= 0
            and self.next_id - self.config.id_offset >= self.config.max_items
        ):
            return None
        self.next_id += 1
        return self.next_id

    async def collect_trajectories(self, item: int) -> Tuple[ScoredDataGroup | None, List[Any]]:
        n = self.config.group_size
        completion = await self.server.completion(prompt=f"item {item}", n=n, max_tokens=8)
        texts = [c.text for c in completion.choices]
        pad = max(0, self.config.seq_len - 2)
        tokens, masks = [], []
        for j in range(n):
            body = list(texts[j % len(texts)].encode()[:pad]) if texts else []
            body += [32] * (pad - len(body))
            seq = [item, j] + body
            tokens.append(seq)
            masks.append([-100, -100] + body)
        messages = [
            [
                {"role": "user", "content": f"item {item}"},
                {"role": "assistant", "content": texts[j % len(texts)]},
            ]
            for j in range(n)
        ]
        group = ScoredDataGroup(
            tokens=tokens, masks=masks, scores=[float(j) for j in range(n)], messages=messages
        )
        return group, []

    async def evaluate(self, *args: Any, **kwargs: Any) -> None:
        self.eval_calls += 1
        await self.evaluate_log(
            {"eval/score": 0.5, "eval/calls": self.eval_calls},
            samples=[{"question": "q", "answer": "a", "score": 0.5}],
            generation_parameters={"temperature": 0.0},
        )


if __name__ == "__main__":
    os.environ.setdefault("WANDB_MODE", "disabled")
    TrivialEnv.cli()
