"""TextArena's games as a multi-turn environment, offline.

Needs ``pip install 'atroposlib[textarena]'``. The adapter is
:class:`atroposlib.envs.adapters.textarena.TextArenaEnv` (built on the text-game base in
:mod:`atroposlib.envs.adapters.text_games`); this file runs it. Choose games with
``--env.game_ids '["TicTacToe-v0","ConnectFour-v0"]'``, the other seats with
``--env.opponent self_play|scripted|server`` (``server``: another OpenAI-compatible
inference server, ``--env.opponent_server '{"base_url": "http://127.0.0.1:9002/v1",
"model_name": "..."}'``; its moves are not trained).

Try it against the tiny model (after ``atropos-serve-model MODEL_DIR --port 9001``)::

    python environments/textarena_server.py process --env.opponent scripted \\
        --env.total_steps 2 --env.group_size 2 --env.max_tokens_per_turn 16 \\
        --env.tokenizer_name MODEL_DIR --openai.base_url http://127.0.0.1:9001/v1 \\
        --openai.model_name MODEL_DIR --env.data_path_to_save_groups out/textarena.jsonl
"""

from atroposlib.envs.adapters.textarena import TextArenaEnv, TextArenaEnvConfig

__all__ = ["TextArenaEnv", "TextArenaEnvConfig"]

if __name__ == "__main__":
    TextArenaEnv.cli()
