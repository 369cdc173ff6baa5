"""Inference server layer: configs, backends, ``ServerManager`` and ``ManagedServer``.

The faithful import paths are the submodules (``server_baseline``, ``server_manager``,
``openai_server``, ``vllm_server``, ``sglang_server``, ``trl_vllm_server``,
``server_harness``, ``managed_server``, ``managed_server_proxy``, ``proxy_client``);
the most used names are re-exported here for convenience.
"""

from atroposlib.envs.server_handling.errors import NoHealthyServerError, ServerUnavailableError
from atroposlib.envs.server_handling.server_baseline import (
    APIServer,
    APIServerConfig,
    AsyncSemWithAdaptiveWeight,
    OpenaiConfig,
    ReasoningConfig,
    ServerBaseline,
)
from atroposlib.envs.server_handling.server_manager import ServerManager, ServerManagerConfig

__all__ = [
    "APIServer",
    "APIServerConfig",
    "AsyncSemWithAdaptiveWeight",
    "NoHealthyServerError",
    "OpenaiConfig",
    "ReasoningConfig",
    "ServerBaseline",
    "ServerManager",
    "ServerManagerConfig",
    "ServerUnavailableError",
]
