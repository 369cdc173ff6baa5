"""reasoning-gym's procedural tasks (106 in 0.1.25) as one environment, offline.

Needs ``pip install 'atroposlib[reasoning-gym]'``. The adapter is
:class:`atroposlib.envs.adapters.reasoning_gym.ReasoningGymEnv`; this file runs it.
Pick tasks with ``--env.tasks`` (``all``, ``'["chain_sum","leg_counting"]'`` or
``'{"chain_sum": 3, "leg_counting": 1}'``), tune generators with ``--env.task_configs``.

Try it against the tiny model (after ``atropos-serve-model MODEL_DIR --port 9001``)::

    python environments/reasoning_gym_server.py process --env.tasks all \\
        --env.order round_robin --env.total_steps 8 --env.group_size 2 \\
        --env.max_answer_tokens 32 --env.tokenizer_name MODEL_DIR \\
        --openai.base_url http://127.0.0.1:9001/v1 --openai.model_name MODEL_DIR \\
        --env.data_path_to_save_groups out/reasoning_gym.jsonl
"""

from atroposlib.envs.adapters.reasoning_gym import ReasoningGymEnv, ReasoningGymEnvConfig

__all__ = ["ReasoningGymEnv", "ReasoningGymEnvConfig"]

if __name__ == "__main__":
    ReasoningGymEnv.cli()
