"""The text-game loop and ``TextArenaEnv``: TextArena games of many kinds play full
episodes offline, episodes replay from their seed, a hanging step ends the episode
with its reason, and ``process`` mode against the tiny model writes valid groups."""

from __future__ import annotations

import asyncio
import threading
from typing import Dict

import pytest

pytest.importorskip("textarena")

from atroposlib.envs.adapters.text_games import (  # noqa: E402
    StepResult,
    TextGame,
    Turn,
    play_episode,
)
from atroposlib.envs.adapters.textarena import (  # noqa: E402
    TextArenaEnv,
    TextArenaGame,
    scripted_player,
)
from atroposlib.envs.cli import build_env, parse_cli  # noqa: E402
from tests.environments.env_helpers import check_groups, process_argv, unmasked_runs  # noqa: E402

# Board games, card and dice games, bidding, iterated social dilemmas, single-player
# puzzles: games that need no nltk corpora, API key or data file, and parse on 3.11.
GAMES: Dict[str, int] = {
    "TicTacToe-v0": 2,
    "ConnectFour-v0": 2,
    "Nim-v0": 2,
    "Othello-v0": 2,
    "Battleship-v0": 2,
    "KuhnPoker-v0": 2,
    "PigDice-v0": 2,
    "ColonelBlotto-v0": 2,
    "IteratedPrisonersDilemma-v0": 2,
    "IteratedRockPaperScissors-v0": 2,
    "SimpleNegotiation-v0": 2,
    "Crusade-v0": 2,
    "GuessTheNumber-v0": 1,
    "Mastermind-v0": 1,
    "FifteenPuzzle-v0": 1,
    "2048-v0": 1,
}


def _scripted_episode(game_id: str, players: int, seed: int):
    return asyncio.run(
        play_episode(
            TextArenaGame(game_id, players),
            {p: scripted_player(seed * 10 + p) for p in range(players)},
            seed,
            system_prompt="play",
            max_turns=400,
            step_timeout_s=30,
        )
    )


@pytest.mark.parametrize("game_id", sorted(GAMES))
def test_textarena_game_plays_a_full_episode_offline(game_id):
    episode = _scripted_episode(game_id, GAMES[game_id], seed=1)
    assert episode.end_reason == "done", episode.end_reason
    assert episode.turns >= 1
    assert set(episode.rewards) == set(range(GAMES[game_id])), episode.rewards
    for messages in episode.conversations.values():
        assert messages[0]["role"] == "system"
        assert [m["role"] for m in messages[1:]] == ["user", "assistant"] * (len(messages) // 2)


def test_textarena_games_give_mixed_scores():
    rewards = [_scripted_episode(g, n, seed=s).reward(0) for g, n in GAMES.items() for s in (1, 2)]
    assert len(set(rewards)) >= 3, rewards


def test_an_episode_replays_from_its_seed_while_others_run():
    # PigDice rolls the global random on every step: concurrent episodes sharing it
    # would not replay.
    async def both():
        async def one(seed: int):
            return await play_episode(
                TextArenaGame("PigDice-v0", 2),
                {p: scripted_player(p) for p in range(2)},
                seed,
                max_turns=400,
            )

        return await asyncio.gather(one(5), one(6), one(5))

    a, _, b = asyncio.run(both())
    assert a.conversations == b.conversations and a.rewards == b.rewards


class _HangingGame(TextGame):
    """Loops forever on its second step, as some games do once every player is out."""

    num_players = 1

    def reset(self, seed: int) -> Turn:
        self.steps = 0
        return Turn(0, "go")

    def step(self, text: str) -> StepResult:
        self.steps += 1
        while self.steps > 1:
            pass
        return StepResult(Turn(0, "again"), False)


def test_a_hanging_step_ends_the_episode_with_a_logged_reason(caplog):
    episode = asyncio.run(
        play_episode(_HangingGame(), {0: scripted_player(0)}, 0, step_timeout_s=0.5)
    )
    assert episode.end_reason == "step_timeout"
    assert episode.turns == 2
    assert "ran past 0.5 s" in caplog.text
    # The loop was interrupted, not left spinning in the background.
    assert not [t for t in threading.enumerate() if t.name == "text-game-step"]


def test_max_turns_ends_the_episode():
    episode = asyncio.run(
        play_episode(
            TextArenaGame("IteratedPrisonersDilemma-v0", 2),
            {p: scripted_player(p) for p in range(2)},
            0,
            max_turns=3,
        )
    )
    assert episode.end_reason == "max_turns" and episode.turns == 3 and episode.rewards == {}
    # The unanswered observation is not part of the trajectory.
    assert all(m[-1]["role"] == "assistant" for m in episode.conversations.values())


def test_textarena_process_writes_groups_of_the_trained_seat(serve_model, tmp_path):
    out = tmp_path / "ta.jsonl"
    argv = process_argv(serve_model, out, group_size=2, steps=2)
    argv += [
        "--env.game_ids",
        '["TicTacToe-v0","Nim-v0"]',
        "--env.opponent",
        "scripted",
        "--env.max_tokens_per_turn",
        "8",
        "--env.max_token_length",
        "4096",
    ]
    env = build_env(TextArenaEnv, parse_cli(TextArenaEnv, argv))
    asyncio.run(env.process_manager())
    groups = check_groups(out, 2, 2, -1.0, 1.0)
    for group in groups:
        for messages, mask in zip(group["messages"], group["masks"], strict=True):
            assert messages[0]["role"] == "system" and messages[-1]["role"] == "assistant"
            # One sequence per episode: each of the seat's moves is one trained span.
            assert unmasked_runs(mask) == sum(m["role"] == "assistant" for m in messages)
