"""Namespaces used by the environment CLI (``--env.*``, ``--openai.*``)."""

from atroposlib.utils.cli import NAMESPACE_SEP

ENV_NAMESPACE = "env"
OPENAI_NAMESPACE = "openai"
SERVER_MANAGER_NAMESPACE = "server"

__all__ = ["ENV_NAMESPACE", "NAMESPACE_SEP", "OPENAI_NAMESPACE", "SERVER_MANAGER_NAMESPACE"]
