"""Count the TextArena game families (``-v0`` ids) that play to the end offline.

Each game is played once from seed 1 with scripted seats (a random bracketed move
offered by the observation) through :func:`atroposlib.envs.adapters.text_games.play_episode`,
trying 2, 1, 3, 4, 5 and 6 players until one resets. Prints one line per game that did
not finish (and why), then the count. The figure in ``environments/README.md`` comes from
this script (needs ``atroposlib[textarena]``; run with no network)::

    python scripts/textarena_offline_survey.py
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import sys

from atroposlib.envs.adapters.text_games import play_episode
from atroposlib.envs.adapters.textarena import TextArenaGame, scripted_player


def survey_game(game_id: str) -> str:
    """``done`` when the game played to its end, else why not."""
    reason = "no player count worked"
    for players in (2, 1, 3, 4, 5, 6):
        try:
            with contextlib.redirect_stdout(io.StringIO()):  # some games print boards
                episode = asyncio.run(
                    play_episode(
                        TextArenaGame(game_id, players),
                        {p: scripted_player(p) for p in range(players)},
                        1,
                        max_turns=500,
                        step_timeout_s=10,
                    )
                )
        except Exception as err:  # the game cannot even be made (import, syntax, data)
            lines = [ln.strip() for ln in str(err).splitlines() if ln.strip(" *")]
            reason = f"{type(err).__name__}: {(lines or [''])[0][:80]}"
            continue
        if episode.end_reason == "step_error" and episode.turns == 0:
            reason = "reset failed"
            continue
        return episode.end_reason
    return reason


def main() -> int:
    """Survey every ``-v0`` id; print the failures and the count."""
    from textarena.envs.registration import ENV_REGISTRY

    games = sorted(g for g in ENV_REGISTRY if g.endswith("-v0"))
    done = 0
    for game_id in games:
        outcome = survey_game(game_id)
        if outcome == "done":
            done += 1
        else:
            print(f"{game_id}: {outcome}", flush=True)
    print(f"{done} of {len(games)} game families play to the end offline")
    return 0


if __name__ == "__main__":
    sys.exit(main())
