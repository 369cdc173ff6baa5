"""``ReasoningGymEnv``: every procedural task of reasoning-gym as an environment.

reasoning-gym (``pip install 'atroposlib[reasoning-gym]'``) generates verifiable
questions offline: ``create_dataset(task, seed, size)[i]`` is ``{question, answer,
metadata}`` and ``dataset.score_answer(answer, entry)`` grades a reply in [0, 1]. This
adapter picks tasks (``tasks``: names, ``"all"``, or ``{name: weight}``), asks the
model through ``ManagedServer`` (tokens, masks and logprobs per rollout), extracts the
answer from ``<answer>...</answer>`` or ``\\boxed{...}``, and scores it with the
task's own scorer.

Three things make it safe to train on every task:

- **Reproducible across processes.** A few generators iterate over sets of strings,
  so their items follow ``PYTHONHASHSEED``. Items are generated (and scored) in a
  child process started with a fixed hash seed (``hash_seed``), so two runs with
  the same ``seed`` see the same items whatever the parent's hash seed.
- **A scorer that raises scores 0 and is counted** (``train/scorer_errors``); one that
  hangs past ``score_timeout_s`` restarts the child and scores 0. The worker goes on.
- **Held-out evaluation.** ``evaluate`` draws from datasets seeded by ``eval_seeds``,
  never by ``seed``, and reports accuracy per task (``eval/<task>/accuracy``).

Example::

    python environments/reasoning_gym_server.py process --env.tasks '["leg_counting"]' \\
        --env.total_steps 4 --openai.base_url http://127.0.0.1:9001/v1
"""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
import random
import re
import struct
import sys
import zlib
from collections import Counter
from typing import Any, Dict, List, Literal, Sequence, Tuple

from pydantic import Field

from atroposlib.envs.adapters import _rg_worker
from atroposlib.envs.adapters._defaults import adapter_config_init
from atroposlib.envs.base import BaseEnv, BaseEnvConfig, ScoredDataGroup
from atroposlib.envs.eval_helpers import drain_metrics, mean_of, means_by, run_eval_set
from atroposlib.envs.rollout_helpers import managed_chat_rollouts, scored_group
from atroposlib.envs.server_handling.server_baseline import APIServerConfig
from atroposlib.utils.aio import within
from atroposlib.utils.parent_death import parent_pid_env

logger = logging.getLogger(__name__)

__all__ = [
    "GeneratorError",
    "GeneratorPool",
    "ReasoningGymEnv",
    "ReasoningGymEnvConfig",
    "extract_answer",
    "resolve_tasks",
    "task_seed",
]

TAG_PROMPT = (
    "Solve the problem. You may reason step by step first. Then give only the final answer "
    "between <answer> and </answer> tags, in the format the question asks for."
)
BOXED_PROMPT = (
    "Solve the problem. You may reason step by step first. Then give only the final answer "
    "inside \\boxed{}, in the format the question asks for."
)
STARTUP_TIMEOUT_S = 300.0
MAX_EVAL_OVERLAP_SKIPS = 1000
_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_THINK_END = "</think>"


def extract_answer(text: str, answer_format: str = "answer_tag") -> str | None:
    """The final answer in ``text``: the last ``<answer>`` block or the last ``\\boxed{}``
    (braces balanced), stripped; None when there is none. Text before ``</think>`` is ignored.
    """
    text = text.split(_THINK_END)[-1]
    if answer_format == "answer_tag":
        found = _TAG.findall(text)
        return found[-1].strip() if found else None
    if answer_format != "boxed":
        raise ValueError(f"answer_format must be 'answer_tag' or 'boxed', not {answer_format!r}")
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j].strip()
    return None


def task_seed(task: str, seed: int) -> int:
    """The dataset seed of ``task`` for run seed ``seed``: distinct per task, stable across
    processes (crc32, not ``hash``)."""
    return (seed * 1_000_003 + zlib.crc32(task.encode())) % (2**32)


def resolve_tasks(
    tasks: str | Sequence[str] | Dict[str, float], known: Sequence[str]
) -> Dict[str, float]:
    """``{task: weight}`` from the ``tasks`` setting: ``"all"``, a comma-separated string,
    a list of names (weight 1 each) or a ``{name: weight}`` mapping.

    Raises:
        ValueError: naming the field, for an unknown task, a negative weight or no task.
    """
    if isinstance(tasks, str):
        names = list(known) if tasks.strip() == "all" else [t.strip() for t in tasks.split(",")]
        weights = {t: 1.0 for t in names if t}
    elif isinstance(tasks, dict):
        weights = {str(k): float(v) for k, v in tasks.items()}
    else:
        weights = {str(t): 1.0 for t in tasks}
    unknown = sorted(set(weights) - set(known))
    if unknown:
        raise ValueError(
            f"env.tasks: unknown reasoning-gym task(s) {unknown}; installed: {', '.join(known)}"
        )
    if any(w < 0 for w in weights.values()) or not any(w > 0 for w in weights.values()):
        raise ValueError(f"env.tasks: weights must be >= 0 with at least one > 0, got {weights}")
    return {t: w for t, w in weights.items() if w > 0}


class GeneratorError(RuntimeError):
    """A reasoning-gym call failed in the generator process (the message says how)."""


class _Child:
    """One generator process and its pipes; one request at a time."""

    def __init__(self, proc: asyncio.subprocess.Process):
        self.proc = proc
        self.lock = asyncio.Lock()

    async def request(self, name: str, args: Tuple[Any, ...]) -> Tuple[bool, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        data = pickle.dumps((name, args))
        self.proc.stdin.write(struct.pack(">I", len(data)) + data)
        await self.proc.stdin.drain()
        size = struct.unpack(">I", await self.proc.stdout.readexactly(4))[0]
        return pickle.loads(await self.proc.stdout.readexactly(size))

    def kill(self) -> None:
        if self.proc.returncode is None:
            self.proc.kill()


class GeneratorPool:
    """``processes`` child processes that run reasoning-gym with ``PYTHONHASHSEED=hash_seed``.

    ``await pool.call(fn, *args)`` runs a function of :mod:`._rg_worker` in a free child
    and returns its value; a function that raises there raises :class:`GeneratorError`.
    A call that takes longer than ``timeout`` (or a child that dies) kills that child
    (a new one starts on demand) and raises :class:`GeneratorError` too. Children are
    plain ``python -m`` processes, so the caller's ``__main__`` is never re-imported.
    """

    def __init__(self, hash_seed: int = 0, timeout: float = 60.0, processes: int = 1):
        self.hash_seed = hash_seed
        self.timeout = timeout
        self.processes = max(1, processes)
        self.restarts = 0
        self._idle: asyncio.Queue | None = None
        self._children: List[_Child] = []

    async def _spawn(self) -> _Child:
        # The child ends with this process, however it ends (_rg_worker arms the signal).
        env = dict(os.environ, PYTHONHASHSEED=str(self.hash_seed), **parent_pid_env())
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            _rg_worker.__name__,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            env=env,
        )
        child = _Child(proc)
        # The first request waits for reasoning-gym's import, which is not the call's time.
        try:
            await within(child.request("ping", ()), STARTUP_TIMEOUT_S)
        except BaseException:
            child.kill()
            raise
        self._children.append(child)
        return child

    async def call(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` in a child, at most ``timeout`` seconds."""
        if self._idle is None:
            self._idle = asyncio.Queue()
            for _ in range(self.processes):
                self._idle.put_nowait(None)  # a slot whose child starts on first use
        child = await self._idle.get()
        try:
            if child is not None and child.proc.returncode is not None:
                self._children.remove(child)  # died between calls
                child = None
            if child is None:
                child = await self._spawn()
            ok, value = await within(child.request(fn.__name__, args), self.timeout)
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, OSError) as err:
            if child is not None and child in self._children:
                logger.warning(
                    "reasoning-gym process %s in %s; restarting it", type(err).__name__, fn.__name__
                )
                child.kill()
                await child.proc.wait()
                self._children.remove(child)
                self.restarts += 1
            self._idle.put_nowait(None)
            raise GeneratorError(f"{fn.__name__}: the generator process {err!r}") from err
        except BaseException:
            if child is not None and child in self._children:
                child.kill()  # cancelled mid-request: the pipe is out of step
                self._children.remove(child)
            self._idle.put_nowait(None)
            raise
        self._idle.put_nowait(child)
        if not ok:
            raise GeneratorError(f"{fn.__name__}{args[:1]}: {value}")
        return value

    async def close(self) -> None:
        """Stop the children (they exit when their stdin closes)."""
        for child in self._children:
            if child.proc.stdin is not None:
                child.proc.stdin.close()
        for child in self._children:
            try:
                await within(child.proc.wait(), 5)
            except asyncio.TimeoutError:
                child.kill()
                await child.proc.wait()
        self._children.clear()
        self._idle = None


class ReasoningGymEnvConfig(BaseEnvConfig):
    """``BaseEnvConfig`` plus the reasoning-gym knobs."""

    tasks: str | List[str] | Dict[str, float] = Field(
        default=["leg_counting", "basic_arithmetic", "chain_sum"],
        description="Tasks to train on: 'all', names (list or comma-separated), or "
        "{name: weight} (items drawn in proportion to the weights).",
    )
    task_configs: Dict[str, Dict[str, Any]] = Field(
        default_factory=dict,
        description="Generator config per task, passed to reasoning_gym.create_dataset "
        "(e.g. {'chain_sum': {'min_terms': 2, 'max_terms': 3}}). composite takes "
        "{'datasets': [{'name', 'weight', 'config'}]}.",
    )
    order: Literal["weighted", "round_robin"] = Field(
        default="weighted",
        description="How the next item's task is chosen: at random by weight, or each task "
        "in turn.",
    )
    dataset_size: int = Field(
        default=100_000, ge=1, description="Items per task; training cycles through them."
    )
    seed: int = Field(default=0, description="Seed of the training datasets and task order.")
    eval_seeds: List[int] = Field(
        default=[1_000_000_007],
        description="Seeds of the held-out eval datasets (never equal to seed).",
    )
    eval_items_per_task: int = Field(
        default=16, ge=0, description="Eval items per task and eval seed."
    )
    answer_format: Literal["answer_tag", "boxed"] = Field(
        default="answer_tag",
        description="Where the answer is read from: <answer>...</answer> or \\boxed{...}.",
    )
    system_prompt: str | None = Field(
        default=None,
        description="System prompt; None = a short instruction matching answer_format.",
    )
    partial_credit: bool = Field(
        default=True,
        description="Keep the scorer's partial credit (0 < s < 1); false rounds every "
        "score below 1 down to 0.",
    )
    max_answer_tokens: int = Field(default=1024, ge=1, description="max_tokens of each rollout.")
    temperature: float = Field(default=1.0, ge=0, description="Sampling temperature of rollouts.")
    eval_temperature: float = Field(default=0.0, ge=0, description="Temperature of evaluation.")
    hash_seed: int = Field(
        default=0,
        ge=0,
        description="PYTHONHASHSEED of the generator process (some tasks depend on it).",
    )
    exclude_eval_questions: bool = Field(
        default=True,
        description="Skip training items whose question is also an eval item's (small "
        "problem spaces repeat questions across seeds), so eval stays held out.",
    )
    generator_processes: int = Field(
        default=1, ge=1, description="Processes generating and scoring items."
    )
    score_timeout_s: float = Field(
        default=60.0,
        gt=0,
        description="Longest a generation or scoring call may take; past it the item "
        "scores 0 and the generator process restarts.",
    )


class ReasoningGymEnv(BaseEnv):
    """Single-turn reasoning-gym questions scored by each task's own scorer."""

    name = "reasoning_gym"
    env_config_cls = ReasoningGymEnvConfig

    def __init__(
        self,
        config: ReasoningGymEnvConfig,
        server_configs: Any,
        slurm: bool = False,
        testing: bool = False,
    ):
        super().__init__(config, server_configs, slurm, testing)
        self.config: ReasoningGymEnvConfig = config
        self.iter = 0
        self.weights: Dict[str, float] = {}
        self.generator = GeneratorPool(
            config.hash_seed, config.score_timeout_s, config.generator_processes
        )
        self.scores_buffer: List[float] = []
        self.format_buffer: List[float] = []
        self.scorer_errors: Counter = Counter()
        self.eval_metrics: Dict[str, float] = {}
        self._eval_questions: Dict[str, set] = {}
        self.eval_overlap_skipped = 0

    @classmethod
    def config_init(cls) -> Tuple[ReasoningGymEnvConfig, List[APIServerConfig]]:
        return adapter_config_init(ReasoningGymEnvConfig, "reasoning_gym", max_token_length=2048)

    # --- items ------------------------------------------------------------------------

    async def setup(self) -> None:
        known = await self.generator.call(_rg_worker.task_names)
        self.weights = resolve_tasks(self.config.tasks, known)
        for task in self.config.task_configs:
            if task not in self.weights:
                logger.warning("env.task_configs: %r is not among the tasks; ignored", task)
        if self.config.seed in self.config.eval_seeds:
            raise ValueError(
                "env.eval_seeds must not contain env.seed (eval would not be held out)"
            )
        self.task_list = sorted(self.weights)
        logger.info("reasoning_gym: %d task(s): %s", len(self.task_list), ", ".join(self.task_list))

    def task_for(self, i: int) -> Tuple[str, int]:
        """``(task, index)`` of training item ``i``: a pure function of ``i`` and the config."""
        if self.config.order == "round_robin":
            return self.task_list[i % len(self.task_list)], i // len(self.task_list)
        rng = random.Random(task_seed(f"order:{i}", self.config.seed))
        task = rng.choices(self.task_list, weights=[self.weights[t] for t in self.task_list])[0]
        return task, rng.randrange(self.config.dataset_size)

    def _dataset_args(self, task: str, seed: int) -> Tuple[str, Dict[str, Any], int, int]:
        return (
            task,
            dict(self.config.task_configs.get(task, {})),
            task_seed(task, seed),
            self.config.dataset_size,
        )

    async def make_item(self, task: str, seed: int, index: int) -> Dict[str, Any]:
        """Item ``index`` of ``task``'s dataset for run seed ``seed``, generated in the child."""
        args = self._dataset_args(task, seed)
        entry = await self.generator.call(_rg_worker.generate_item, *args, index)
        return {"task": task, "seed": seed, "index": index, "entry": entry}

    async def eval_questions(self, task: str) -> set:
        """The questions of ``task``'s eval items (made once per task, on first use)."""
        if task not in self._eval_questions:
            items = await asyncio.gather(
                *(
                    self.make_item(task, seed, i)
                    for seed in self.config.eval_seeds
                    for i in range(self.config.eval_items_per_task)
                )
            )
            self._eval_questions[task] = {it["entry"]["question"] for it in items}
        return self._eval_questions[task]

    async def get_next_item(self) -> Dict[str, Any]:
        for _ in range(MAX_EVAL_OVERLAP_SKIPS):
            task, index = self.task_for(self.iter)
            self.iter += 1
            item = await self.make_item(task, self.config.seed, index)
            if not self.config.exclude_eval_questions:
                return item
            if item["entry"]["question"] not in await self.eval_questions(task):
                return item
            self.eval_overlap_skipped += 1
        raise RuntimeError(
            f"reasoning_gym: {MAX_EVAL_OVERLAP_SKIPS} training items in a row were eval "
            "questions; the task's problem space is too small for env.eval_items_per_task"
        )

    def save_checkpoint(self, step: int, data: Dict[str, Any] | None = None) -> None:
        super().save_checkpoint(step, {"iter": self.iter} if data is None else data)

    # --- rollouts and scores ------------------------------------------------------------

    def messages_for(self, item: Dict[str, Any]) -> List[Dict[str, str]]:
        """The chat prompt of an item."""
        prompt = self.config.system_prompt
        if prompt is None:
            prompt = TAG_PROMPT if self.config.answer_format == "answer_tag" else BOXED_PROMPT
        system = [{"role": "system", "content": prompt}] if prompt else []
        return system + [{"role": "user", "content": item["entry"]["question"]}]

    async def score_texts(self, item: Dict[str, Any], texts: Sequence[str]) -> List[float]:
        """Scores of the model replies ``texts`` to ``item`` (0 for no answer or a scorer error)."""
        task = item["task"]
        answers = [extract_answer(t, self.config.answer_format) for t in texts]
        try:
            results = await self.generator.call(
                _rg_worker.score_answers,
                *self._dataset_args(task, item["seed"]),
                answers,
                item["entry"],
            )
        except GeneratorError as err:
            logger.warning("reasoning_gym: scoring %s gave up: %s; scores 0", task, err)
            self.scorer_errors[task] += len(texts)
            return [0.0] * len(texts)
        scores = []
        for answer, (score, error) in zip(answers, results, strict=True):
            if error is not None:
                self.scorer_errors[task] += 1
                logger.info("reasoning_gym: %s scorer raised on %r: %s", task, answer, error)
            if not self.config.partial_credit and score < 1.0:
                score = 0.0
            scores.append(min(max(score, 0.0), 1.0))
        self.format_buffer.extend(float(a is not None) for a in answers)
        return scores

    async def collect_trajectories(
        self, item: Dict[str, Any]
    ) -> Tuple[ScoredDataGroup | None, List[Any]]:
        rollouts = await managed_chat_rollouts(
            self,
            self.messages_for(item),
            max_tokens=self.config.max_answer_tokens,
            temperature=self.config.temperature,
        )
        if not rollouts:
            return None, []
        scores = await self.score_texts(item, [r["text"] for r in rollouts])
        self.scores_buffer.extend(scores)
        return scored_group(rollouts, scores), []

    # --- evaluation and logging -------------------------------------------------------

    async def eval_items(self) -> List[Dict[str, Any]]:
        """Every held-out item: ``eval_items_per_task`` per task and eval seed."""
        # Concurrent, so generator_processes > 1 makes them in parallel.
        return list(
            await asyncio.gather(
                *(
                    self.make_item(task, seed, i)
                    for task in self.task_list
                    for seed in self.config.eval_seeds
                    for i in range(self.config.eval_items_per_task)
                )
            )
        )

    async def evaluate(self, *args: Any, **kwargs: Any) -> Dict[str, float]:
        cfg = self.config

        async def one(item: Dict[str, Any]) -> Dict[str, Any]:
            messages = self.messages_for(item)
            completion = await self.server.chat_completion(
                messages=messages,
                n=1,
                max_tokens=cfg.max_answer_tokens,
                temperature=cfg.eval_temperature,
                split="eval",
            )
            text = completion.choices[0].message.content or ""
            score = (await self.score_texts(item, [text]))[0]
            return {
                "messages": messages + [{"role": "assistant", "content": text}],
                "task": item["task"],
                "gold_answer": str(item["entry"]["answer"]),
                "model_answer": extract_answer(text, cfg.answer_format),
                "score": score,
                "correct": score >= 1.0,
            }

        def per_task(samples: List[Dict[str, Any]]) -> Dict[str, float]:
            return {
                "eval/mean_score": mean_of(samples, "score"),
                **means_by(samples, "task", {"accuracy": "correct", "mean_score": "score"}),
            }

        self.eval_metrics = await run_eval_set(
            self,
            await self.eval_items(),
            one,
            task_name="reasoning_gym_eval",
            extra_metrics=per_task,
            generation_parameters={
                "temperature": cfg.eval_temperature,
                "max_tokens": cfg.max_answer_tokens,
            },
        )
        return dict(self.eval_metrics)

    async def wandb_log(self, wandb_metrics: Dict[str, Any] | None = None) -> None:
        metrics = drain_metrics(
            wandb_metrics,
            self.eval_metrics,
            train={"train/mean_score": self.scores_buffer, "train/format_ok": self.format_buffer},
        )
        metrics["train/scorer_errors"] = float(sum(self.scorer_errors.values()))
        metrics["train/generator_restarts"] = float(self.generator.restarts)
        metrics["train/eval_overlap_skipped"] = float(self.eval_overlap_skipped)
        await super().wandb_log(metrics)

    async def close_servers(self) -> None:
        """Stop the generator process with the inference servers (end of process/evaluate)."""
        await self.generator.close()
        await super().close_servers()
