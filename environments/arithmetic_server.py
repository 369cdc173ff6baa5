"""Procedurally generated arithmetic: a verifiable task small enough to learn on a CPU.

Each item is ``a + b`` with operands in ``[0, max_operand]`` (default 99), written
at a fixed width (``"07+35="``); the model must answer with the sum alone, also at a
fixed width (``"042"``). Reward is 1.0 for the right number and 0.0 otherwise. The
fixed width puts every digit at the same place in every problem, so a tiny model
can learn the digit-wise rule (and carry) instead of memorising sums.

The problem space is split once, by a fixed seed, into a training set and a
held-out eval set (:func:`split_problems`: 200 of the 10,000 pairs). Rollouts and
the supervised warm-up only ever draw from the training set, so an eval score
measures generalisation to sums the model never saw. No dataset is downloaded:
the environment runs offline and the CPU demo (``atropos-grpo-run --config
example_trainer/configs/demo_cpu.yaml``) trains on it.

Rollouts use ``tokens_and_logprobs_completion`` on the prompt's token ids, so the
groups carry ``inference_logprobs`` (use ``--openai.server_type vllm`` with
``atropos-serve-model`` or vLLM).

Run it like any environment::

    python environments/arithmetic_server.py serve --openai.base_url http://127.0.0.1:9001/v1 \\
        --openai.model_name MODEL_DIR --env.tokenizer_name MODEL_DIR
"""

from __future__ import annotations

import functools
import random
import re
from typing import Any, Dict, List, Sequence, Tuple

import httpx
from pydantic import Field

_ANSWER_RE = re.compile(r"\s*(-?\d+)\s*")

Problem = Tuple[int, int]

MAX_OPERAND = 99
EVAL_SIZE = 200
SPLIT_SEED = 20240614


# --- the task, as pure functions ------------------------------------------------------------


def problem_messages(a: int, b: int, max_operand: int = MAX_OPERAND) -> List[Dict[str, str]]:
    """The chat prompt for ``a + b``, operands zero-padded to the width of ``max_operand``."""
    w = len(str(max_operand))
    return [{"role": "user", "content": f"{a:0{w}d}+{b:0{w}d}="}]


def answer_text(a: int, b: int, max_operand: int = MAX_OPERAND) -> str:
    """The expected completion: the sum zero-padded to the width of the largest sum."""
    return f"{a + b:0{len(str(2 * max_operand))}d}"


def completion_text(text: str) -> str:
    """A decoded completion up to its end token: what the model said."""
    for end in ("<|im_end|>", "<|endoftext|>"):
        text = text.split(end)[0]
    return text


def score_completion(text: str, a: int, b: int) -> float:
    """1.0 when ``text`` is exactly the sum (surrounding whitespace and end tokens ignored)."""
    m = _ANSWER_RE.fullmatch(completion_text(text))
    return 1.0 if m is not None and int(m.group(1)) == a + b else 0.0


def all_problems(max_operand: int = MAX_OPERAND) -> List[Problem]:
    """Every ``(a, b)`` pair."""
    return [(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1)]


def split_problems(
    max_operand: int = MAX_OPERAND, eval_size: int = EVAL_SIZE, seed: int = SPLIT_SEED
) -> Tuple[List[Problem], List[Problem]]:
    """``(train, held_out)``: every pair once, ``eval_size`` of them (at most half) held out.

    The split depends only on its arguments, so the trainer's environment, the
    warm-up and the launcher's eval agree on it without talking to each other.
    """
    train, held_out = _split(max_operand, eval_size, seed)
    return list(train), list(held_out)


@functools.lru_cache(maxsize=8)
def _split(
    max_operand: int, eval_size: int, seed: int
) -> Tuple[Tuple[Problem, ...], Tuple[Problem, ...]]:
    problems = all_problems(max_operand)
    random.Random(seed).shuffle(problems)
    k = min(eval_size, len(problems) // 2)
    return tuple(sorted(problems[k:])), tuple(sorted(problems[:k]))


def sample_problem(rng: random.Random, max_operand: int = MAX_OPERAND) -> Problem:
    """A random training problem (never one of the held-out eval set)."""
    return rng.choice(split_problems(max_operand)[0])


def sft_examples(
    n: int, seed: int = 0, max_operand: int = MAX_OPERAND
) -> List[Tuple[List[Dict[str, str]], str]]:
    """``n`` (prompt messages, answer) pairs from the training set, for the supervised warm-up."""
    rng = random.Random(seed)
    train, _ = split_problems(max_operand)
    return [
        (problem_messages(a, b, max_operand), answer_text(a, b, max_operand))
        for a, b in (rng.choice(train) for _ in range(n))
    ]


def prompt_ids(tokenizer: Any, a: int, b: int, max_operand: int = MAX_OPERAND) -> List[int]:
    """Token ids of the chat prompt with the generation prompt appended."""
    ids = tokenizer.apply_chat_template(
        problem_messages(a, b, max_operand),
        tokenize=True,
        add_generation_prompt=True,
        return_dict=False,
    )
    return list(ids)


def greedy_eval(
    base_url: str,
    tokenizer: Any,
    problems: Sequence[Problem] | None = None,
    temperature: float = 0.0,
    max_tokens: int = 4,
    samples: int = 1,
    timeout: float = 120.0,
    chunk: int = 128,
    seed: int = 1234,
    limit: int = 0,
    model: str | None = None,
) -> float:
    """Fraction of ``problems`` (default: the held-out eval set) answered correctly by the
    server at ``base_url`` (with or without ``/v1``).

    Sends the prompts' token ids in batched ``POST /v1/completions`` requests
    (``samples`` completions each, greedy by default), so the server decodes them
    together. ``limit`` > 0 evaluates only the first ``limit`` problems. ``model``: the
    model name to request (e.g. the LoRA adapter vLLM serves; default: the server's).
    """
    problems = list(problems or split_problems()[1])
    if limit > 0:
        problems = problems[:limit]
    root = base_url.rstrip("/").removesuffix("/v1")
    correct = 0.0
    with httpx.Client(timeout=timeout) as client:
        for start in range(0, len(problems), chunk):
            part = problems[start : start + chunk]
            body = {
                "prompt": [prompt_ids(tokenizer, a, b) for a, b in part],
                "n": samples,
                "max_tokens": max_tokens,
                "temperature": temperature,
                "seed": seed + start,
            }
            if model is not None:
                body["model"] = model
            resp = client.post(f"{root}/v1/completions", json=body)
            if resp.status_code != 200:
                raise RuntimeError(
                    f"eval request failed: HTTP {resp.status_code}: {resp.text[:300]}"
                )
            for choice in resp.json()["choices"]:
                a, b = part[int(choice["index"]) // samples]
                correct += score_completion(choice.get("text") or "", a, b)
    return correct / max(len(problems) * samples, 1)


_train, _held_out = split_problems()
# What greedy_eval scores by default; the launcher copies it into summary.json.
greedy_eval.eval_set = {  # type: ignore[attr-defined]
    "held_out": True,
    "size": len(_held_out),
    "train_size": len(_train),
    "max_operand": MAX_OPERAND,
    "split_seed": SPLIT_SEED,
}
del _train, _held_out


def local_greedy_eval(
    model: Any, tokenizer: Any, max_operand: int = MAX_OPERAND, max_tokens: int = 4
) -> float:
    """Greedy accuracy of an in-process HF ``model`` on a sample of the *training* set (at
    most 200 problems), for stopping the warm-up without ever looking at held-out problems."""
    import torch

    train, _ = split_problems(max_operand)
    problems = random.Random(0).sample(train, min(200, len(train)))
    prompts = [prompt_ids(tokenizer, a, b, max_operand) for a, b in problems]
    width = max(len(p) for p in prompts)
    pad = tokenizer.pad_token_id or 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    was_training = model.training
    model.eval()
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=pad,
            eos_token_id=tokenizer.eos_token_id,
        )
    if was_training:
        model.train()
    texts = [tokenizer.decode(row[width:], skip_special_tokens=False) for row in out]
    return sum(score_completion(t, a, b) for t, (a, b) in zip(texts, problems, strict=True)) / len(
        problems
    )


# --- the environment -----------------------------------------------------------------------

try:  # the env class needs atroposlib's BaseEnv; the pure helpers above do not
    from atroposlib.envs.base import BaseEnv, BaseEnvConfig, ScoredDataGroup
    from atroposlib.envs.eval_helpers import drain_metrics, run_eval_set
    from atroposlib.envs.server_handling.server_baseline import APIServerConfig
except ImportError:  # pragma: no cover - only without the library's env runtime
    BaseEnv = None  # type: ignore[assignment,misc]

if BaseEnv is not None:

    class ArithmeticEnvConfig(BaseEnvConfig):
        """``BaseEnvConfig`` plus the task's knobs."""

        max_operand: int = Field(default=MAX_OPERAND, ge=1, description="Largest operand of a + b.")
        eval_size: int = Field(
            default=EVAL_SIZE,
            ge=1,
            description="Problems held out for evaluation (at most half), never trained on.",
        )
        split_seed: int = Field(
            default=SPLIT_SEED, description="Seed of the train / held-out eval split."
        )
        max_answer_tokens: int = Field(default=4, ge=1, description="max_tokens of each rollout.")
        temperature: float = Field(
            default=1.0, gt=0, description="Sampling temperature of rollouts."
        )
        seed: int = Field(default=0, description="Seed of the order of training problems.")
        eval_temperature: float = Field(
            default=0.0, ge=0, description="Temperature of evaluation (0 = greedy)."
        )

    class ArithmeticEnv(BaseEnv):
        """Single-step ``a + b`` with an exact-match reward."""

        name = "arithmetic"
        env_config_cls = ArithmeticEnvConfig

        @classmethod
        def config_init(cls) -> Tuple[ArithmeticEnvConfig, List[APIServerConfig]]:
            env = ArithmeticEnvConfig(
                group_size=8,
                batch_size=-1,
                max_token_length=64,
                steps_per_eval=0,
                total_steps=1000,
                use_wandb=False,
                wandb_name="arithmetic",
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
            self.iter = 0
            self.train_problems, self.eval_problems = split_problems(
                self.config.max_operand, self.config.eval_size, self.config.split_seed
            )
            self.percent_correct: List[float] = []

        async def get_next_item(self) -> Problem:
            self.iter += 1
            return self.rng.choice(self.train_problems)

        async def collect_trajectories(
            self, item: Problem
        ) -> Tuple[ScoredDataGroup | None, List[Any]]:
            a, b = item
            ids = prompt_ids(self.tokenizer, a, b, self.config.max_operand)
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
                score = score_completion(text, a, b)
                group["tokens"].append(ids + list(out))
                group["masks"].append([-100] * len(ids) + list(out))
                group["inference_logprobs"].append([1.0] * len(ids) + list(lps)[: len(out)])
                group["scores"].append(score)
                # The conversation as text, so viewers and exports show "8+7=" and the
                # reply rather than the chat template rendered from the tokens.
                group["messages"].append(
                    problem_messages(a, b, self.config.max_operand)
                    + [{"role": "assistant", "content": completion_text(text)}]
                )
                self.percent_correct.append(score)
            return group, []

        async def evaluate(self, *args: Any, **kwargs: Any) -> Dict[str, float]:
            async def one(problem: Problem) -> Dict[str, Any]:
                a, b = problem
                _, outs, _, _ = await self.server.tokens_and_logprobs_completion(
                    input_ids=prompt_ids(self.tokenizer, a, b, self.config.max_operand),
                    n=1,
                    split="eval",
                    max_tokens=self.config.max_answer_tokens,
                    temperature=self.config.eval_temperature,
                )
                text = completion_text(self.tokenizer.decode(outs[0], skip_special_tokens=False))
                score = score_completion(text, a, b)
                return {
                    "messages": problem_messages(a, b, self.config.max_operand)
                    + [{"role": "assistant", "content": text}],
                    "score": score,
                    "correct": score > 0,
                }

            # All problems at once, so the inference server decodes them as one batch.
            return await run_eval_set(
                self,
                self.eval_problems,
                one,
                task_name="arithmetic_eval",
                concurrency=len(self.eval_problems),
                generation_parameters={
                    "temperature": self.config.eval_temperature,
                    "max_tokens": self.config.max_answer_tokens,
                },
            )

        async def wandb_log(self, wandb_metrics: Dict[str, Any] | None = None) -> None:
            metrics = drain_metrics(
                wandb_metrics, train={"train/percent_correct": self.percent_correct}
            )
            await super().wandb_log(metrics)

        def save_checkpoint(self, step: int, data: Dict[str, Any] | None = None) -> None:
            super().save_checkpoint(step, {"iter": self.iter} if data is None else data)


if __name__ == "__main__":
    if BaseEnv is None:
        raise SystemExit("atroposlib.envs.base is not available")
    ArithmeticEnv.cli()
