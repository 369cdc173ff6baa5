"""Adapters from environment libraries to :class:`~atroposlib.envs.base.BaseEnv`.

Each adapter lives in its own module and imports its library only when an
environment is set up, so ``import atroposlib`` never needs them. Install the
library with the matching extra:

- :mod:`atroposlib.envs.adapters.reasoning_gym`: ``pip install 'atroposlib[reasoning-gym]'``
- :mod:`atroposlib.envs.adapters.textarena`: ``pip install 'atroposlib[textarena]'``
- :mod:`atroposlib.envs.adapters.text_games`: the multi-turn game base (no extra needed);
  :mod:`atroposlib.envs.adapters.game_worker` runs a game in a worker process that a step
  past its time limit kills
- :mod:`atroposlib.envs.adapters.verifiers_v1`: ``pip install 'atroposlib[verifiers-v1]'`` in a
  venv of its own (verifiers 0.4 needs openai<3; ``make .venv-verifiers``)
"""
