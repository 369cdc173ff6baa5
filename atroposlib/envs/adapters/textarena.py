"""``TextArenaEnv``: TextArena's games (``pip install 'atroposlib[textarena]'``) as an environment.

One item is one game id and seed; a group is ``group_size`` episodes of that game from
that seed, so GRPO compares like with like. The trained player (``trained_player``)
is the policy through ``ManagedServer``: its turns extend one token sequence whose mask
trains only its own replies. The other players are the same policy, untracked
(``opponent: self_play``), a scripted player that picks one of the bracketed moves
the observation offers (``opponent: scripted``), or another OpenAI-compatible
inference server (``opponent: server`` with ``opponent_server``: its URL, model, key,
sampling and time limit), asked through a ``ServerManager`` of its own with each of its
seats' observations as chat messages. Opponent moves are never tracked, so never
trained. The trained player's final reward is the score.

An opponent move has a time limit (``opponent_server.timeout``, by default
``step_timeout_s``, like a game step). Within it the client retries a server it cannot
reach (one that is restarting gets its chance); past it the episode ends
(``end_reason: opponent_timeout``: the server is down or hangs; the client logs each
failed attempt's cause). An answer the client does not retry (say 401 for a bad key,
404 for a wrong model) ends it at once (``opponent_error``, the answer logged). Such
an episode is not trained on (its reward says nothing about the policy) and is counted
(``train/opponent_failures``); when it cost a group every episode, the item fails like
any other failed item (counted; ``max_consecutive_failures`` applies); in ``evaluate``
it counts in ``eval/failed_games``.

Each game runs in a worker process of its own (:mod:`.game_worker`; finished workers are
reused), so a game that hangs in C (a sleep, a regex that backtracks holding the GIL)
never stalls the event loop or the other episodes: a step past ``step_timeout_s`` kills
its worker and ends the episode (``end_reason: step_timeout``). An episode replays from
its seed (each game keeps its own ``random`` state, :mod:`.textarena_game`). Each episode
running at once holds a worker (about 45 MB of its own with TextArena loaded; a new one
starts in about a second of CPU), kept for later episodes until the environment closes. A game an
environment file registers with TextArena is sent to the workers with its registration
(which must name an importable entry point).
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import re
from collections import Counter
from typing import Any, Callable, Dict, List, Literal, Tuple
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from atroposlib.envs.adapters._defaults import adapter_config_init
from atroposlib.envs.adapters.game_worker import GameWorkerPool, ProcessGame
from atroposlib.envs.adapters.text_games import (
    Episode,
    EpisodeEnded,
    Messages,
    Player,
    TextGame,
    play_episode,
)
from atroposlib.envs.adapters.textarena_game import TextArenaGame, textarena_factory
from atroposlib.envs.base import BaseEnv, BaseEnvConfig, ScoredDataGroup
from atroposlib.envs.eval_helpers import drain_metrics, means_by, run_eval_set
from atroposlib.envs.server_handling.server_baseline import APIServerConfig
from atroposlib.envs.server_handling.server_manager import ServerManager
from atroposlib.utils.aio import within

logger = logging.getLogger(__name__)

__all__ = [
    "OPPONENT_FAILURES",
    "OpponentServerConfig",
    "OpponentServerError",
    "TextArenaEnv",
    "TextArenaEnvConfig",
    "TextArenaGame",
    "scripted_player",
    "server_player",
]

SYSTEM_PROMPT = (
    "You are playing a game. Each turn you see the game's messages. Reply with your move "
    "in the exact format the game asks for (moves are usually written in square brackets)."
)
_OPTION = re.compile(r"\[[^\[\]\n]{1,20}\]")

OPPONENT_FAILURES = ("opponent_error", "opponent_timeout")
"""End reasons of episodes whose opponent server failed (not trained on)."""


def scripted_player(seed: int) -> Player:
    """A player that answers with a random ``[move]`` offered in the latest observation
    (``[0]`` when none is), reproducibly from ``seed``."""
    rng = random.Random(seed)

    async def play(messages: Messages, max_tokens: int) -> str:
        options = _OPTION.findall(messages[-1]["content"][-3000:])
        return rng.choice(options) if options else "[0]"

    return play


class OpponentServerError(RuntimeError):
    """Every episode of a group lost its opponent server (the item fails and is counted)."""


class OpponentServerConfig(BaseModel):
    """The OpenAI-compatible inference server that plays the other seats (``opponent: server``)."""

    model_config = ConfigDict(extra="forbid")

    base_url: str = Field(
        ..., description="Base URL of the opponent's server, e.g. http://127.0.0.1:9002/v1."
    )
    model_name: str = Field("default", description="Model name sent with every request.")
    api_key: str = Field(
        "", description="API key sent to the server (empty: $OPENAI_API_KEY, else none)."
    )
    temperature: float = Field(0.7, ge=0, description="Sampling temperature of its moves.")
    top_p: float | None = Field(None, gt=0, le=1, description="Nucleus sampling (None: unset).")
    max_tokens: int | None = Field(
        None, ge=1, description="Generation budget per move (None: env.max_tokens_per_turn)."
    )
    timeout: float | None = Field(
        None,
        gt=0,
        description="Seconds one of its moves may take, retries included "
        "(None: env.step_timeout_s); past it the episode ends (opponent_timeout).",
    )

    @field_validator("base_url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        parts = urlsplit(value.strip())
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("expected an http(s) URL with a host, e.g. http://127.0.0.1:9002/v1")
        try:
            parts.port  # noqa: B018 - raises on a port that is not a number in range
        except ValueError as err:
            raise ValueError(f"bad port: {err}") from err
        return value.strip().rstrip("/")

    def api_server_config(self, timeout: float) -> APIServerConfig:
        """The client config for a ``ServerManager`` of this server (``timeout``: the
        seconds one move may take)."""
        return APIServerConfig(
            base_url=self.base_url,
            model_name=self.model_name,
            api_key=self.api_key,
            server_type="openai",
            # Past the move's limit, so that the limit (opponent_timeout) is what ends a
            # move whose server never answers, not the client's own deadline.
            timeout=math.ceil(timeout) + 1,
            # One server, nothing to route around: no background probes; the move's limit
            # bounds the client's retries of an unreachable server.
            health_check=False,
        )


def server_player(
    manager: Any,
    *,
    temperature: float,
    timeout: float,
    max_tokens: int | None = None,
    top_p: float | None = None,
    split: str = "train",
) -> Player:
    """A player whose moves come from ``manager.chat_completion`` (an opponent server).

    A move that raises or takes longer than ``timeout`` seconds raises
    :class:`EpisodeEnded` (``opponent_error`` / ``opponent_timeout``), ending the episode.
    """

    async def play(messages: Messages, max_tokens_turn: int) -> str:
        sampling: Dict[str, Any] = {"temperature": temperature}
        if top_p is not None:
            sampling["top_p"] = top_p
        request = manager.chat_completion(
            messages=messages,
            n=1,
            max_tokens=max_tokens or max_tokens_turn,
            split=split,
            **sampling,
        )
        try:
            out = await within(request, timeout)
        except asyncio.TimeoutError as err:
            raise EpisodeEnded(
                "opponent_timeout",
                f"the opponent server gave no move within {timeout:g} s (down or hanging)",
            ) from err
        except Exception as err:  # any failure of the opponent ends this episode only
            raise EpisodeEnded(
                "opponent_error", f"the opponent server failed: {type(err).__name__}: {err}"
            ) from err
        return out.choices[0].message.content or ""

    return play


class TextArenaEnvConfig(BaseEnvConfig):
    """``BaseEnvConfig`` plus the TextArena knobs."""

    game_ids: List[str] = Field(
        default=["TicTacToe-v0"], description="TextArena game ids; item i plays game i mod n."
    )
    num_players: int = Field(default=2, ge=1, description="Players per game.")
    opponent: Literal["self_play", "scripted", "server"] = Field(
        default="self_play",
        description="Who plays the other seats: the same policy (untracked), a scripted "
        "player choosing among the bracketed moves offered, or opponent_server.",
    )
    opponent_server: OpponentServerConfig | None = Field(
        default=None,
        validate_default=True,
        description="The inference server of the other seats when opponent is 'server' "
        """(JSON on the command line: '{"base_url": "http://127.0.0.1:9002/v1", ...}').""",
    )
    trained_player: int = Field(default=0, ge=0, description="The seat whose reward trains.")
    max_turns: int = Field(default=30, ge=1, description="Moves (all players) before a draw.")
    max_tokens_per_turn: int = Field(default=128, ge=1, description="Generation budget per move.")
    step_timeout_s: float = Field(
        default=10.0, gt=0, description="Longest one game step may take before the episode ends."
    )
    system_prompt: str = Field(default=SYSTEM_PROMPT, description="System prompt of every seat.")
    seed: int = Field(default=0, description="Seed of item 0; item i uses seed + i.")
    temperature: float = Field(default=1.0, ge=0, description="Sampling temperature of moves.")
    eval_episodes: int = Field(default=8, ge=0, description="Episodes per game id in evaluate.")
    eval_seed: int = Field(default=1_000_000, description="First seed of evaluation episodes.")
    eval_temperature: float = Field(default=0.0, ge=0, description="Temperature of evaluation.")

    @field_validator("opponent_server")
    @classmethod
    def _server_when_needed(
        cls, value: OpponentServerConfig | None, info: ValidationInfo
    ) -> OpponentServerConfig | None:
        if info.data.get("opponent") == "server" and value is None:
            raise ValueError(
                "opponent 'server' needs opponent_server with at least base_url, e.g. "
                '{"base_url": "http://127.0.0.1:9002/v1", "model_name": "..."}'
            )
        return value


class TextArenaEnv(BaseEnv):
    """Multi-turn TextArena games; one token sequence per episode for the trained seat."""

    name = "textarena"
    env_config_cls = TextArenaEnvConfig

    def __init__(
        self,
        config: TextArenaEnvConfig,
        server_configs: Any,
        slurm: bool = False,
        testing: bool = False,
    ):
        super().__init__(config, server_configs, slurm, testing)
        self.config: TextArenaEnvConfig = config
        self.iter = 0
        self.end_reasons: Counter = Counter()
        self.rewards: List[float] = []
        self.eval_metrics: Dict[str, float] = {}
        self.opponent_failures = 0
        self.opponent_manager: ServerManager | None = None
        self._game_workers: GameWorkerPool | None = None

    @classmethod
    def config_init(cls) -> Tuple[TextArenaEnvConfig, List[APIServerConfig]]:
        return adapter_config_init(TextArenaEnvConfig, "textarena", max_token_length=4096)

    async def setup(self) -> None:
        import textarena  # noqa: F401 - fail at setup, with the extra's name, when missing

        if self.config.trained_player >= self.config.num_players:
            raise ValueError("env.trained_player must be below env.num_players")
        self.iter = 0
        opponent = self.config.opponent_server
        if self.config.opponent == "server" and opponent is not None:
            if self.opponent_manager is not None:
                await self.opponent_manager.close()
            self.opponent_manager = ServerManager(
                [opponent.api_server_config(self.opponent_timeout())]
            )

    def opponent_timeout(self) -> float:
        """Seconds one opponent-server move may take."""
        server = self.config.opponent_server
        if server is not None and server.timeout is not None:
            return server.timeout
        return self.config.step_timeout_s

    async def close_servers(self) -> None:
        """Close the opponent server's client with the policy's servers, and stop the game
        workers."""
        await self.close_game_workers()
        if self.opponent_manager is not None:
            manager, self.opponent_manager = self.opponent_manager, None
            try:
                await manager.close()
            except (RuntimeError, OSError) as err:
                logger.warning("closing the opponent server client failed: %s", err)
        await super().close_servers()

    def save_checkpoint(self, step: int, data: Dict[str, Any] | None = None) -> None:
        super().save_checkpoint(step, {"iter": self.iter} if data is None else data)

    async def get_next_item(self) -> Dict[str, Any]:
        i = self.iter
        self.iter += 1
        ids = self.config.game_ids
        return {"game_id": ids[i % len(ids)], "seed": self.config.seed + i}

    def opponents(self, seed: int, policy: Player, split: str = "train") -> Dict[int, Player]:
        """The other seats' players for an episode from ``seed``."""
        cfg = self.config
        seats = [p for p in range(cfg.num_players) if p != cfg.trained_player]
        if cfg.opponent == "self_play":
            return {p: policy for p in seats}
        if cfg.opponent == "scripted":
            return {p: scripted_player(seed * 131 + p) for p in seats}
        server = cfg.opponent_server
        if self.opponent_manager is None or server is None:
            raise RuntimeError("opponent 'server': call setup() first")
        player = server_player(
            self.opponent_manager,
            temperature=server.temperature,
            top_p=server.top_p,
            max_tokens=server.max_tokens,
            timeout=self.opponent_timeout(),
            split=split,
        )
        return {p: player for p in seats}

    def untracked_policy(self, temperature: float, split: str = "train") -> Player:
        """The policy answering without token tracking (self-play seats, evaluation)."""

        async def play(messages: Messages, max_tokens: int) -> str:
            out = await self.server.chat_completion(
                messages=messages, n=1, max_tokens=max_tokens, temperature=temperature, split=split
            )
            return out.choices[0].message.content or ""

        return play

    async def play_tracked(self, item: Dict[str, Any]) -> Dict[str, Any]:
        """One episode with the trained seat through ManagedServer: ``{"episode"}``, plus
        ``tokens``, ``masks`` and ``logprobs`` when it is trainable (the trained seat moved
        and the opponent did not fail)."""
        cfg = self.config
        async with self.server.managed_server(tokenizer=self.tokenizer) as managed:

            def budget_left(player: int) -> int:
                if player != cfg.trained_player:
                    return cfg.max_token_length
                nodes = managed.get_state()["nodes"]
                used = max((len(n.tokens) for n in nodes), default=0)
                return cfg.max_token_length - used

            async def policy(messages: Messages, max_tokens: int) -> str:
                out = await managed.chat_completion(
                    messages=messages, n=1, max_tokens=max_tokens, temperature=cfg.temperature
                )
                return out.choices[0].message.content or ""

            players = self.opponents(item["seed"], self.untracked_policy(cfg.temperature))
            players[cfg.trained_player] = policy
            episode = await self.run_episode(item, players, budget_left)
            nodes = managed.get_state()["nodes"]
        self.end_reasons[episode.end_reason] += 1
        if episode.end_reason in OPPONENT_FAILURES:
            self.opponent_failures += 1
            return {"episode": episode}
        if not nodes:
            return {"episode": episode}  # the trained seat never moved
        if len(nodes) > 1:
            logger.warning(
                "textarena: an episode made %d sequences; keeping the longest", len(nodes)
            )
        node = max(nodes, key=lambda n: len(n.tokens))
        return {
            "episode": episode,
            "tokens": list(node.tokens),
            "masks": list(node.masked_tokens),
            "logprobs": list(node.logprobs),
        }

    async def run_episode(
        self,
        item: Dict[str, Any],
        players: Dict[int, Player],
        budget_left: Callable[[int], int] | None = None,
    ) -> Episode:
        """One episode of ``item``'s game and seed under this env's limits."""
        cfg = self.config
        game = ProcessGame(self.game_workers(), self.game_factory(item), cfg.num_players)
        await game.start()
        return await play_episode(
            game,
            players,
            item["seed"],
            system_prompt=cfg.system_prompt,
            max_turns=cfg.max_turns,
            max_tokens_per_turn=cfg.max_tokens_per_turn,
            step_timeout_s=cfg.step_timeout_s,
            budget_left=budget_left,
        )

    def game_factory(self, item: Dict[str, Any]) -> Callable[[], TextGame]:
        """What builds ``item``'s game in its worker process: a picklable callable
        returning a :class:`TextGame` (by default ``item["game_id"]``'s TextArena game)."""
        return textarena_factory(item["game_id"], self.config.num_players)

    def game_workers(self) -> GameWorkerPool:
        """The worker processes of this event loop's games (a pool left by an earlier
        event loop is killed)."""
        loop = asyncio.get_running_loop()
        if self._game_workers is not None and self._game_workers.loop is not loop:
            self._game_workers.abandon()
            self._game_workers = None
        if self._game_workers is None:
            self._game_workers = GameWorkerPool()
        return self._game_workers

    async def close_game_workers(self) -> None:
        """Stop and reap every game worker process."""
        pool, self._game_workers = self._game_workers, None
        if pool is None:
            return
        if pool.loop is asyncio.get_running_loop():
            await pool.close()
        else:
            pool.abandon()

    async def collect_trajectories(
        self, item: Dict[str, Any]
    ) -> Tuple[ScoredDataGroup | None, List[Any]]:
        played = await asyncio.gather(
            *(self.play_tracked(item) for _ in range(self.config.group_size))
        )
        group = ScoredDataGroup(tokens=[], masks=[], scores=[], inference_logprobs=[], messages=[])
        lost = [
            r["episode"].end_reason for r in played if r["episode"].end_reason in OPPONENT_FAILURES
        ]
        for run in played:
            if "tokens" not in run:
                continue
            episode: Episode = run["episode"]
            reward = episode.reward(self.config.trained_player)
            self.rewards.append(reward)
            group["tokens"].append(run["tokens"])
            group["masks"].append(run["masks"])
            group["inference_logprobs"].append(run["logprobs"])
            group["messages"].append(episode.conversations.get(self.config.trained_player, []))
            group["scores"].append(reward)
        if not group["tokens"]:
            if lost:
                raise OpponentServerError(
                    f"{item['game_id']} seed {item['seed']}: {len(lost)} of {len(played)} "
                    f"episodes ended by the opponent server ({', '.join(sorted(set(lost)))})"
                )
            return None, []
        return group, []

    async def evaluate(self, *args: Any, **kwargs: Any) -> Dict[str, float]:
        cfg = self.config
        policy = self.untracked_policy(cfg.eval_temperature, split="eval")
        items = [
            {"game_id": g, "seed": cfg.eval_seed + i}
            for g in cfg.game_ids
            for i in range(cfg.eval_episodes)
        ]

        async def one(item: Dict[str, Any]) -> Dict[str, Any]:
            players = self.opponents(item["seed"], policy, split="eval")
            players[cfg.trained_player] = policy
            episode = await self.run_episode(item, players)
            if episode.end_reason in OPPONENT_FAILURES:
                self.opponent_failures += 1
                raise OpponentServerError(
                    f"{item['game_id']} seed {item['seed']}: ended by the opponent server "
                    f"({episode.end_reason})"
                )
            reward = episode.reward(cfg.trained_player)
            return {
                "messages": episode.conversations.get(cfg.trained_player, []),
                "game_id": item["game_id"],
                "score": reward,
                "win": reward > 0,
                "end_reason": episode.end_reason,
            }

        def per_game(samples: List[Dict[str, Any]]) -> Dict[str, float]:
            fields = {"mean_reward": "score", "win_rate": "win"}
            return means_by(samples, "game_id", fields, order=cfg.game_ids)

        self.eval_metrics = await run_eval_set(
            self,
            items,
            one,
            metric="eval/mean_reward",
            value="score",
            failed_metric="eval/failed_games",
            extra_metrics=per_game,
            task_name="textarena_eval",
            generation_parameters={
                "temperature": cfg.eval_temperature,
                "max_tokens": cfg.max_tokens_per_turn,
            },
        )
        return dict(self.eval_metrics)

    async def wandb_log(self, wandb_metrics: Dict[str, Any] | None = None) -> None:
        metrics = drain_metrics(
            wandb_metrics, self.eval_metrics, train={"train/mean_reward": self.rewards}
        )
        total = sum(self.end_reasons.values())
        for reason, count in self.end_reasons.items():
            metrics[f"train/end_{reason}_rate"] = count / total
        self.end_reasons.clear()
        if self.config.opponent == "server":
            metrics["train/opponent_failures"] = float(self.opponent_failures)
            self.opponent_failures = 0
        await super().wandb_log(metrics)
