"""Arithmetic asked the way a chat model is asked: "17 + 15 =" -> exactly "32".

The task of :mod:`environments.arithmetic_server` (the same ``a + b`` problems and the same
fixed train / held-out split, so an eval score measures sums never trained on), posed in
plain words through the model's own chat template, for a pretrained instruct model such as
SmolLM2-135M-Instruct (``atropos-real-model``; ``example_trainer/configs/smollm2_cpu.yaml``).

Reward is 1.0 when the reply, up to its end of turn and without surrounding whitespace, is
the sum's digits and nothing else ("32"; not "32.", not "The answer is 32."), else 0.0. A
pretrained model already adds two-digit numbers often; what it lacks is the discipline to
answer with the number alone within a few tokens. That is learnable in tens of GRPO steps,
and every group holds right and wrong replies from the first step, so RL has a signal
without a supervised warm-up.

Run it like any environment::

    python environments/arithmetic_chat_server.py serve --openai.base_url http://127.0.0.1:9001/v1 \\
        --openai.model_name MODEL_DIR --env.tokenizer_name MODEL_DIR
"""

from __future__ import annotations

import random
import re
import sys
from pathlib import Path
from typing import Any, Dict, List, Sequence, Tuple

import httpx
from pydantic import Field

try:
    from environments.arithmetic_server import split_problems
except ModuleNotFoundError:  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from environments.arithmetic_server import split_problems

Problem = Tuple[int, int]

# Sums up to 40: two-digit sums a 135M model gets right often enough to have a signal.
MAX_OPERAND = 20
# 100 of the 441 pairs held out; the launcher's greedy eval scores all of them.
EVAL_SIZE = 100
EVAL_LIMIT = 100
END_TOKENS = ("<|im_end|>", "<|endoftext|>")
_DIGITS = re.compile(r"-?\d+")


SYSTEM_PROMPT = "Answer with just the number."
# One worked example: without it SmolLM2-135M-Instruct answers "The answer is 27." (and at
# temperature 0.7 never a bare number in 96 samples), so no group would hold a reward.
EXAMPLE = ({"role": "user", "content": "2 + 3 ="}, {"role": "assistant", "content": "5"})


def problem_messages(a: int, b: int) -> List[Dict[str, str]]:
    """The chat prompt for ``a + b``: the instruction, one worked example, the question."""
    return [
        {"role": "system", "content": SYSTEM_PROMPT},
        *EXAMPLE,
        {"role": "user", "content": f"{a} + {b} ="},
    ]


def reply_text(text: str) -> str:
    """A decoded completion up to its end token."""
    for end in END_TOKENS:
        text = text.split(end)[0]
    return text


def score_reply(text: str, a: int, b: int) -> float:
    """1.0 when the reply is exactly the digits of ``a + b`` (whitespace around ignored)."""
    reply = reply_text(text).strip()
    return 1.0 if _DIGITS.fullmatch(reply) is not None and int(reply) == a + b else 0.0


def prompt_ids(tokenizer: Any, a: int, b: int) -> List[int]:
    """Token ids of the chat prompt with the generation prompt appended."""
    return list(
        tokenizer.apply_chat_template(
            problem_messages(a, b), tokenize=True, add_generation_prompt=True, return_dict=False
        )
    )


def greedy_eval(
    base_url: str,
    tokenizer: Any,
    problems: Sequence[Problem] | None = None,
    max_tokens: int = 8,
    limit: int = EVAL_LIMIT,
    timeout: float = 600.0,
    chunk: int = 50,
    model: str | None = None,
) -> float:
    """Greedy exact-match accuracy on the first ``limit`` held-out problems (all with 0),
    through ``POST /v1/completions`` on the prompts' token ids, ``chunk`` prompts a request."""
    problems = list(problems or split_problems(MAX_OPERAND, EVAL_SIZE)[1])
    if limit > 0:
        problems = problems[:limit]
    root = base_url.rstrip("/").removesuffix("/v1")
    correct = 0.0
    with httpx.Client(timeout=timeout) as client:
        for start in range(0, len(problems), chunk):
            part = problems[start : start + chunk]
            body: Dict[str, Any] = {
                "prompt": [prompt_ids(tokenizer, a, b) for a, b in part],
                "max_tokens": max_tokens,
                "temperature": 0.0,
            }
            if model is not None:
                body["model"] = model
            resp = client.post(f"{root}/v1/completions", json=body)
            if resp.status_code != 200:
                raise RuntimeError(
                    f"eval request failed: HTTP {resp.status_code}: {resp.text[:300]}"
                )
            for choice in resp.json()["choices"]:
                a, b = part[int(choice["index"])]
                correct += score_reply(choice.get("text") or "", a, b)
    return correct / max(len(problems), 1)


_train, _held_out = split_problems(MAX_OPERAND, EVAL_SIZE)
# What greedy_eval scores by default; the launcher copies it into summary.json.
greedy_eval.eval_set = {  # type: ignore[attr-defined]
    "held_out": True,
    "size": min(EVAL_LIMIT, len(_held_out)),
    "train_size": len(_train),
    "max_operand": MAX_OPERAND,
    "prompt": "A + B = (one worked example before it)",
    "answer": "exactly the sum's digits",
}
del _train, _held_out


try:  # the env class needs atroposlib's BaseEnv; the pure helpers above do not
    from atroposlib.envs.base import BaseEnv, BaseEnvConfig, ScoredDataGroup
    from atroposlib.envs.server_handling.server_baseline import APIServerConfig
except ImportError:  # pragma: no cover - only without the library's env runtime
    BaseEnv = None  # type: ignore[assignment,misc]

if BaseEnv is not None:

    class ArithmeticChatEnvConfig(BaseEnvConfig):
        """``BaseEnvConfig`` plus the task's knobs."""

        max_operand: int = Field(default=MAX_OPERAND, ge=1, description="Largest operand of a + b.")
        eval_size: int = Field(
            default=EVAL_SIZE, ge=1, description="Problems held out (never trained on)."
        )
        max_answer_tokens: int = Field(
            default=8, ge=1, description="max_tokens of each rollout (a longer reply scores 0)."
        )
        temperature: float = Field(
            default=1.0, gt=0, description="Sampling temperature of rollouts."
        )
        seed: int = Field(default=0, description="Seed of the order of training problems.")

    class ArithmeticChatEnv(BaseEnv):
        """Single-turn "What is a + b?" with an exact-match reward on the reply."""

        name = "arithmetic_chat"
        env_config_cls = ArithmeticChatEnvConfig

        @classmethod
        def config_init(cls) -> Tuple[ArithmeticChatEnvConfig, List[APIServerConfig]]:
            env = ArithmeticChatEnvConfig(
                group_size=8,
                batch_size=-1,
                max_token_length=96,
                steps_per_eval=0,
                total_steps=1000,
                use_wandb=False,
                wandb_name="arithmetic_chat",
                max_batches_offpolicy=1,
                tokenizer_name="none",
            )
            server = APIServerConfig(
                model_name="default",
                base_url="http://localhost:9001/v1",
                api_key="x",
                server_type="vllm",
                num_requests_for_eval=64,
            )
            return env, [server]

        async def setup(self) -> None:
            self.rng = random.Random(self.config.seed)
            self.train_problems, _ = split_problems(self.config.max_operand, self.config.eval_size)
            self.percent_correct: List[float] = []

        async def get_next_item(self) -> Problem:
            return self.rng.choice(self.train_problems)

        async def collect_trajectories(
            self, item: Problem
        ) -> Tuple[ScoredDataGroup | None, List[Any]]:
            a, b = item
            ids = prompt_ids(self.tokenizer, a, b)
            _, outputs, logprobs, _ = await self.server.tokens_and_logprobs_completion(
                input_ids=ids,
                n=self.config.group_size,
                max_tokens=self.config.max_answer_tokens,
                temperature=self.config.temperature,
            )
            group = ScoredDataGroup(
                tokens=[], masks=[], scores=[], inference_logprobs=[], messages=[]
            )
            for out, lps in zip(outputs, logprobs, strict=False):
                text = self.tokenizer.decode(out, skip_special_tokens=False)
                score = score_reply(text, a, b)
                group["tokens"].append(ids + list(out))
                group["masks"].append([-100] * len(ids) + list(out))
                group["inference_logprobs"].append([1.0] * len(ids) + list(lps)[: len(out)])
                group["scores"].append(score)
                group["messages"].append(
                    problem_messages(a, b) + [{"role": "assistant", "content": reply_text(text)}]
                )
                self.percent_correct.append(score)
            return group, []

        async def evaluate(self, *args: Any, **kwargs: Any) -> None:
            # The launcher's greedy_eval scores the held-out set through the server.
            return None

        async def wandb_log(self, wandb_metrics: Dict[str, Any] | None = None) -> None:
            metrics = dict(wandb_metrics or {})
            if self.percent_correct:
                metrics["train/percent_correct"] = sum(self.percent_correct) / len(
                    self.percent_correct
                )
                self.percent_correct = []
            await super().wandb_log(metrics)


if __name__ == "__main__":
    if BaseEnv is None:
        raise SystemExit("atroposlib.envs.base is not available")
    ArithmeticChatEnv.cli()
