"""HTTP header names our servers and clients agree on."""

from __future__ import annotations

__all__ = ["POLICY_VERSION_HEADER"]

POLICY_VERSION_HEADER = "X-Atropos-Policy-Version"
"""Response header carrying the weight version that produced an answer (serve-model writes
it, the fake server can, the inference clients read it); see (docs/design.md, "Policy
versions and staleness")."""
