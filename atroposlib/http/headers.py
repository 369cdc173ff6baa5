"""HTTP header names our servers and clients agree on."""

from __future__ import annotations

__all__ = ["POLICY_VERSION_HEADER", "SESSION_ID_HEADER"]

POLICY_VERSION_HEADER = "X-Atropos-Policy-Version"
"""Response header carrying the weight version that produced an answer (serve-model writes
it, the fake server can, the inference clients read it); see (docs/design.md, "Policy
versions and staleness")."""

SESSION_ID_HEADER = "X-Session-ID"
"""Request header naming the trajectory a request belongs to: every request of one
``ManagedServer`` carries the same id, so the ``ServerManager`` (and a router in front of
the servers, such as sglang-router or vllm-router) can keep a trajectory's turns on one
server and reuse its prefix cache."""
