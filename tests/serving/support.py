"""Helpers for the serve-model tests: server command line, direct forward passes."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import httpx
import torch

from atroposlib.testing.launch import serve_model_cmd

KEY = "s3cret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
ORIGIN = "http://localhost:5173"
"""The one browser origin the keyed server accepts (``--cors-origin``)."""


@dataclass
class Served:
    """A running server: its root URL, the model directory and the served name."""

    url: str
    model_dir: str
    name: str

    @property
    def v1(self) -> str:
        return f"{self.url}/v1"


def serve_cmd(model_dir: str | Path, port: int, *extra: str) -> list[str]:
    """Command line of the server under test (quiet: warnings and errors only)."""
    return serve_model_cmd(model_dir, port, "--log-level", "warning", *extra)


def direct_logprobs(model, prompt_ids: list[int], output_ids: list[int]) -> list[float]:
    """Log-probabilities of ``output_ids`` after ``prompt_ids`` from one plain forward pass."""
    ids = torch.tensor([list(prompt_ids) + list(output_ids)])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    start = len(prompt_ids) - 1
    return [logp[start + i, t].item() for i, t in enumerate(output_ids)]


def direct_prompt_logprobs(model, prompt_ids: list[int]) -> list[float]:
    """Log-probability of each prompt token (from position 1) given its prefix."""
    ids = torch.tensor([list(prompt_ids)])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    return [logp[i - 1, t].item() for i, t in enumerate(prompt_ids) if i > 0]


def post(
    url: str, body: dict, headers: dict | None = None, timeout: float = 60.0
) -> httpx.Response:
    """POST JSON with a timeout."""
    return httpx.post(url, json=body, headers=headers or {}, timeout=timeout)
