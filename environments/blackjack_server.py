"""Blackjack (gymnasium ``Blackjack-v1``): a multi-turn game with the reward at the end.

Each turn the model sees its hand and the dealer's card and answers ``hit`` or
``stick``; the game's outcome is the score (+1 win, 0 draw, -1 loss). An answer that
names no action (or both) ends the game with ``invalid_action_reward`` — or, with
``on_invalid_action`` set to ``hit``/``stick``, plays that action and goes on (useful
to warm up a model that cannot follow the format yet). All rollouts
of a group play the same deal (same seed), so their scores are comparable.

Every trajectory runs inside its own ``ManagedServer`` context: each new turn's prompt
extends the previous sequence, so a whole game is **one** token sequence whose mask
trains only the model's own turns (observations are masked), with its logprobs.

Run::

    python environments/blackjack_server.py process --env.total_steps 4 \\
        --openai.server_type vllm --openai.base_url http://localhost:9001/v1
"""

from __future__ import annotations

import asyncio
import logging
import re
from typing import Any, Awaitable, Callable, Dict, List, Literal, Tuple

import gymnasium as gym
from pydantic import Field

from atroposlib.envs.base import BaseEnv, BaseEnvConfig, ScoredDataGroup
from atroposlib.envs.eval_helpers import drain_metrics, run_eval_set
from atroposlib.envs.server_handling.server_baseline import APIServerConfig
from atroposlib.type_definitions import Item

logger = logging.getLogger(__name__)

HIT, STICK = 1, 0
SYSTEM_PROMPT = (
    "You are playing Blackjack against the dealer. Get as close to 21 as you can without going over. "
    "Each turn you see your hand; you may think inside <think> </think> tags, then reply with exactly "
    "one action: hit (take a card) or stick (stop and let the dealer play)."
)
_ACTION = re.compile(r"\b(hit|stick|stand)\b", re.IGNORECASE)


class BlackjackConfig(BaseEnvConfig):
    """Blackjack settings on top of :class:`BaseEnvConfig`."""

    max_turns: int = Field(5, ge=1, description="Turns before the player is made to stick.")
    max_tokens_per_turn: int = Field(256, ge=1, description="Generation budget of one turn.")
    invalid_action_reward: float = Field(
        -1.0, description="Score of a game ended by an unreadable action."
    )
    on_invalid_action: Literal["end", "hit", "stick"] = Field(
        "end",
        description="What an unreadable action does: end the game, or play hit/stick and go on.",
    )
    seed: int = Field(0, description="First deal's seed; item i plays seed + i.")
    eval_episodes: int = Field(32, ge=0, description="Games played by evaluate().")
    eval_seed: int = Field(1_000_000, description="First seed of the evaluation games.")
    eval_temperature: float = Field(0.0, description="Sampling temperature of evaluation games.")


def describe(observation: Tuple[int, int, int]) -> str:
    """The observation as text for the model."""
    player, dealer, usable_ace = observation
    ace = " (you hold an ace counted as 11)" if usable_ace else ""
    return f"Your hand totals {player}{ace}. The dealer shows {dealer}. Do you hit or stick?"


def parse_action(text: str) -> int | None:
    """``HIT``/``STICK`` from the reply after ``</think>``; None when absent or ambiguous."""
    words = {w.lower() for w in _ACTION.findall(text.split("</think>")[-1])}
    actions = {HIT if w == "hit" else STICK for w in words}
    return actions.pop() if len(actions) == 1 else None


ChatFn = Callable[[List[Dict[str, str]], int], Awaitable[str]]


async def play_blackjack(
    chat: ChatFn,
    seed: int,
    max_turns: int,
    max_tokens_per_turn: int,
    invalid_action_reward: float,
    budget_left: Callable[[], int] | None = None,
    on_invalid_action: str = "end",
) -> Dict[str, Any]:
    """Play one game; ``chat(messages, max_tokens)`` returns the model's reply.

    ``budget_left()`` (tokens still available in the sequence) makes the player stick
    before the sequence would overflow. Returns ``{"reward", "outcome", "messages",
    "turns", "invalid_actions"}``.
    """
    invalid = 0
    game = gym.make("Blackjack-v1")
    try:
        observation, _ = game.reset(seed=seed)
        messages = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": describe(observation)},
        ]
        for turn in range(1, max_turns + 1):
            if budget_left is not None and budget_left() < max_tokens_per_turn:
                break
            reply = await chat(messages, max_tokens_per_turn)
            messages.append({"role": "assistant", "content": reply})
            action = parse_action(reply)
            if action is None:
                invalid += 1
                if on_invalid_action == "end":
                    return {
                        "reward": invalid_action_reward,
                        "outcome": "invalid_action",
                        "messages": messages,
                        "turns": turn,
                        "invalid_actions": invalid,
                    }
                action = HIT if on_invalid_action == "hit" else STICK
            observation, reward, terminated, truncated, _ = game.step(action)
            if terminated or truncated:
                return {
                    "reward": float(reward),
                    "outcome": _outcome(reward),
                    "messages": messages,
                    "turns": turn,
                    "invalid_actions": invalid,
                }
            messages.append({"role": "user", "content": describe(observation)})
        _, reward, _, _, _ = game.step(STICK)  # out of turns or tokens: the player stands
        if messages[-1]["role"] == "user":
            messages.pop()  # the unanswered observation is not part of the trajectory
        return {
            "reward": float(reward),
            "outcome": _outcome(reward),
            "messages": messages,
            "turns": sum(1 for m in messages if m["role"] == "assistant"),
            "invalid_actions": invalid,
        }
    finally:
        game.close()


def _outcome(reward: float) -> str:
    return "win" if reward > 0 else "loss" if reward < 0 else "draw"


class BlackjackEnv(BaseEnv):
    """Multi-turn Blackjack with one aligned token sequence per game."""

    name = "blackjack"
    env_config_cls = BlackjackConfig

    def __init__(
        self,
        config: BlackjackConfig,
        server_configs: Any,
        slurm: bool = False,
        testing: bool = False,
    ):
        super().__init__(config, server_configs, slurm, testing)
        self.config: BlackjackConfig = config
        self.iter = 0
        self.outcomes: List[str] = []
        self.eval_metrics: Dict[str, float] = {}

    @classmethod
    def config_init(cls) -> Tuple[BlackjackConfig, APIServerConfig]:
        model = "NousResearch/DeepHermes-3-Llama-3-3B-Preview"
        return (
            BlackjackConfig(
                tokenizer_name=model,
                group_size=8,
                batch_size=16,
                max_token_length=4096,
                steps_per_eval=100,
                total_steps=1000,
                wandb_name="blackjack",
            ),
            APIServerConfig(model_name=model, base_url="http://localhost:9001/v1", api_key="x"),
        )

    async def setup(self) -> None:
        self.iter = 0

    def save_checkpoint(self, step: int, data: Dict[str, Any] | None = None) -> None:
        super().save_checkpoint(step, {"iter": self.iter} if data is None else data)

    async def get_next_item(self) -> Item:
        seed = self.config.seed + self.iter
        self.iter += 1
        return {"seed": seed}

    async def play_tracked(self, seed: int) -> Dict[str, Any] | None:
        """One game through ManagedServer; adds the game's single token sequence."""
        cfg = self.config
        async with self.server.managed_server(tokenizer=self.tokenizer) as managed:

            def longest() -> Any:
                nodes = managed.get_state()["nodes"]
                return max(nodes, key=lambda n: len(n.tokens)) if nodes else None

            def budget_left() -> int:
                node = longest()
                return cfg.max_token_length - (len(node.tokens) if node is not None else 0)

            async def chat(messages: List[Dict[str, str]], max_tokens: int) -> str:
                out = await managed.chat_completion(
                    messages=messages, n=1, max_tokens=max_tokens, temperature=1.0
                )
                return out.choices[0].message.content or ""

            game = await play_blackjack(
                chat,
                seed,
                cfg.max_turns,
                cfg.max_tokens_per_turn,
                cfg.invalid_action_reward,
                budget_left,
                cfg.on_invalid_action,
            )
            nodes = managed.get_state()["nodes"]
        if not nodes:
            return None
        if len(nodes) > 1:
            logger.warning(
                "blackjack: a game produced %d sequences; keeping the longest", len(nodes)
            )
        node = max(nodes, key=lambda n: len(n.tokens))
        game.update(
            tokens=list(node.tokens), masks=list(node.masked_tokens), logprobs=list(node.logprobs)
        )
        return game

    async def collect_trajectories(self, item: Item) -> Tuple[ScoredDataGroup | None, List[Item]]:
        games = await asyncio.gather(
            *(self.play_tracked(item["seed"]) for _ in range(self.config.group_size))
        )
        group = ScoredDataGroup(tokens=[], masks=[], scores=[], inference_logprobs=[], messages=[])
        for game in games:
            if game is None:
                continue
            self.outcomes.append(game["outcome"])
            group["tokens"].append(game["tokens"])
            group["masks"].append(game["masks"])
            group["inference_logprobs"].append(game["logprobs"])
            group["messages"].append(game["messages"])
            group["scores"].append(game["reward"])
        if not group["tokens"] or (
            self.config.ensure_scores_are_not_same and len(set(group["scores"])) == 1
        ):
            return None, []
        return group, []

    async def evaluate(self, *args: Any, **kwargs: Any) -> None:
        cfg = self.config

        async def chat(messages: List[Dict[str, str]], max_tokens: int) -> str:
            out = await self.server.chat_completion(
                messages=messages,
                n=1,
                max_tokens=max_tokens,
                temperature=cfg.eval_temperature,
                split="eval",
            )
            return out.choices[0].message.content or ""

        async def one(seed: int) -> Dict[str, Any]:
            game = await play_blackjack(
                chat,
                seed,
                cfg.max_turns,
                cfg.max_tokens_per_turn,
                cfg.invalid_action_reward,
                on_invalid_action=cfg.on_invalid_action,
            )
            return {
                "messages": game["messages"],
                "score": game["reward"],
                "outcome": game["outcome"],
            }

        def outcome_rates(games: List[Dict[str, Any]]) -> Dict[str, float]:
            n = max(1, len(games))
            return {
                "eval/win_rate": sum(g["outcome"] == "win" for g in games) / n,
                "eval/invalid_action_rate": sum(g["outcome"] == "invalid_action" for g in games)
                / n,
            }

        self.eval_metrics = await run_eval_set(
            self,
            range(cfg.eval_seed, cfg.eval_seed + cfg.eval_episodes),
            one,
            metric="eval/mean_reward",
            value="score",
            failed_metric="eval/failed_games",
            extra_metrics=outcome_rates,
            generation_parameters={
                "temperature": cfg.eval_temperature,
                "max_tokens": cfg.max_tokens_per_turn,
            },
        )

    async def wandb_log(self, wandb_metrics: Dict[str, Any] | None = None) -> None:
        metrics = drain_metrics(wandb_metrics, self.eval_metrics)
        if self.outcomes:
            for outcome in ("win", "draw", "loss", "invalid_action"):
                metrics[f"train/{outcome}_rate"] = self.outcomes.count(outcome) / len(self.outcomes)
        self.outcomes = []
        await super().wandb_log(metrics)


if __name__ == "__main__":
    BlackjackEnv.cli()
