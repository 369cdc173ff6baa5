"""verifiers 0.4 tasksets (``verifiers.v1``) as an environment, through the OpenAI proxy.

Needs verifiers 0.4 in a venv of its own (``make .venv-verifiers``, or ``pip install
'atroposlib[verifiers-v1]'``: it needs openai<3) and the managed-server proxy, whose
sessions record the tokens and logprobs of every rollout. The adapter is
:class:`atroposlib.envs.adapters.verifiers_v1.VerifiersEnv`; this file runs it. Name the
taskset with ``--env.taskset_id`` (an importable module exporting a ``vf.Taskset``) and
its config with ``--env.taskset_args '{...}'``.

Try it against the tiny model with the test taskset (after ``atropos-serve-model
MODEL_DIR --port 9001`` and the proxy over it: ``python -m
atroposlib.envs.server_handling.managed_server_proxy --config servers.json --port 9100``)::

    PYTHONPATH=tests/environments .venv-verifiers/bin/python environments/verifiers_v1_server.py \\
        process --env.taskset_id vf_v1_tasks --env.total_steps 2 --env.group_size 2 \\
        --env.tokenizer_name MODEL_DIR --openai.base_url http://127.0.0.1:9001/v1 \\
        --openai.model_name MODEL_DIR --proxy_url http://127.0.0.1:9100 \\
        --env.data_path_to_save_groups out/verifiers_v1.jsonl
"""

from atroposlib.envs.adapters.verifiers_v1 import VerifiersEnv, VerifiersEnvConfig

__all__ = ["VerifiersEnv", "VerifiersEnvConfig"]

if __name__ == "__main__":
    VerifiersEnv.cli()
