"""blackjack: action parsing and the game loop, driven by a scripted player."""

from __future__ import annotations

import gymnasium as gym
import pytest

from environments.blackjack_server import HIT, STICK, describe, parse_action, play_blackjack


@pytest.mark.parametrize(
    "text, action",
    [
        ("hit", HIT),
        ("<think>I could stick</think> Hit me.", HIT),
        ("I'll STAND", STICK),
        ("stick", STICK),
        ("hit or stick?", None),
        ("hitting", None),
        ("", None),
        ("<think>hit</think>", None),
    ],
)
def test_parse_action(text, action):
    assert parse_action(text) == action


def _scripted(replies):
    seen = []

    async def chat(messages, max_tokens):
        seen.append([dict(m) for m in messages])
        return replies[min(len(seen) - 1, len(replies) - 1)]

    return chat, seen


def _expected_reward(seed, actions):
    game = gym.make("Blackjack-v1")
    game.reset(seed=seed)
    reward = 0.0
    for action in actions:
        _, reward, terminated, truncated, _ = game.step(action)
        if terminated or truncated:
            break
    return float(reward)


async def test_sticking_at_once_scores_the_game_outcome():
    chat, seen = _scripted(["stick"])
    game = await play_blackjack(
        chat, seed=3, max_turns=5, max_tokens_per_turn=8, invalid_action_reward=-1.0
    )
    assert game["reward"] == _expected_reward(3, [STICK])
    assert game["turns"] == 1 and [m["role"] for m in game["messages"]] == [
        "system",
        "user",
        "assistant",
    ]


async def test_observations_are_fed_back_between_turns():
    chat, seen = _scripted(["hit", "hit", "hit", "hit", "stick"])
    game = await play_blackjack(
        chat, seed=11, max_turns=5, max_tokens_per_turn=8, invalid_action_reward=-1.0
    )
    roles = [m["role"] for m in game["messages"]]
    assert roles[:2] == ["system", "user"] and roles[-1] == "assistant"
    assert all(
        a != b for a, b in zip(roles[2:], roles[3:], strict=False)
    )  # user/assistant alternate
    assert len(seen) == game["turns"]
    assert seen[-1] == game["messages"][:-1]  # each prompt is the whole history so far
    assert -1.0 <= game["reward"] <= 1.0


async def test_unreadable_action_ends_the_game_or_falls_back():
    chat, _ = _scripted(["no idea"])
    ended = await play_blackjack(
        chat, seed=1, max_turns=5, max_tokens_per_turn=8, invalid_action_reward=-1.0
    )
    assert (ended["reward"], ended["outcome"], ended["turns"]) == (-1.0, "invalid_action", 1)
    stuck = await play_blackjack(
        chat,
        seed=1,
        max_turns=5,
        max_tokens_per_turn=8,
        invalid_action_reward=-1.0,
        on_invalid_action="stick",
    )
    assert stuck["reward"] == _expected_reward(1, [STICK]) and stuck["invalid_actions"] == 1


async def test_token_budget_makes_the_player_stand_without_dangling_observation():
    chat, seen = _scripted(["hit"])
    budget = iter([100, 100, 0, 0, 0])
    game = await play_blackjack(
        chat,
        seed=5,
        max_turns=5,
        max_tokens_per_turn=8,
        invalid_action_reward=-1.0,
        budget_left=lambda: next(budget),
    )
    assert game["messages"][-1]["role"] == "assistant"
    assert game["turns"] <= 2


def test_describe_mentions_hand_dealer_and_ace():
    text = describe((15, 10, 1))
    assert "15" in text and "10" in text and "ace" in text
