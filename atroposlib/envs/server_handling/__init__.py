"""Inference server layer: configs, backends, ``ServerManager`` and ``ManagedServer``.

The faithful import paths are the submodules (``server_baseline``, ``server_manager``,
``openai_server``, ``vllm_server``, ``sglang_server``, ``trl_vllm_server``,
``server_harness``, ``managed_server``, ``managed_server_proxy``, ``proxy_client``);
the most used names are re-exported here for convenience. Behind those paths the pieces
have their own modules: ``server_config`` and ``adaptive_semaphore`` (under
``server_baseline``), ``server_routing`` and ``server_discovery`` (under ``server_manager``),
``sequence_node``, ``managed_tokenizer``, ``managed_adapter`` and ``dummy_managed_server``
(under ``managed_server``).
"""

import importlib
from typing import Any

_EXPORTS = {
    "NoHealthyServerError": "errors",
    "ServerUnavailableError": "errors",
    "APIServer": "server_baseline",
    "APIServerConfig": "server_baseline",
    "AsyncSemWithAdaptiveWeight": "server_baseline",
    "OpenaiConfig": "server_baseline",
    "ReasoningConfig": "server_baseline",
    "ServerBaseline": "server_baseline",
    "ServerManager": "server_manager",
    "ServerManagerConfig": "server_manager",
}


def __getattr__(name: str) -> Any:
    # Lazy, so that light submodules (the embedded servers) do not pay for openai's import.
    if name in _EXPORTS:
        module = importlib.import_module(f"{__name__}.{_EXPORTS[name]}")
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
