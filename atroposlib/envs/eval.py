"""Standalone evaluations: a small framework for eval-only tasks.

Subclass :class:`EvalBase`, implement ``setup_data`` and ``run_item``, then run it with
``asyncio.run(eval_runner(MyEval(...)))`` (flags ``--server-url``, ``--model-name``, as the
original), :func:`eval_cli` (a fuller command line that builds the eval from its class) or
``await MyEval(...)(server_manager)``. Results go to
``{eval_dir}/metrics.json`` and ``samples.jsonl`` through :func:`evaluate_log`, the same
layout ``BaseEnv.evaluate_log`` writes.

Example::

    class Arith(EvalBase):
        def setup_data(self):
            return [{"q": "2+2", "a": "4"}]

        async def run_item(self, server, item):
            out = await server.chat_completion(messages=[{"role": "user", "content": item["q"]}],
                                               n=1, max_tokens=16, split="eval")
            ok = out.choices[0].message.content.strip() == item["a"]
            return {"accuracy": float(ok)}, [{"question": item["q"], "correct": ok}]

    if __name__ == "__main__":
        asyncio.run(eval_runner(Arith()))
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from abc import ABC, abstractmethod
from typing import Any, Dict, List, Sequence, Tuple, Type

import numpy as np
from tqdm.asyncio import tqdm_asyncio

from atroposlib.envs import files
from atroposlib.utils.display import display_metrics_table

logger = logging.getLogger(__name__)


def pass_at_k(m: int, c: int, k: int) -> float:
    """Unbiased pass@k: chance that at least one of ``k`` of ``m`` samples is correct,
    given ``c`` correct samples (Chen et al., 2021).

    Raises:
        ValueError: unless ``0 <= c <= m`` and ``1 <= k <= m``.
    """
    if not (0 <= c <= m) or not (1 <= k <= m):
        raise ValueError(f"pass_at_k needs 0 <= c <= m and 1 <= k <= m (m={m}, c={c}, k={k})")
    if m - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(m - c + 1, m + 1)))


def build_eval_record(
    metrics: Dict[str, Any],
    task_name: str,
    model_name: str | None,
    start_time: float | None,
    end_time: float | None,
    generation_parameters: Dict[str, Any] | None = None,
) -> Dict[str, Any]:
    """The ``metrics.json`` document (pure)."""
    elapsed = (end_time - start_time) if start_time is not None and end_time is not None else 0.0
    return files.eval_metrics_document(
        dict(metrics), task_name, model_name, elapsed, dict(generation_parameters or {})
    )


def evaluate_log(
    metrics: Dict[str, Any],
    eval_dir: str | None = None,
    task_name: str | None = None,
    model_name: str | None = None,
    start_time: float | None = None,
    end_time: float | None = None,
    generation_parameters: Dict[str, Any] | None = None,
    samples: List[Dict[str, Any]] | None = None,
    verbose: bool = True,
) -> Dict[str, Any] | None:
    """Write ``{eval_dir}/metrics.json`` (and ``samples.jsonl`` when samples are given).

    Returns the metrics document, or None (with a warning) when ``eval_dir`` is unset.
    The metrics table is printed when ``verbose``.
    """
    task = task_name or "eval"
    if verbose:
        display_metrics_table(task, metrics, start_time, end_time)
    if not eval_dir:
        logger.warning("evaluate_log: no eval directory set; %s results not written", task)
        return None
    record = build_eval_record(
        metrics, task, model_name, start_time, end_time, generation_parameters
    )
    files.write_eval_results(eval_dir, record, samples)
    logger.info("evaluation results written to %s", eval_dir)
    return record


class EvalBase(ABC):
    """A standalone evaluation task.

    ``pass_at_n`` / ``pass_at_n_samples``: ``run_item`` may draw
    ``max(pass_at_n, pass_at_n_samples)`` samples per item and report
    ``pass_at_k(samples, correct, pass_at_n)`` (see :meth:`pass_metrics`). Extra keyword
    arguments become attributes, read by ``setup_data``/``run_item`` and by the run itself:
    ``eval_dir`` and ``verbose`` (where :func:`evaluate_log` writes and whether it prints the
    table), ``temperature``, ``top_p`` and ``max_tokens`` (:meth:`get_generation_params`).
    """

    def __init__(
        self,
        pass_at_n: int = 1,
        pass_at_n_samples: int = 1,
        max_concurrency: int = 16,
        **kwargs: Any,
    ) -> None:
        if pass_at_n < 1:
            raise ValueError("pass_at_n must be >= 1")
        self.pass_at_n = pass_at_n
        self.pass_at_n_samples = pass_at_n_samples
        self.max_concurrency = max(1, max_concurrency)
        #: Items whose ``run_item`` raised in the last run (logged; not in the metrics).
        self.failed_items = 0
        #: Every item's samples from the last run, in item order.
        self.eval_samples: List[Dict[str, Any]] = []
        for key, value in kwargs.items():
            setattr(self, key, value)
        self.data: List[Any] = list(self.setup_data())

    @property
    def task_name(self) -> str:
        """``{ClassName}@{pass_at_n}``, with ``:{pass_at_n_samples}`` when the two differ: the
        name printed with the metrics and given to :func:`evaluate_log`."""
        name = f"{type(self).__name__}@{self.pass_at_n}"
        if self.pass_at_n != self.pass_at_n_samples:
            name += f":{self.pass_at_n_samples}"
        return name

    def get_generation_params(self) -> Dict[str, Any]:
        """The sampling parameters of every request: the instance's ``temperature`` (0.0),
        ``top_p`` (1.0), ``n = max(pass_at_n, pass_at_n_samples)`` and ``max_tokens`` when it
        is set (left to the server otherwise). Also reported in ``metrics.json``."""
        params: Dict[str, Any] = {
            "temperature": getattr(self, "temperature", 0.0),
            "n": max(self.pass_at_n_samples, self.pass_at_n),
            "top_p": getattr(self, "top_p", 1.0),
        }
        max_tokens = getattr(self, "max_tokens", None)
        if max_tokens is not None and max_tokens > 0:  # servers refuse -1
            params["max_tokens"] = max_tokens
        return params

    def pass_metrics(self, num_samples: int, num_correct: int) -> Dict[str, float]:
        """``{"pass@{k}": ...}`` for this task's ``pass_at_n``."""
        k = min(self.pass_at_n, num_samples)
        return {f"pass@{k}": pass_at_k(num_samples, num_correct, k)}

    @abstractmethod
    def setup_data(self) -> Sequence[Any]:
        """The items to evaluate."""

    @abstractmethod
    async def run_item(
        self, server: Any, data_item: Any
    ) -> Tuple[Dict[str, float], List[Dict[str, Any]]]:
        """Evaluate one item: ``(metrics for the item, samples to log)``."""

    async def chat_completion(self, server: Any, messages: List[Dict[str, Any]]) -> Any:
        """A chat completion of ``messages`` on ``server`` with this task's generation
        parameters, on the servers' eval slots (``split="eval"``)."""
        return await server.chat_completion(
            messages=messages, **self.get_generation_params(), split="eval"
        )

    async def __call__(self, server_manager: Any) -> Dict[str, float]:
        """Run every item concurrently (at most ``max_concurrency`` at once) under a progress
        bar, average each metric, print ``{task_name} metrics: {...}``, log the results with
        :func:`evaluate_log` (to the instance's ``eval_dir``) and return the metrics.

        An item whose ``run_item`` raises is logged and counted in :attr:`failed_items`; the
        samples are kept in :attr:`eval_samples`.
        """
        sem = asyncio.Semaphore(self.max_concurrency)

        async def one(item: Any) -> Tuple[Dict[str, float], List[Dict[str, Any]]] | None:
            async with sem:
                try:
                    return await self.run_item(server_manager, item)
                except Exception:  # one broken item must not sink the run; logged and counted
                    logger.exception("eval item failed")
                    return None

        start = time.time()
        results = await tqdm_asyncio.gather(*(one(item) for item in self.data))
        end = time.time()
        metrics, self.eval_samples, self.failed_items = _aggregate(results)
        task_name = self.task_name
        print(f"{task_name} metrics: {metrics}")
        evaluate_log(
            metrics,
            eval_dir=getattr(self, "eval_dir", None),
            task_name=task_name,
            model_name=_model_name(server_manager, getattr(self, "model_name", None)),
            start_time=start,
            end_time=end,
            generation_parameters=self.get_generation_params(),
            samples=self.eval_samples,
            verbose=getattr(self, "verbose", False),
        )
        return metrics


def _aggregate(
    results: Sequence[Tuple[Dict[str, float], List[Dict[str, Any]]] | None],
) -> Tuple[Dict[str, float], List[Dict[str, Any]], int]:
    """``(mean of each metric over the items that report it, all samples, failed items)``."""
    sums: Dict[str, float] = {}
    counts: Dict[str, int] = {}
    samples: List[Dict[str, Any]] = []
    failed = 0
    for result in results:
        if result is None:
            failed += 1
            continue
        item_metrics, item_samples = result
        for key, value in item_metrics.items():
            sums[key] = sums.get(key, 0.0) + float(value)
            counts[key] = counts.get(key, 0) + 1
        samples.extend(item_samples)
    return {key: sums[key] / counts[key] for key in sums}, samples, failed


def _model_name(server_manager: Any, default: str | None) -> str | None:
    """The first server's model name (what the run was evaluated on), else ``default``."""
    servers = getattr(server_manager, "servers", None) or []
    config = getattr(servers[0], "config", None) if servers else None
    return getattr(config, "model_name", None) or default


async def run_eval(
    eval_obj: EvalBase,
    server: Any,
    eval_dir: str | None = None,
    model_name: str | None = None,
    verbose: bool = True,
) -> Dict[str, float]:
    """Run ``eval_obj`` against ``server`` (its ``__call__``, which logs the results with
    :func:`evaluate_log`) with ``eval_dir`` and ``verbose`` set on it; ``model_name`` names
    the model when the server does not. Returns the metrics (failed items are in
    ``eval_obj.failed_items``)."""
    if eval_dir is not None:
        eval_obj.eval_dir = eval_dir  # type: ignore[attr-defined]
    eval_obj.verbose = verbose  # type: ignore[attr-defined]
    if model_name is not None and getattr(eval_obj, "model_name", None) is None:
        eval_obj.model_name = model_name  # type: ignore[attr-defined]
    return await eval_obj(server)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Run a standalone evaluation against an OpenAI-compatible server."
    )
    parser.add_argument(
        "--base-url", default="http://localhost:9001/v1", help="inference server URL"
    )
    parser.add_argument("--model-name", default="default", help="model name sent to the server")
    parser.add_argument("--api-key", default="x", help="API key for the inference server")
    parser.add_argument(
        "--server-type", default="openai", choices=["openai", "vllm", "sglang", "trl"]
    )
    parser.add_argument(
        "--eval-dir", default=None, help="directory for metrics.json and samples.jsonl"
    )
    parser.add_argument("--pass-at-n", type=int, default=1)
    parser.add_argument("--pass-at-n-samples", type=int, default=1)
    parser.add_argument("--max-concurrency", type=int, default=16)
    parser.add_argument("--timeout", type=float, default=1200, help="per-request timeout (s)")
    return parser


def _runner_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Run an evaluation against a server.")
    parser.add_argument(
        "--server-url", default="http://localhost:8000", help="inference server base URL"
    )
    parser.add_argument("--model-name", default="default", help="model name sent to the server")
    parser.add_argument("--api-key", default="x", help="API key for the inference server")
    parser.add_argument(
        "--eval-dir", default=None, help="also write metrics.json and samples.jsonl here"
    )
    return parser


async def eval_runner(eval_env: EvalBase, argv: Sequence[str] | None = None) -> Any:
    """The original's runner: ``asyncio.run(eval_runner(MyEval(...)))``.

    Parses ``--server-url`` (default ``http://localhost:8000``) and ``--model-name`` from
    ``argv`` (``sys.argv`` by default), builds a ``ServerManager`` on that server and
    returns ``await eval_env(server_manager)``: the metrics dict, after the printed
    ``{task_name} metrics: {...}`` line. ``--eval-dir`` sets the eval's ``eval_dir`` (where
    its ``metrics.json`` and ``samples.jsonl`` go).
    """
    from atroposlib.envs.server_handling.server_baseline import APIServerConfig
    from atroposlib.envs.server_handling.server_manager import ServerManager

    args = _runner_parser().parse_args(argv)
    config = APIServerConfig(
        model_name=args.model_name, base_url=args.server_url, api_key=args.api_key
    )
    if args.eval_dir:
        eval_env.eval_dir = args.eval_dir  # type: ignore[attr-defined]
    server_manager = ServerManager([config])
    try:
        return await eval_env(server_manager)
    finally:
        await server_manager.close()


def eval_cli(
    eval_cls: Type[EvalBase], argv: Sequence[str] | None = None, **eval_kwargs: Any
) -> Dict[str, float]:
    """A fuller command line: parse flags (``--base-url``, ``--server-type``, ``--eval-dir``,
    ``--pass-at-n`` ...), build the eval from ``eval_cls`` and a ``ServerManager``, run it
    and log the results."""
    from atroposlib.envs.server_handling.server_baseline import APIServerConfig
    from atroposlib.envs.server_handling.server_manager import ServerManager

    args = _parser().parse_args(argv)
    config = APIServerConfig(
        model_name=args.model_name,
        base_url=args.base_url,
        api_key=args.api_key,
        server_type=args.server_type,
        timeout=args.timeout,
        num_requests_for_eval=args.max_concurrency,
    )
    server = ServerManager([config])
    eval_obj = eval_cls(
        pass_at_n=args.pass_at_n,
        pass_at_n_samples=args.pass_at_n_samples,
        max_concurrency=args.max_concurrency,
        **eval_kwargs,
    )
    return asyncio.run(
        run_eval(eval_obj, server, eval_dir=args.eval_dir, model_name=args.model_name)
    )


__all__ = [
    "EvalBase",
    "build_eval_record",
    "eval_cli",
    "eval_runner",
    "evaluate_log",
    "pass_at_k",
    "run_eval",
]
