"""A generic environment over any dataset, with rewards picked from ``reward_fns`` in YAML."""

from environments.dataset_environment.dataset_env import DatasetEnv, DatasetEnvConfig

__all__ = ["DatasetEnv", "DatasetEnvConfig"]
