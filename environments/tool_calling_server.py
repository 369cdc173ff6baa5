"""Single-turn function calling, scored against the ground-truth calls.

The model sees tool signatures and a request and must answer with one or more
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Hermes/Qwen
format). The score is +1 when the calls equal the expected ones (same names and JSON
arguments, in any order) and -1 otherwise: wrong calls, malformed JSON, missing calls
or an empty reply. When no call is expected, a plain non-empty answer with no call
scores +1.

Data: ``NousResearch/hermes-function-calling-v1`` (``func_calling_singleturn``,
``conversations`` rows) by default, or a local jsonl of either that schema or
``{"query": str, "tools": [...], "expected_calls": [{"name", "arguments"}]}``.

Run::

    python environments/tool_calling_server.py process --env.data_path calls.jsonl \\
        --env.total_steps 8 --openai.server_type vllm --openai.base_url http://localhost:9001/v1
"""

from __future__ import annotations

import json
import logging
import re
from collections import Counter
from typing import Any, Dict, List, Tuple

from pydantic import Field

from atroposlib.envs.base import BaseEnv, BaseEnvConfig, ScoredDataGroup
from atroposlib.envs.eval_helpers import drain_metrics, run_eval_set
from atroposlib.envs.rollout_helpers import managed_chat_rollouts, scored_group
from atroposlib.envs.server_handling.server_baseline import APIServerConfig
from atroposlib.type_definitions import Item
from atroposlib.utils.dataset_loading import SkipCounter, load_rows

logger = logging.getLogger(__name__)

_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
TOOL_PROMPT = (
    "You are a function calling AI model. You are provided with function signatures within "
    "<tools></tools> XML tags. You may call one or more functions to assist with the user query. "
    "Don't make assumptions about what values to plug into functions.\n<tools>\n{tools}\n</tools>\n"
    "For each function call return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{{"name": <function-name>, "arguments": '
    "<args-dict>}}\n</tool_call>"
)


def _normalise(value: Any) -> Any:
    """Integral floats become ints (so 3 and 3.0 compare equal), recursively."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {k: _normalise(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_normalise(v) for v in value]
    return value


def parse_tool_calls(text: str) -> Tuple[List[Dict[str, Any]], int]:
    """``(calls, malformed)`` from the ``<tool_call>`` blocks after ``</think>``.

    A call is ``{"name": str, "arguments": dict}``; ``arguments`` may also be a JSON
    string. Blocks that are not valid JSON objects with a name, and unclosed
    ``<tool_call>`` tags, count as malformed.
    """
    tail = text.split("</think>")[-1]
    calls: List[Dict[str, Any]] = []
    malformed = tail.count("<tool_call>") - tail.count("</tool_call>")
    malformed = max(malformed, 0)
    for body in _TOOL_CALL.findall(tail):
        try:
            obj = json.loads(body.strip())
        except json.JSONDecodeError:
            malformed += 1
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
            malformed += 1
            continue
        arguments = obj.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError:
                malformed += 1
                continue
        if not isinstance(arguments, dict):
            malformed += 1
            continue
        calls.append({"name": obj["name"], "arguments": _normalise(arguments)})
    return calls, malformed


def canonical_call(call: Dict[str, Any]) -> str:
    """A call as sorted-key JSON, for order-insensitive comparison."""
    return json.dumps(
        {"name": call["name"], "arguments": _normalise(call.get("arguments") or {})}, sort_keys=True
    )


def score_tool_calls(text: str, expected: List[Dict[str, Any]]) -> float:
    """+1.0 when the calls in ``text`` equal ``expected`` (as a multiset), else -1.0."""
    calls, malformed = parse_tool_calls(text)
    if malformed:
        return -1.0
    if not expected:
        return 1.0 if not calls and text.split("</think>")[-1].strip() else -1.0
    same = Counter(canonical_call(c) for c in calls) == Counter(canonical_call(e) for e in expected)
    return 1.0 if same else -1.0


def item_from_row(row: Dict[str, Any]) -> Tuple[Dict[str, Any] | None, str]:
    """``(item, "")`` or ``(None, reason)`` for a row of either supported schema."""
    if "conversations" in row:
        turns = row.get("conversations")
        if not isinstance(turns, list):
            return None, "bad_conversations"
        by_role = {t.get("from"): t.get("value") for t in turns if isinstance(t, dict)}
        system, query, reply = by_role.get("system"), by_role.get("human"), by_role.get("gpt")
        if not isinstance(system, str) or not isinstance(query, str) or not isinstance(reply, str):
            return None, "missing_turns"
        expected, malformed = parse_tool_calls(reply)
        if malformed or not expected:
            return None, "unparsable_expected_calls"
        return {"system": system, "query": query, "expected": expected}, ""
    query = row.get("query") or row.get("question")
    tools = row.get("tools")
    expected = row.get("expected_calls", row.get("tool_calls"))
    if not isinstance(query, str) or not query.strip():
        return None, "missing_query"
    if not isinstance(tools, list) or not tools:
        return None, "missing_tools"
    if not isinstance(expected, list) or not all(
        isinstance(c, dict)
        and isinstance(c.get("name"), str)
        and isinstance(c.get("arguments", {}), dict)
        for c in expected
    ):
        return None, "bad_expected_calls"
    system = TOOL_PROMPT.format(tools="\n".join(json.dumps(t) for t in tools))
    return {
        "system": system,
        "query": query,
        "expected": [
            {"name": c["name"], "arguments": _normalise(c.get("arguments", {}))} for c in expected
        ],
    }, ""


class ToolCallingConfig(BaseEnvConfig):
    """Function-calling settings on top of :class:`BaseEnvConfig`."""

    dataset_name: str = Field(
        "NousResearch/hermes-function-calling-v1",
        description="Hugging Face dataset when no data_path is set.",
    )
    dataset_config: str | None = Field(
        "func_calling_singleturn", description="Dataset configuration."
    )
    data_path: str | None = Field(None, description="Local jsonl (either supported schema).")
    eval_data_path: str | None = Field(
        None, description="Local evaluation jsonl; else a held-out slice."
    )
    eval_holdout: int = Field(
        50, ge=0, description="Items held out for evaluation when no eval_data_path."
    )
    shuffle_seed: int = Field(42, description="Seed for shuffling the data.")
    eval_temperature: float = Field(0.0, description="Sampling temperature of evaluation.")


class SingleToolCallingEnv(BaseEnv):
    """Single-turn function calling."""

    name = "tool_calling"
    env_config_cls = ToolCallingConfig

    def __init__(
        self,
        config: ToolCallingConfig,
        server_configs: Any,
        slurm: bool = False,
        testing: bool = False,
    ):
        super().__init__(config, server_configs, slurm, testing)
        self.config: ToolCallingConfig = config
        self.iter = 0
        self.skips = SkipCounter(self.name)
        self.train: List[Dict[str, Any]] = []
        self.test: List[Dict[str, Any]] = []
        self.percent_correct_buffer: List[float] = []
        self.eval_metrics: Dict[str, float] = {}

    @classmethod
    def config_init(cls) -> Tuple[ToolCallingConfig, APIServerConfig]:
        model = "NousResearch/DeepHermes-3-Llama-3-3B-Preview"
        return (
            ToolCallingConfig(
                tokenizer_name=model,
                group_size=8,
                batch_size=16,
                max_token_length=2048,
                steps_per_eval=100,
                total_steps=1000,
                wandb_name="tool_calling",
            ),
            APIServerConfig(model_name=model, base_url="http://localhost:9001/v1", api_key="x"),
        )

    def _items(self, rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
        items = []
        for row in rows:
            item, reason = item_from_row(row)
            if item is None:
                self.skips.skip(reason, repr(row)[:120])
            else:
                items.append(item)
        return items

    async def setup(self) -> None:
        cfg = self.config
        items = self._items(
            load_rows(
                cfg.dataset_name,
                cfg.dataset_config,
                "train",
                cfg.data_path,
                self.skips,
                cfg.shuffle_seed,
            )
        )
        if cfg.eval_data_path:
            self.train, self.test = (
                items,
                self._items(load_rows(None, None, "test", cfg.eval_data_path, self.skips)),
            )
        else:
            holdout = min(cfg.eval_holdout, len(items) // 2)
            self.train, self.test = items[holdout:], items[:holdout]
        if not self.train:
            raise ValueError(f"tool_calling: no usable training rows ({self.skips.summary()})")
        logger.info(
            "tool_calling: %d train, %d test items; %s",
            len(self.train),
            len(self.test),
            self.skips.summary(),
        )

    def save_checkpoint(self, step: int, data: Dict[str, Any] | None = None) -> None:
        super().save_checkpoint(step, {"iter": self.iter} if data is None else data)

    async def get_next_item(self) -> Item:
        item = self.train[self.iter % len(self.train)]
        self.iter += 1
        return item

    @staticmethod
    def messages_for(item: Dict[str, Any]) -> List[Dict[str, str]]:
        """System prompt with the tools, then the request."""
        return [
            {"role": "system", "content": item["system"]},
            {"role": "user", "content": item["query"]},
        ]

    async def collect_trajectories(self, item: Item) -> Tuple[ScoredDataGroup | None, List[Item]]:
        rollouts = await managed_chat_rollouts(self, self.messages_for(item), temperature=1.0)
        scores = [score_tool_calls(r["text"], item["expected"]) for r in rollouts]
        self.percent_correct_buffer.extend(max(s, 0.0) for s in scores)
        if not rollouts or (self.config.ensure_scores_are_not_same and len(set(scores)) == 1):
            return None, []
        return scored_group(rollouts, scores), []

    async def evaluate(self, *args: Any, **kwargs: Any) -> None:
        async def one(item: Dict[str, Any]) -> Dict[str, Any]:
            out = await self.server.chat_completion(
                messages=self.messages_for(item),
                n=1,
                split="eval",
                max_tokens=self.config.max_token_length,
                temperature=self.config.eval_temperature,
            )
            text = out.choices[0].message.content or ""
            score = score_tool_calls(text, item["expected"])
            return {
                "messages": self.messages_for(item) + [{"role": "assistant", "content": text}],
                "gold_answer": item["expected"],
                "score": score,
                "correct": score > 0,
            }

        self.eval_metrics = await run_eval_set(
            self,
            self.test,
            one,
            generation_parameters={"temperature": self.config.eval_temperature},
        )

    async def wandb_log(self, wandb_metrics: Dict[str, Any] | None = None) -> None:
        train = {"train/percent_correct": self.percent_correct_buffer}
        metrics = drain_metrics(wandb_metrics, self.eval_metrics, train=train)
        await super().wandb_log({**metrics, **self.skips.metrics()})


if __name__ == "__main__":
    SingleToolCallingEnv.cli()
