"""``TextArenaEnv`` against an opponent on another inference server (``opponent: server``).

The policy is the tiny model behind ``atropos-serve-model``; the opponent is a separate
fake inference server process (deterministic answers, request counts at
``/fake/stats``). The games are ones that accept free text, so both seats move many
times whatever the models write (in board games an invalid move ends the game at once).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
from pathlib import Path
from typing import Dict, Iterator

import httpx
import pytest
from pydantic import ValidationError

pytest.importorskip("textarena")

from atroposlib.envs.adapters.textarena import (  # noqa: E402
    OpponentServerError,
    TextArenaEnv,
    TextArenaEnvConfig,
)
from atroposlib.envs.cli import CliError, build_env, parse_cli  # noqa: E402
from atroposlib.envs.health import TooManyFailuresError  # noqa: E402
from atroposlib.testing.launch import fake_server_cmd, serve_model_cmd  # noqa: E402
from atroposlib.testing.ports import free_port  # noqa: E402
from atroposlib.testing.processes import running_process  # noqa: E402
from tests.environments.env_helpers import check_groups, process_argv  # noqa: E402

GAMES = '["SimpleNegotiation-v0","TruthAndDeception-v0"]'


def _fake_server(log: Path, latency_ms: int) -> Iterator[str]:
    port = free_port()
    cmd = fake_server_cmd(port, "--latency-ms", str(latency_ms), "--lean")
    with running_process(cmd, health_url=f"http://127.0.0.1:{port}/health", log_path=log):
        yield f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def opponent_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Root URL of a running fake inference server that answers at once."""
    yield from _fake_server(tmp_path_factory.mktemp("opponent") / "fake.log", 0)


@pytest.fixture(scope="module")
def hanging_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Root URL of a fake inference server that takes ten minutes per answer."""
    yield from _fake_server(tmp_path_factory.mktemp("hanging") / "fake.log", 600_000)


@pytest.fixture(scope="module")
def refusing_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Root URL of a fake inference server that answers every request with 401."""
    for root in _fake_server(tmp_path_factory.mktemp("refusing") / "fake.log", 0):
        httpx.post(f"{root}/fake/config", json={"fail_status": 401}, timeout=10)
        yield root


def _chat_requests(root: str) -> int:
    stats = httpx.get(f"{root}/fake/stats", timeout=10).json()
    return int(stats["requests"].get("/v1/chat/completions", 0))


def _argv(serve: Dict[str, str], out: Path, opponent: str, *extra: str, games: str = GAMES) -> list:
    return process_argv(serve, out, group_size=2, steps=2) + [
        "--env.game_ids",
        games,
        "--env.opponent",
        "server",
        "--env.opponent_server",
        opponent,
        "--env.max_tokens_per_turn",
        "8",
        "--env.max_token_length",
        "8192",
        "--env.max_turns",
        "60",
        *extra,
    ]


# --------------------------------------------------------------------------- config


def test_opponent_server_is_required_for_the_server_opponent():
    with pytest.raises(ValidationError) as err:
        TextArenaEnvConfig(opponent="server")
    assert err.value.errors()[0]["loc"] == ("opponent_server",)
    assert "needs opponent_server" in str(err.value)
    # The other opponents need none.
    assert TextArenaEnvConfig(opponent="scripted").opponent_server is None


@pytest.mark.parametrize(
    "url", ["ftp://127.0.0.1/v1", "127.0.0.1:9002", "http:///v1", "http://h:99999/v1"]
)
def test_a_bad_opponent_url_is_refused_naming_the_field(url):
    argv = ["process", "--env.opponent", "server", "--env.opponent_server"]
    with pytest.raises(CliError, match=r"--env\.opponent_server\.base_url: Value error"):
        parse_cli(TextArenaEnv, argv + [f'{{"base_url": "{url}"}}'])


def test_an_unknown_opponent_field_is_refused_naming_it():
    argv = ["process", "--env.opponent", "server", "--env.opponent_server"]
    with pytest.raises(CliError, match=r"--env\.opponent_server\.temprature: Extra inputs"):
        parse_cli(TextArenaEnv, argv + ['{"base_url": "http://h:1/v1", "temprature": 1}'])


# ------------------------------------------------------------------- real processes


def _record_end_reasons(env: TextArenaEnv) -> list:
    """The end reason of every episode ``env`` plays from now on (in order of ending)."""
    reasons: list = []
    play = env.run_episode

    async def recording(*args, **kwargs):
        episode = await play(*args, **kwargs)
        reasons.append(episode.end_reason)
        return episode

    env.run_episode = recording
    return reasons


def _assert_only_policy_turns_trained(groups, tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    for group in groups:
        for tokens, mask, messages in zip(
            group["tokens"], group["masks"], group["messages"], strict=True
        ):
            replies = [m["content"] for m in messages if m["role"] == "assistant"]
            assert len(replies) >= 2, "the episode should be many moves long"
            spans = [
                [t for t, _ in run]
                for trained, run in itertools.groupby(
                    zip(tokens, mask, strict=True), key=lambda tm: tm[1] != -100
                )
                if trained
            ]
            # Exactly the policy's own replies are trained, one span each, in order;
            # the opponent's moves only show up inside (masked) observations.
            decoded = [tokenizer.decode(s, skip_special_tokens=True).strip() for s in spans]
            assert decoded == [r.strip() for r in replies]


def test_process_mode_plays_the_opponent_on_its_own_server(
    serve_model, opponent_server, tiny_model_dir, tmp_path
):
    before = _chat_requests(opponent_server)
    out = tmp_path / "ta.jsonl"
    opponent = f'{{"base_url": "{opponent_server}/v1", "model_name": "fake", "temperature": 0}}'
    env = build_env(TextArenaEnv, parse_cli(TextArenaEnv, _argv(serve_model, out, opponent)))
    ended = _record_end_reasons(env)
    asyncio.run(env.process_manager())
    assert ended == ["done"] * 4, ended  # full episodes, both games

    # The opponent seat's moves were asked of the opponent server (the policy is elsewhere).
    assert _chat_requests(opponent_server) > before
    assert env.opponent_manager is None, "the opponent's client was closed with the run"
    groups = check_groups(out, 2, 2, -1.0, 1.0)
    _assert_only_policy_turns_trained(groups, tiny_model_dir)


def test_process_mode_against_a_second_serve_model(
    serve_model, tiny_model_dir, tmp_path_factory, tmp_path
):
    port = free_port()
    log = tmp_path_factory.mktemp("opponent_model") / "serve.log"
    cmd = serve_model_cmd(tiny_model_dir, port, "--seed", "1")
    health = f"http://127.0.0.1:{port}/health"
    with running_process(cmd, health_url=health, timeout=180, log_path=log):
        out = tmp_path / "vs_model.jsonl"
        opponent = json.dumps(
            {"base_url": f"http://127.0.0.1:{port}/v1", "model_name": str(tiny_model_dir)}
        )
        argv = _argv(serve_model, out, opponent, games='["SimpleNegotiation-v0"]')
        env = build_env(TextArenaEnv, parse_cli(TextArenaEnv, argv))
        ended = _record_end_reasons(env)
        asyncio.run(env.process_manager())
        assert ended == ["done"] * 4, ended
        # The opponent model generated the other seat's moves.
        assert httpx.get(health, timeout=10).json()["generated_tokens"] > 0
    _assert_only_policy_turns_trained(check_groups(out, 2, 2, -1.0, 1.0), tiny_model_dir)


def test_an_opponent_server_that_is_down_ends_episodes_with_the_reason(
    serve_model, tmp_path, caplog
):
    down = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
    out = tmp_path / "down.jsonl"
    argv = _argv(
        serve_model,
        out,
        f'{{"base_url": "{down}", "timeout": 2}}',
        "--env.max_consecutive_failures",
        "2",
    )
    env = build_env(TextArenaEnv, parse_cli(TextArenaEnv, argv))
    caplog.set_level(logging.WARNING)
    with pytest.raises(TooManyFailuresError) as err:
        asyncio.run(env.process_manager())
    # Each item lost both episodes to the opponent and failed, naming the cause; the run
    # stopped at its own failure limit; none of the policy's moves was written.
    assert "ended by the opponent server (opponent_timeout)" in str(err.value)
    assert err.value.count == 2 and isinstance(err.value.last, OpponentServerError)
    assert env.end_reasons == {"opponent_timeout": 4}
    assert "the opponent server gave no move within 2 s" in caplog.text
    assert "Connect call failed" in caplog.text  # the client logged why
    assert not out.exists() or not out.read_text().strip()


def _one_item(env: TextArenaEnv):
    async def run():
        await env.setup()
        try:
            return await env.collect_trajectories(await env.get_next_item())
        finally:
            await env.close_servers()

    return asyncio.run(run())


def test_a_hanging_opponent_server_ends_the_episode_at_its_time_limit(
    serve_model, hanging_server, tmp_path, caplog
):
    opponent = f'{{"base_url": "{hanging_server}/v1", "timeout": 1}}'
    parsed = parse_cli(TextArenaEnv, _argv(serve_model, tmp_path / "h.jsonl", opponent))
    env = build_env(TextArenaEnv, parsed)
    caplog.set_level(logging.WARNING)
    with pytest.raises(OpponentServerError, match="opponent_timeout"):
        _one_item(env)
    assert env.end_reasons == {"opponent_timeout": 2}
    assert env.opponent_failures == 2
    assert "gave no move within 1 s" in caplog.text
    assert _chat_requests(hanging_server) >= 2


def test_an_opponent_server_refusing_requests_ends_the_episode_at_once(
    serve_model, refusing_server, tmp_path, caplog
):
    # A long limit: a refusal (401, not retried) must end the episode without using it.
    opponent = f'{{"base_url": "{refusing_server}/v1", "timeout": 600}}'
    parsed = parse_cli(TextArenaEnv, _argv(serve_model, tmp_path / "r.jsonl", opponent))
    env = build_env(TextArenaEnv, parsed)
    caplog.set_level(logging.WARNING)
    with pytest.raises(OpponentServerError, match="opponent_error"):
        _one_item(env)
    assert env.end_reasons == {"opponent_error": 2}
    assert "the opponent server failed" in caplog.text and "401" in caplog.text


def test_evaluate_counts_games_lost_to_the_opponent_server_as_failed(
    serve_model, hanging_server, opponent_server, tmp_path
):
    def evaluate(root: str) -> Dict[str, float]:
        opponent = f'{{"base_url": "{root}/v1", "timeout": 1}}'
        # One short game: greedy replies of the tiny model make long episodes.
        argv = _argv(
            serve_model,
            tmp_path / "e.jsonl",
            opponent,
            "--env.eval_episodes",
            "2",
            games='["SimpleNegotiation-v0"]',
        )
        env = build_env(TextArenaEnv, parse_cli(TextArenaEnv, argv))

        async def run():
            await env.setup()
            try:
                return await env.evaluate()
            finally:
                await env.close_servers()

        return asyncio.run(run())

    hung = evaluate(hanging_server)
    assert hung["eval/failed_games"] == 2.0, hung
    answered = evaluate(opponent_server)
    assert answered["eval/failed_games"] == 0.0, answered
    assert "eval/SimpleNegotiation-v0/mean_reward" in answered
