"""Namespaces used by the environment CLI (``--env.*``, ``--openai.*``)."""

ENV_NAMESPACE = "env"
OPENAI_NAMESPACE = "openai"
SERVER_MANAGER_NAMESPACE = "server"
NAMESPACE_SEP = "."
