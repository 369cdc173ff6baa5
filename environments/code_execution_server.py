"""Coding RL: the model writes Python that must pass a problem's tests, run in a real sandbox.

The original's coding environment (``CodingEnv``, ``CodeConfig``) scored code on Modal. Here
every program runs locally in the bubblewrap sandbox (:mod:`atroposlib.sandbox`: no
network, read-only host, private /tmp, CPU/memory/process/output bounds, a deadline that
kills the whole tree); ``--env.code_executor modal`` keeps the original's Modal path for
those who have it. Problems are ``func`` (a ``class Solution`` method called on JSON
arguments) or ``stdin_stdout`` (a program reading stdin); the default problem set is
generated offline (:mod:`code_execution_problems`), ``--env.data_path`` reads the same
fields from a jsonl, and ``--env.dataset_name normal|deepmind`` loads the original's
Hugging Face datasets.

Reward, as in the original: +1.0 when the last fenced code block passes every test, -1.0
otherwise (no code, a wrong answer, an error, a bound hit). A completion cut at the token
limit keeps its score but gets ``set_advantage_to_zero``. Each group's programs run
concurrently: sandboxed runs are asyncio subprocesses, so the event loop never blocks.
``evaluate`` samples ``eval_samples`` answers per held-out problem and reports pass@k
(``eval/pass_1``, ``eval/pass_at_<k>``) overall and by difficulty.

Run::

    python environments/code_execution_server.py process --env.total_steps 4 \\
        --env.data_path_to_save_groups out/coding.jsonl --openai.base_url http://127.0.0.1:9001/v1
    python environments/code_execution_server.py serve --openai.base_url http://localhost:9001/v1
"""

from __future__ import annotations

import asyncio
import collections
import logging
from typing import Any, Dict, List, Literal, Tuple

from pydantic import Field

from atroposlib.envs.base import BaseEnv, BaseEnvConfig, EvalHandlingEnum, ScoredDataGroup
from atroposlib.envs.eval import pass_at_k
from atroposlib.envs.eval_helpers import drain_metrics, run_eval_set
from atroposlib.envs.rollout_helpers import managed_chat_rollouts, scored_group
from atroposlib.envs.server_handling.server_baseline import APIServerConfig
from atroposlib.sandbox import Sandbox, SandboxConfig
from atroposlib.type_definitions import Item
from atroposlib.utils.dataset_loading import SkipCounter, load_rows

try:  # imported as environments.code_execution_server, or run as a script
    from environments.code_execution_problems import problem_set
    from environments.code_execution_scoring import (
        ModalExecutor,
        SandboxExecutor,
        TestReport,
        extract_python_code_blocks,
    )
except ImportError:  # pragma: no cover - python environments/code_execution_server.py
    from code_execution_problems import problem_set  # type: ignore[no-redef]
    from code_execution_scoring import (  # type: ignore[no-redef]
        ModalExecutor,
        SandboxExecutor,
        TestReport,
        extract_python_code_blocks,
    )

logger = logging.getLogger(__name__)

__all__ = ["CodeConfig", "CodingEnv", "get_prompt"]

FORMATTING_MESSAGE_WITH_STARTER_CODE = (
    "You will use the following starter code to write the solution to the "
    "problem and enclose your code within delimiters."
)
FORMATTING_WITHOUT_STARTER_CODE = (
    "Read the inputs from stdin, solve the problem, and write the answer to stdout "
    "(do not directly test on the sample inputs). Enclose your code within delimiters "
    "as follows. Ensure that when the python program runs it reads the inputs runs the "
    "algorithm and writes output to STDOUT."
)
DEFAULT_MODEL = "NousResearch/DeepHermes-3-Llama-3-8B-Preview"
HF_TRAIN = {"normal": "NousResearch/RL_Agentica_STDIN", "deepmind": "deepmind/code_contests"}
HF_TEST = "NousResearch/lcb_test"


def get_prompt(question: str, problem_type: str, starter_code: str | None = None) -> str:
    """The user message for a problem, worded as the original's (code in a fenced block)."""
    prompt = f"Question: {question}\n\n"
    if problem_type == "func":
        prompt += f"{FORMATTING_MESSAGE_WITH_STARTER_CODE}\n```python\n{starter_code}\n```\n\n"
    else:
        prompt += f"{FORMATTING_WITHOUT_STARTER_CODE}\n```python\n# YOUR CODE HERE\n```\n\n"
    return prompt + "### Answer: (use the provided format with backticks)\n\n"


class CodeConfig(BaseEnvConfig):
    """The original's ``CodeConfig`` fields, plus where code runs and how it is bounded."""

    dataset_name: str = Field(
        "builtin",
        description="Problems: 'builtin' (generated offline, see code_execution_problems.py), "
        "or the original's Hugging Face sets 'normal' (RL_Agentica_STDIN) and 'deepmind' "
        "(code_contests), evaluated on lcb_test.",
    )
    data_path: str | None = Field(
        None, description="Local jsonl of training problems (the builtin items' fields)."
    )
    eval_data_path: str | None = Field(
        None, description="Local jsonl of evaluation problems; default: the builtin held-out set."
    )
    max_test_cases_to_log: int | None = Field(
        None,
        description="Maximum number of test cases to include in logged output (for storage). "
        "All test cases are still evaluated.",
    )
    system_prompt: str | None = Field(
        None, description="Custom system prompt. If None, no system message is used."
    )
    temperature: float = Field(1.0, ge=0, description="Sampling temperature of rollouts.")
    eval_temperature: float = Field(0.6, ge=0, description="Sampling temperature of evaluation.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling of rollouts.")
    eval_top_p: float = Field(0.95, gt=0, le=1, description="Nucleus sampling of evaluation.")
    eval_samples: int = Field(
        16, ge=1, description="Answers sampled per evaluation problem (pass@k needs k of them)."
    )
    pass_at_k: List[int] = Field(
        default_factory=lambda: [1, 4, 16],
        description="k values of eval/pass_at_<k> (those above eval_samples are left out).",
    )
    max_eval_items: int = Field(-1, description="Evaluate at most this many problems (-1: all).")
    code_executor: Literal["sandbox", "modal"] = Field(
        "sandbox",
        description="Where code runs: 'sandbox' (local bubblewrap) or 'modal' (the original's "
        "deployed LiveCodeBench run_test function; needs the modal package and an account).",
    )
    modal_app: str = Field("test-lcb-code", description="Modal app of the run_test function.")
    modal_function: str = Field("run_test", description="Modal function that runs the tests.")
    test_timeout_s: float = Field(
        4.0, gt=0, description="Time limit of one test case in seconds (sandbox)."
    )
    sandbox_memory_mb: int = Field(
        1024, ge=64, description="Address space of each sandboxed process in MiB."
    )
    sandbox_max_processes: int = Field(
        16, ge=4, description="Processes and threads one sandboxed program may hold."
    )
    sandbox_python: str | None = Field(
        None,
        description="Interpreter the solutions run with; default: this Python when the sandbox "
        "user can read it, else /usr/bin/python3 (the standard library only).",
    )
    sandbox_ro_paths: List[str] = Field(
        default_factory=list,
        description="Host paths mounted read-only in the sandbox, e.g. a virtual environment "
        "whose packages (numpy...) solutions may import.",
    )
    max_concurrent_runs: int | None = Field(
        None, ge=1, description="Sandboxed programs running at once; default: twice the CPUs."
    )


class CodingEnv(BaseEnv):
    """Write Python that passes the tests; every program runs in the sandbox."""

    name = "coding_env"
    env_config_cls = CodeConfig

    def __init__(
        self, config: CodeConfig, server_configs: Any, slurm: bool = False, testing: bool = False
    ):
        super().__init__(config, server_configs, slurm, testing)
        self.config: CodeConfig = config
        self.iter = 0
        self.train: List[Dict[str, Any]] = []
        self.test: List[Dict[str, Any]] = []
        self.percent_correct_buffer: List[float] = []
        self.group_pass_buffer: List[float] = []
        self.end_reasons: collections.Counter[str] = collections.Counter()
        self.eval_metrics: Dict[str, float] = {}
        self.skips = SkipCounter("coding_env")
        self.executor: Any = None

    @classmethod
    def config_init(cls) -> Tuple[CodeConfig, List[APIServerConfig]]:
        env_config = CodeConfig(
            tokenizer_name=DEFAULT_MODEL,
            group_size=32,
            use_wandb=True,
            rollout_server_url="http://localhost:8000",
            total_steps=200,
            batch_size=-1,
            steps_per_eval=10,
            max_batches_offpolicy=3,
            max_eval_workers=12,
            eval_handling=EvalHandlingEnum.LIMIT_TRAIN,
            eval_limit_ratio=0.25,
            max_token_length=32768,
            min_items_sent_before_logging=1,
            wandb_name="coding_rl",
            max_test_cases_to_log=5,
        )
        server_configs = [
            APIServerConfig(
                model_name=DEFAULT_MODEL,
                base_url="http://localhost:9001/v1",
                api_key="x",
                num_requests_for_eval=256,
            )
        ]
        return env_config, server_configs

    # --- data -----------------------------------------------------------------------------

    def _items(self, rows: List[Dict[str, Any]], split: str) -> List[Dict[str, Any]]:
        items = []
        for row in rows:
            if self.config.dataset_name == "deepmind" and "description" in row:
                row = _from_code_contests(row)
            if not self.skips.require(row, "problem", "tests"):
                continue
            tests = row["tests"]
            if not isinstance(tests, dict) or len(tests.get("input", [])) != len(
                tests.get("output", [])
            ):
                self.skips.skip("tests_not_paired", repr(tests)[:120])
                continue
            item = dict(row)
            item.setdefault("problem_type", "func" if row.get("fn_name") else "stdin_stdout")
            item.setdefault("starter_code", "")
            item.setdefault("fn_name", "none")
            item["idx"], item["split"] = len(items), split
            items.append(item)
        return items

    async def setup(self) -> None:
        cfg = self.config
        builtin_train, builtin_test = problem_set()
        if cfg.data_path:
            train_rows = load_rows(None, None, "train", cfg.data_path, self.skips)
        elif cfg.dataset_name == "builtin":
            train_rows = builtin_train
        else:
            train_rows = load_rows(HF_TRAIN.get(cfg.dataset_name, cfg.dataset_name), None, "train")
        if cfg.eval_data_path:
            test_rows = load_rows(None, None, "test", cfg.eval_data_path, self.skips)
        elif cfg.dataset_name == "builtin" or cfg.data_path:
            test_rows = builtin_test
        else:
            test_rows = load_rows(HF_TEST, None, "test")
        self.train = self._items(train_rows, "train")
        self.test = self._items(test_rows, "test")
        if cfg.max_eval_items >= 0:
            self.test = self.test[: cfg.max_eval_items]
        if not self.train:
            raise ValueError(f"coding_env: no usable training problems ({self.skips.summary()})")
        # The sandbox's start-up check runs a trial sandbox: off the event loop.
        self.executor = await asyncio.to_thread(self._make_executor)
        logger.info("coding_env: %d train, %d test problems", len(self.train), len(self.test))

    def _make_executor(self) -> Any:
        cfg = self.config
        if cfg.code_executor == "modal":
            return ModalExecutor(cfg.modal_app, cfg.modal_function)
        # Raises SandboxUnavailable (naming the fix) here, at setup: never unsandboxed.
        sandbox = Sandbox(
            SandboxConfig(
                timeout_s=cfg.test_timeout_s,
                memory_mb=cfg.sandbox_memory_mb,
                max_processes=cfg.sandbox_max_processes,
                python=cfg.sandbox_python,
                ro_paths=cfg.sandbox_ro_paths,
                # Room for every test's stdout at once (the harness reports them together).
                max_output_bytes=8 << 20,
            ),
            max_concurrency=cfg.max_concurrent_runs,
        )
        return SandboxExecutor(sandbox, per_test_timeout_s=cfg.test_timeout_s)

    async def get_next_item(self) -> Item:
        item = self.train[self.iter % len(self.train)]
        self.iter += 1
        return item

    def save_checkpoint(self, step: int, data: Dict[str, Any] | None = None) -> None:
        super().save_checkpoint(step, {"iter": self.iter} if data is None else data)

    # --- rollouts and scoring -------------------------------------------------------------

    def messages_for(self, item: Dict[str, Any]) -> List[Dict[str, str]]:
        """The chat for ``item``: the optional system prompt, then the problem."""
        messages = []
        if self.config.system_prompt is not None:
            messages.append({"role": "system", "content": self.config.system_prompt})
        user = get_prompt(item["problem"], item["problem_type"], item.get("starter_code"))
        messages.append({"role": "user", "content": user})
        return messages

    def extract_python_code_blocks(self, text: str) -> List[str]:
        """Fenced code blocks of ``text`` (the original's method name)."""
        return extract_python_code_blocks(text)

    async def score_code(self, text: str, item: Dict[str, Any]) -> TestReport:
        """Run the last code block of ``text`` on ``item``'s tests."""
        blocks = extract_python_code_blocks(text)
        if not blocks:
            return TestReport([False], "No code found in response", "no_code")
        report = await self.executor.run(blocks[-1], item)
        self.end_reasons[report.reason] += 1
        return report

    async def collect_trajectories(self, item: Item) -> Tuple[ScoredDataGroup | None, List[Item]]:
        rollouts = await managed_chat_rollouts(
            self,
            self.messages_for(item),
            temperature=self.config.temperature,
            top_p=self.config.top_p,
        )
        return await self.score(rollouts, item), []

    async def score(
        self, rollouts: List[Dict[str, Any]], item: Dict[str, Any]
    ) -> ScoredDataGroup | None:
        """+1.0 / -1.0 per rollout, all of a group's programs run at once."""
        reports = await asyncio.gather(*(self.score_code(r["text"], item) for r in rollouts))
        scores = [1.0 if rep.all_passed else -1.0 for rep in reports]
        self.percent_correct_buffer.extend(1.0 if s > 0 else 0.0 for s in scores)
        self.group_pass_buffer.append(1.0 if any(s > 0 for s in scores) else 0.0)
        group = scored_group(rollouts, scores)
        group["overrides"] = [
            {"set_advantage_to_zero": r["finish_reason"] == "length"} for r in rollouts
        ]
        if self.config.ensure_scores_are_not_same and len(set(scores)) == 1:
            return None
        return group

    # --- evaluation -----------------------------------------------------------------------

    async def rollout_and_score_eval(self, item: Dict[str, Any]) -> Dict[str, Any]:
        """``eval_samples`` answers to one problem, each run on its tests; pass@k of them."""
        cfg = self.config
        messages = self.messages_for(item)
        completion = await self.server.chat_completion(
            messages=messages,
            n=cfg.eval_samples,
            max_tokens=cfg.max_token_length,
            temperature=cfg.eval_temperature,
            top_p=cfg.eval_top_p,
            split="eval",
        )
        texts = [choice.message.content or "" for choice in completion.choices]
        reports = await asyncio.gather(*(self.score_code(t, item) for t in texts))
        n, c = len(reports), sum(rep.all_passed for rep in reports)
        sample = {
            "problem_id": item["idx"],
            "messages": messages + [{"role": "assistant", "content": texts[0] if texts else ""}],
            "difficulty": item.get("difficulty", "unknown"),
            "problem_type": item["problem_type"],
            "scores": [1 if rep.all_passed else 0 for rep in reports],
            "details": [rep.detail for rep in reports],
            "tests": self._subset_test_cases_for_logging(item["tests"]),
            "completion_length": sum(map(len, texts)) / max(n, 1),
            "correct": c > 0,
            "score": pass_at_k(n, c, 1) if n else 0.0,
        }
        for k in cfg.pass_at_k:
            if 1 <= k <= n:
                sample[f"pass_at_{k}"] = pass_at_k(n, c, k)
        return sample

    def _subset_test_cases_for_logging(self, tests: Dict[str, Any]) -> Dict[str, Any]:
        limit = self.config.max_test_cases_to_log
        if limit is None:
            return tests
        pairs = sorted(
            zip(tests["input"], tests["output"], strict=False),
            key=lambda p: len(str(p[0])) + len(str(p[1])),
        )[:limit]
        return {
            "input": [p[0] for p in pairs],
            "output": [p[1] for p in pairs],
            "_original_count": len(tests["input"]),
        }

    async def evaluate(self, *args: Any, **kwargs: Any) -> None:
        def metrics(samples: List[Dict[str, Any]]) -> Dict[str, float]:
            out: Dict[str, float] = {}
            for k in self.config.pass_at_k:
                values = [s[f"pass_at_{k}"] for s in samples if f"pass_at_{k}" in s]
                if values:
                    out[f"eval/pass_at_{k}"] = sum(values) / len(values)
            for level in ("easy", "medium", "hard"):
                values = [s["score"] for s in samples if s["difficulty"] == level]
                out[f"eval/{level}_pass_1"] = sum(values) / len(values) if values else 0.0
            lengths = [s["completion_length"] for s in samples]
            out["eval/completion_length"] = sum(lengths) / len(lengths) if lengths else 0.0
            return out

        self.eval_metrics = await run_eval_set(
            self,
            self.test,
            self.rollout_and_score_eval,
            metric="eval/pass_1",
            value="score",
            extra_metrics=metrics,
            task_name="coding_eval",
            generation_parameters={
                "temperature": self.config.eval_temperature,
                "top_p": self.config.eval_top_p,
                "max_tokens": self.config.max_token_length,
                "n": self.config.eval_samples,
            },
        )

    async def wandb_log(self, wandb_metrics: Dict[str, Any] | None = None) -> None:
        train = {
            "train/percent_correct": self.percent_correct_buffer,
            "train/pass@group_size": self.group_pass_buffer,
        }
        metrics = drain_metrics(wandb_metrics, self.eval_metrics, train=train)
        for reason, count in self.end_reasons.items():
            metrics[f"train/runs_{reason}"] = float(count)
        self.end_reasons.clear()
        await super().wandb_log({**metrics, **self.skips.metrics()})


def _from_code_contests(row: Dict[str, Any]) -> Dict[str, Any]:
    """A deepmind/code_contests row in the items' shape (private and generated tests)."""
    private, generated = row.get("private_tests") or {}, row.get("generated_tests") or {}
    return {
        **row,
        "problem": row["description"],
        "problem_type": "stdin_stdout",
        "tests": {
            "input": list(private.get("input", [])) + list(generated.get("input", [])),
            "output": list(private.get("output", [])) + list(generated.get("output", [])),
        },
    }


if __name__ == "__main__":
    CodingEnv.cli()
