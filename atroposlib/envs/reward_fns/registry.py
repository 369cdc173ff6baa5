"""Name → reward-class registry, so rewards can be chosen from YAML.

``registry.create`` accepts a name (``"accuracy"``), or a dict
``{"type": "accuracy", "weight": 2.0, "params": {...}}`` (``params`` may also be given
inline as extra keys).

Example::

    reward = registry.create({"type": "format", "weight": 0.5})
    scores = reward(["<think>..</think><answer>4</answer>"])
"""

from __future__ import annotations

import importlib
import logging
from typing import Any, Callable, Dict, List, Mapping, Type, Union

from atroposlib.envs.reward_fns.reward_function import RewardFunction

logger = logging.getLogger(__name__)


class RewardRegistry:
    """Holds reward classes by name; modules of this package are imported on demand."""

    def __init__(self) -> None:
        self._registry: Dict[str, Type[RewardFunction]] = {}

    def register(
        self, cls: Type[RewardFunction] | None = None, name: str | None = None
    ) -> Union[Type[RewardFunction], Callable[[Type[RewardFunction]], Type[RewardFunction]]]:
        """Register a class, as ``@registry.register`` or ``@registry.register(name="x")``.

        Without a name the class name is used, lower-cased, with a trailing ``reward``
        removed (``FormatReward`` → ``format``).
        """

        def decorate(klass: Type[RewardFunction]) -> Type[RewardFunction]:
            if not (isinstance(klass, type) and issubclass(klass, RewardFunction)):
                raise TypeError(f"{klass!r} is not a RewardFunction subclass")
            key = name or _default_name(klass.__name__)
            existing = self._registry.get(key)
            if existing is not None and existing is not klass:
                logger.warning("reward %r re-registered: %s replaces %s", key, klass, existing)
            klass.registry_name = key  # type: ignore[attr-defined]
            self._registry[key] = klass
            return klass

        return decorate(cls) if cls is not None else decorate

    def get(self, name: str) -> Type[RewardFunction]:
        """The class registered as ``name``.

        Raises:
            KeyError: naming the known rewards, when ``name`` is unknown.
        """
        if name not in self._registry:
            self._import_module_for(name)
        if name not in self._registry:
            raise KeyError(f"unknown reward function {name!r}; known: {', '.join(self.list())}")
        return self._registry[name]

    def list(self) -> List[str]:
        """Registered names, sorted."""
        return sorted(self._registry)

    def __contains__(self, name: object) -> bool:
        return name in self._registry

    def create(
        self, name_or_config: Union[str, Mapping[str, Any]], **kwargs: Any
    ) -> RewardFunction:
        """Instantiate a reward from a name or a config dict (kwargs override the config).

        Raises:
            ValueError: when a config dict has no ``type``/``name``.
            KeyError: when the reward is unknown.
        """
        if isinstance(name_or_config, str):
            return self.get(name_or_config)(**kwargs)
        if not isinstance(name_or_config, Mapping):
            raise ValueError(
                f"reward config must be a name or a dict, got {type(name_or_config).__name__}"
            )
        config = dict(name_or_config)
        reward_type = config.pop("type", None) or config.pop("name", None)
        if not reward_type:
            raise ValueError(f"reward config {name_or_config!r} has no 'type'")
        params = dict(config.pop("params", None) or {})
        params.update(config)
        params.update(kwargs)
        return self.get(str(reward_type))(**params)

    @staticmethod
    def _import_module_for(name: str) -> None:
        for module in (
            f"atroposlib.envs.reward_fns.{name}_reward",
            f"atroposlib.envs.reward_fns.{name}",
        ):
            try:
                importlib.import_module(module)
                return
            except ModuleNotFoundError as exc:
                if exc.name != module:
                    raise


def _default_name(class_name: str) -> str:
    key = class_name.lower()
    if key.endswith("reward") and key != "reward":
        key = key[: -len("reward")]
    return key


registry = RewardRegistry()
"""The process-wide registry that the built-in rewards register into."""

__all__ = ["RewardRegistry", "registry"]
