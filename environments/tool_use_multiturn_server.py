"""Multi-turn tool use: the model calls a calculator, reads the results, then answers.

Each task is an arithmetic question too long to do reliably in one's head. The model
may emit ``<tool_call>{"name": "calculator", "arguments": {"expression": "..."}}</tool_call>``;
the environment runs the tool and feeds the result back as a ``tool`` message, for up
to ``max_turns`` turns. A reply without a tool call is the final answer, given as
``\\boxed{N}``. Score: +1 for the right number, -1 otherwise, minus
``malformed_call_penalty`` per malformed call (clamped to [-1, 1]).

A whole conversation is one ``ManagedServer`` sequence: tool results are masked, the
model's turns are trained.

Data: generated from a seed (unlimited), or a local jsonl of ``{"question": str,
"answer": number}``.

Run::

    python environments/tool_use_multiturn_server.py process --env.total_steps 4 \\
        --openai.server_type vllm --openai.base_url http://localhost:9001/v1
"""

from __future__ import annotations

import ast
import asyncio
import json
import logging
import math
import operator
import random
import re
import sys
from pathlib import Path
from typing import Any, Awaitable, Callable, Dict, List, Tuple

from pydantic import Field

from atroposlib.envs.base import BaseEnv, BaseEnvConfig, ScoredDataGroup
from atroposlib.envs.eval_helpers import drain_metrics, mean_of, run_eval_set
from atroposlib.envs.server_handling.server_baseline import APIServerConfig
from atroposlib.type_definitions import Item
from atroposlib.utils.dataset_loading import SkipCounter, load_rows

try:
    from environments.tool_calling_server import TOOL_PROMPT, parse_tool_calls
except ModuleNotFoundError:  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from environments.tool_calling_server import TOOL_PROMPT, parse_tool_calls

logger = logging.getLogger(__name__)

CALCULATOR_TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression with + - * / ** and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}
SYSTEM_PROMPT = TOOL_PROMPT.format(tools=json.dumps(CALCULATOR_TOOL)) + (
    "\nUse the calculator for arithmetic. When you know the result, reply without a tool call and "
    "give the final answer as \\boxed{number}."
)
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def safe_eval(expression: str) -> float:
    """Evaluate ``+ - * / **`` arithmetic on numbers (nothing else).

    Raises:
        ValueError: on anything else, a huge power or a division by zero.
    """

    def walk(node: ast.AST) -> float:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, (int, float))
            and not isinstance(node.value, bool)
        ):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Pow) and (abs(right) > 64 or abs(left) > 1e6):
                raise ValueError("power too large")
            if isinstance(node.op, ast.Div) and right == 0:
                raise ValueError("division by zero")
            return _OPS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.operand))
        raise ValueError(f"unsupported expression element: {type(node).__name__}")

    if len(expression) > 200:
        raise ValueError("expression too long")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as err:
        raise ValueError(f"not an expression: {err.msg}") from err
    return walk(tree)


def run_tool(call: Dict[str, Any]) -> str:
    """The tool's answer as JSON text (errors are results too: the model must read them)."""
    if call["name"] != "calculator":
        return json.dumps({"error": f"unknown tool {call['name']!r}"})
    expression = call["arguments"].get("expression")
    if not isinstance(expression, str):
        return json.dumps({"error": "argument 'expression' (string) is required"})
    try:
        value = safe_eval(expression)
    except (ValueError, OverflowError, ArithmeticError) as err:
        return json.dumps({"error": str(err)})
    return json.dumps({"result": int(value) if float(value).is_integer() else round(value, 6)})


def final_number(text: str) -> float | None:
    """The number in the last ``\\boxed{}`` after ``</think>`` (commas allowed); None if absent."""
    found = _BOXED.findall(text.split("</think>")[-1])
    if not found:
        return None
    try:
        return float(found[-1].replace(",", "").strip())
    except ValueError:
        return None


def score_episode(
    final_text: str | None, answer: float, malformed_calls: int, penalty: float
) -> float:
    """+1/-1 for the final answer minus ``penalty`` per malformed call, in [-1, 1]."""
    value = final_number(final_text) if final_text is not None else None
    base = (
        1.0
        if value is not None and math.isclose(value, answer, rel_tol=1e-6, abs_tol=1e-6)
        else -1.0
    )
    return max(-1.0, min(1.0, base - penalty * malformed_calls))


def make_task(rng: random.Random) -> Dict[str, Any]:
    """A random three-operand question and its answer."""
    a, b, c = rng.randint(12, 999), rng.randint(12, 999), rng.randint(2, 99)
    op1, op2 = rng.choice(["+", "-", "*"]), rng.choice(["+", "-", "*"])
    expression = f"({a} {op1} {b}) {op2} {c}"
    return {"question": f"What is {expression}?", "answer": float(safe_eval(expression))}


ChatFn = Callable[[List[Dict[str, str]], int], Awaitable[str]]


async def run_episode(
    chat: ChatFn, question: str, max_turns: int, max_tokens_per_turn: int, max_calls_per_turn: int
) -> Dict[str, Any]:
    """Talk until the model answers without a tool call (or turns run out)."""
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]
    malformed = 0
    tool_calls = 0
    final_text: str | None = None
    for _ in range(max_turns):
        reply = await chat(messages, max_tokens_per_turn)
        messages.append({"role": "assistant", "content": reply})
        calls, bad = parse_tool_calls(reply)
        malformed += bad
        if not calls:
            final_text = reply
            break
        for call in calls[:max_calls_per_turn]:
            tool_calls += 1
            messages.append({"role": "tool", "content": run_tool(call)})
    return {
        "messages": messages,
        "final_text": final_text,
        "malformed_calls": malformed,
        "tool_calls": tool_calls,
    }


class MultiTurnToolUseConfig(BaseEnvConfig):
    """Multi-turn tool-use settings on top of :class:`BaseEnvConfig`."""

    data_path: str | None = Field(
        None, description="Local jsonl of {question, answer}; else generated tasks."
    )
    seed: int = Field(0, description="Seed of generated tasks.")
    max_turns: int = Field(4, ge=1, description="Model turns per episode.")
    max_tokens_per_turn: int = Field(256, ge=1, description="Generation budget of one turn.")
    max_calls_per_turn: int = Field(
        4, ge=1, description="Tool calls executed per turn (extra ones are ignored)."
    )
    malformed_call_penalty: float = Field(
        0.2, ge=0, description="Score subtracted per malformed tool call."
    )
    eval_episodes: int = Field(32, ge=0, description="Episodes run by evaluate().")
    eval_temperature: float = Field(0.0, description="Sampling temperature of evaluation.")


class MultiTurnToolUseEnv(BaseEnv):
    """Calculator tool use over several turns, one aligned sequence per episode."""

    name = "multiturn_tool_use"
    env_config_cls = MultiTurnToolUseConfig

    def __init__(
        self,
        config: MultiTurnToolUseConfig,
        server_configs: Any,
        slurm: bool = False,
        testing: bool = False,
    ):
        super().__init__(config, server_configs, slurm, testing)
        self.config: MultiTurnToolUseConfig = config
        self.iter = 0
        self.skips = SkipCounter(self.name)
        self.rows: List[Dict[str, Any]] = []
        self.percent_correct_buffer: List[float] = []
        self.eval_metrics: Dict[str, float] = {}

    @classmethod
    def config_init(cls) -> Tuple[MultiTurnToolUseConfig, APIServerConfig]:
        model = "NousResearch/DeepHermes-3-Llama-3-3B-Preview"
        return (
            MultiTurnToolUseConfig(
                tokenizer_name=model,
                group_size=8,
                batch_size=16,
                max_token_length=4096,
                steps_per_eval=100,
                total_steps=1000,
                wandb_name="multiturn_tool_use",
            ),
            APIServerConfig(model_name=model, base_url="http://localhost:9001/v1", api_key="x"),
        )

    async def setup(self) -> None:
        if self.config.data_path:
            for row in load_rows(None, data_path=self.config.data_path, skips=self.skips):
                if not self.skips.require(row, "question", "answer"):
                    continue
                try:
                    self.rows.append(
                        {"question": str(row["question"]), "answer": float(row["answer"])}
                    )
                except (TypeError, ValueError):
                    self.skips.skip("answer_not_a_number", repr(row["answer"]))
            if not self.rows:
                raise ValueError(f"multiturn_tool_use: no usable rows ({self.skips.summary()})")

    def save_checkpoint(self, step: int, data: Dict[str, Any] | None = None) -> None:
        super().save_checkpoint(step, {"iter": self.iter} if data is None else data)

    def task(self, index: int) -> Dict[str, Any]:
        """Task ``index``: a data row, or the generated task for ``seed + index``."""
        if self.rows:
            return self.rows[index % len(self.rows)]
        return make_task(random.Random(self.config.seed * 1_000_003 + index))

    async def get_next_item(self) -> Item:
        item = self.task(self.iter)
        self.iter += 1
        return item

    async def episode_tracked(self, item: Dict[str, Any]) -> Dict[str, Any] | None:
        cfg = self.config
        async with self.server.managed_server(tokenizer=self.tokenizer) as managed:

            async def chat(messages: List[Dict[str, str]], max_tokens: int) -> str:
                out = await managed.chat_completion(
                    messages=messages, n=1, max_tokens=max_tokens, temperature=1.0
                )
                return out.choices[0].message.content or ""

            episode = await run_episode(
                chat,
                item["question"],
                cfg.max_turns,
                cfg.max_tokens_per_turn,
                cfg.max_calls_per_turn,
            )
            nodes = managed.get_state()["nodes"]
        if not nodes:
            return None
        if len(nodes) > 1:
            logger.warning(
                "multiturn_tool_use: an episode produced %d sequences; keeping the longest",
                len(nodes),
            )
        node = max(nodes, key=lambda n: len(n.tokens))
        episode["score"] = score_episode(
            episode["final_text"],
            item["answer"],
            episode["malformed_calls"],
            cfg.malformed_call_penalty,
        )
        episode.update(
            tokens=list(node.tokens), masks=list(node.masked_tokens), logprobs=list(node.logprobs)
        )
        return episode

    async def collect_trajectories(self, item: Item) -> Tuple[ScoredDataGroup | None, List[Item]]:
        episodes = await asyncio.gather(
            *(self.episode_tracked(item) for _ in range(self.config.group_size))
        )
        group = ScoredDataGroup(tokens=[], masks=[], scores=[], inference_logprobs=[], messages=[])
        for episode in episodes:
            if episode is None:
                continue
            group["tokens"].append(episode["tokens"])
            group["masks"].append(episode["masks"])
            group["inference_logprobs"].append(episode["logprobs"])
            group["messages"].append(episode["messages"])
            group["scores"].append(episode["score"])
            self.percent_correct_buffer.append(1.0 if episode["score"] > 0 else 0.0)
        if not group["tokens"] or (
            self.config.ensure_scores_are_not_same and len(set(group["scores"])) == 1
        ):
            return None, []
        return group, []

    async def evaluate(self, *args: Any, **kwargs: Any) -> None:
        cfg = self.config

        async def chat(messages: List[Dict[str, str]], max_tokens: int) -> str:
            out = await self.server.chat_completion(
                messages=messages,
                n=1,
                max_tokens=max_tokens,
                temperature=cfg.eval_temperature,
                split="eval",
            )
            return out.choices[0].message.content or ""

        async def one(index: int) -> Dict[str, Any]:
            item = self.task(10_000_000 + index) if not self.rows else self.task(index)
            episode = await run_episode(
                chat,
                item["question"],
                cfg.max_turns,
                cfg.max_tokens_per_turn,
                cfg.max_calls_per_turn,
            )
            score = score_episode(
                episode["final_text"],
                item["answer"],
                episode["malformed_calls"],
                cfg.malformed_call_penalty,
            )
            return {
                "messages": episode["messages"],
                "gold_answer": item["answer"],
                "score": score,
                "correct": score > 0,
                "tool_calls": episode["tool_calls"],
            }

        n_eval = cfg.eval_episodes if not self.rows else min(cfg.eval_episodes, len(self.rows))
        self.eval_metrics = await run_eval_set(
            self,
            range(n_eval),
            one,
            failed_metric="eval/failed_episodes",
            extra_metrics=lambda samples: {"eval/mean_tool_calls": mean_of(samples, "tool_calls")},
            generation_parameters={
                "temperature": cfg.eval_temperature,
                "max_tokens": cfg.max_tokens_per_turn,
            },
        )

    async def wandb_log(self, wandb_metrics: Dict[str, Any] | None = None) -> None:
        train = {"train/percent_correct": self.percent_correct_buffer}
        metrics = drain_metrics(wandb_metrics, self.eval_metrics, train=train)
        await super().wandb_log({**metrics, **self.skips.metrics()})


if __name__ == "__main__":
    MultiTurnToolUseEnv.cli()
