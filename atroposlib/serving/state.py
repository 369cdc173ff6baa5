"""``ServingState``: everything the routes of ``atropos-serve-model`` read, kept on
``app.state.serving`` (the engine, the tokenizer, the names served, and the per-app helpers
``create_app`` attaches: the preparation thread pool, the client-template renderer, the
weight roots and the pause gate).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from fastapi import Request

from atroposlib.http.openai_protocol import InvalidRequest, ModelNotFound
from atroposlib.serving.chat_templates import ClientTemplateRenderer
from atroposlib.serving.config import ServeModelConfig
from atroposlib.serving.engine import Engine
from atroposlib.serving.in_place import plan_in_place
from atroposlib.serving.loader import (
    load_compatible,
    load_model,
    load_tokenizer,
    prompt_char_limit,
    resolve_device,
    resolve_dtype,
)
from atroposlib.serving.pause import PauseGate
from atroposlib.serving.weights_version import read_weights_version

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass
class ServingState:
    """Everything the routes need: the engine, the tokenizer and the names served; and,
    attached by ``create_app``, the thread pool that templates and tokenises (``prep``),
    the sandboxed client-template renderer (None when client templates are off), the
    directories ``/update_weights`` may load from and the pause gate."""

    config: ServeModelConfig
    engine: Engine
    tokenizer: Any
    names: list[str]
    started: float
    max_prompt_chars: int | None = None
    prep: ThreadPoolExecutor | None = None
    renderer: ClientTemplateRenderer | None = None
    weight_roots: list[str] = field(default_factory=list)
    pause_gate: PauseGate | None = None

    @property
    def name(self) -> str:
        """The primary served model name."""
        return self.names[0]

    def check_prompt_chars(self, text: str, param: str = "prompt") -> None:
        """Refuse text that cannot fit the context whatever it tokenises to, before tokenising.

        Tokenising megabytes costs seconds of CPU; every token covers at most
        :func:`~.loader.prompt_char_limit`'s share of characters, so longer text is a sure 400.
        """
        if self.max_prompt_chars is not None and len(text) > self.max_prompt_chars:
            raise InvalidRequest(
                f"this model's maximum context length is {self.engine.max_model_len} tokens; "
                f"the {param} has {len(text)} characters, more than can fit",
                param=param,
                code="context_length_exceeded",
            )

    def encode(self, text: str, special: bool, param: str = "prompt") -> list[int]:
        """``text``'s token ids, refused first when it cannot fit (blocking: run off-loop)."""
        self.check_prompt_chars(text, param)
        return self.tokenizer.encode(text, add_special_tokens=special)

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in the preparation pool: templating and tokenising take up to
        seconds for long prompts, never on the event loop."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.prep, functools.partial(fn, *args))

    def check_model(self, model: str | None) -> str:
        """The served name a request's ``model`` asks for (404 when it is not served)."""
        if model is None or model in self.names:
            return model or self.name
        if os.path.isdir(self.config.model) and os.path.realpath(model) == os.path.realpath(
            self.config.model
        ):
            return model  # the same local directory spelled differently
        raise ModelNotFound(
            f"The model `{model}` does not exist. Served: {self.names}",
            param="model",
            code="model_not_found",
        )


async def serving_state(request: Request) -> ServingState:
    """The app's :class:`ServingState` (a route dependency).

    async: FastAPI runs a plain ``def`` dependency in its thread pool, a hand-off that
    costs more CPU per request than the lookup itself."""
    return request.app.state.serving


def build_state(config: ServeModelConfig) -> ServingState:
    """Load model and tokenizer per ``config`` and wrap them in an engine (blocking)."""
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    torch.manual_seed(config.seed)
    tokenizer = load_tokenizer(config.model)
    model = load_model(config.model, device, dtype)
    if device.type == "cpu":
        small = sum(p.numel() for p in model.parameters()) < 100_000_000
        torch.set_num_threads(config.cpu_threads or (1 if small else torch.get_num_threads()))
    limit = getattr(model.config, "max_position_embeddings", None) or 4096
    max_len = config.max_model_len or int(limit)
    engine = Engine(
        model,
        tokenizer,
        max_model_len=max_len,
        max_num_seqs=config.max_num_seqs,
        max_prefill_tokens=config.max_prefill_tokens,
        gpu_memory_fraction=config.gpu_memory_fraction,
        swap_drain_timeout=config.swap_drain_timeout,
        swap_in_place=config.swap_in_place,
        loader=(
            (lambda path: plan_in_place(path, engine.model))
            if config.swap_in_place
            else (lambda path: load_compatible(path, engine.model, device, dtype))
        ),
    )
    engine.version = read_weights_version(config.model) or 0
    logger.info("loaded %s on %s (%s), max_model_len=%d", config.model, device, dtype, max_len)
    return ServingState(
        config,
        engine,
        tokenizer,
        list(config.served_model_name or [config.model]),
        time.time(),
        prompt_char_limit(tokenizer, max_len),
    )
