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
from typing import Any, Callable, Dict, List, Mapping, Set, Type, Union

from atroposlib.envs.reward_fns.reward_function import RewardFunction

logger = logging.getLogger(__name__)


class RewardRegistry:
    """Holds reward classes by name; modules of this package are imported on demand."""

    def __init__(self) -> None:
        self._registry: Dict[str, Type[RewardFunction]] = {}
        self._functions: Dict[str, Callable[..., List[float]]] = {}

    def register_function(self, name: str, function: Callable[..., List[float]]) -> None:
        """Register a plain function ``f(completions, **kwargs) -> scores`` as ``name``;
        ``create(name)`` wraps it in a :class:`LegacyFunctionWrapper`."""
        if not callable(function):
            raise TypeError(f"{function!r} is not callable")
        self._functions[name] = function

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

    def get(self, name: str) -> Union[Type[RewardFunction], Callable[..., List[float]]]:
        """The class (or plain function) registered as ``name``.

        Raises:
            KeyError: naming the known rewards, when ``name`` is unknown.
        """
        if name not in self._registry and name not in self._functions:
            self._load_reward_function(name)
        if name in self._registry:
            return self._registry[name]
        if name in self._functions:
            return self._functions[name]
        raise KeyError(f"unknown reward function {name!r}; known: {', '.join(self.list())}")

    def list(self) -> List[str]:
        """Registered names (classes and functions), sorted."""
        return sorted({*self._registry, *self._functions})

    def list_registered(self) -> List[str]:
        """Registered names, sorted (the original's name of :meth:`list`)."""
        return self.list()

    def load_required_functions(self, config: Any) -> Set[str]:
        """Load every reward ``config`` names and return the names.

        ``config`` is a name, a reward config dict (``{"type": ...}``; a combined reward's
        ``rewards`` are followed), a list of those, or an object or dict with a
        ``reward_functions`` entry. Raises KeyError for an unknown name.
        """
        names: Set[str] = set()
        pending: List[Any] = [config]
        while pending:
            item = pending.pop()
            if item is None or isinstance(item, RewardFunction):
                continue
            if isinstance(item, str):
                self.get(item)
                names.add(item)
            elif isinstance(item, Mapping):
                if "reward_functions" in item and not ("type" in item or "name" in item):
                    pending.append(item["reward_functions"])
                    continue
                kind = item.get("type") or item.get("name")
                if kind:
                    pending.append(str(kind))
                params = item.get("params") or {}
                pending.extend(item.get("rewards") or params.get("rewards") or [])
            elif isinstance(item, (list, tuple, set)):
                pending.extend(item)
            elif hasattr(item, "reward_functions"):
                pending.append(item.reward_functions)
            else:
                raise ValueError(f"cannot read reward names from {item!r}")
        return names

    def __contains__(self, name: object) -> bool:
        return name in self._registry or name in self._functions

    def create(
        self, name_or_config: Union[str, Mapping[str, Any]], **kwargs: Any
    ) -> RewardFunction:
        """Instantiate a reward from a name or a config dict (kwargs override the config).

        Raises:
            ValueError: when a config dict has no ``type``/``name``.
            KeyError: when the reward is unknown.
        """
        if isinstance(name_or_config, str):
            return self._instantiate(name_or_config, kwargs)
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
        return self._instantiate(str(reward_type), params)

    def _instantiate(self, name: str, params: Dict[str, Any]) -> RewardFunction:
        target = self.get(name)
        if isinstance(target, type):
            return target(**params)
        return LegacyFunctionWrapper(target, **params)

    def _load_reward_function(self, name: str) -> None:
        """Import the built-in module that defines reward ``name`` (``<name>_reward`` or
        ``<name>``), which registers it; nothing when there is none."""
        self._import_module_for(name)

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


class LegacyFunctionWrapper(RewardFunction):
    """A plain reward function ``f(completions, **kwargs) -> scores`` as a
    :class:`RewardFunction` (weighted, logged, errors contained). Constructor keywords are
    passed to every call; call keywords override them."""

    def __init__(self, func: Callable[..., List[float]], weight: float = 1.0, **kwargs: Any):
        name = kwargs.pop("name", None)
        super().__init__(weight=weight, name=name, **kwargs)
        self.func = func

    @property
    def name(self) -> str:
        """The given name, else the function's ``__name__``."""
        return self._name or getattr(self.func, "__name__", type(self.func).__name__)

    @name.setter
    def name(self, value: str | None) -> None:
        self._name = value

    def compute(self, completions: List[Any], **kwargs: Any) -> List[float]:
        return [float(s) for s in self.func(completions, **{**self.config, **kwargs})]


registry = RewardRegistry()
"""The process-wide registry that the built-in rewards register into."""

__all__ = ["LegacyFunctionWrapper", "RewardRegistry", "registry"]
