"""GSM8K: grade-school math word problems, answer in ``\\boxed{}``, scored by math-verify.

Rollouts go through ``ManagedServer`` so every sequence carries its tokens, loss mask
and the inference logprobs. A correct answer scores +1, anything else -1; when every
rollout of a group is correct, longer answers are penalised so the model learns to be
concise. Groups whose scores are all equal teach nothing and are dropped (except in
``process`` mode, which keeps everything for inspection).

Run::

    python environments/gsm8k_server.py serve --openai.server_type vllm \\
        --openai.base_url http://localhost:9001/v1
    python environments/gsm8k_server.py process --env.data_path my_gsm8k.jsonl \\
        --env.total_steps 8 --env.data_path_to_save_groups out/gsm8k.jsonl
"""

from __future__ import annotations

import logging
import random
from typing import Any, Dict, List, Tuple

from pydantic import Field

from atroposlib.envs.base import BaseEnv, BaseEnvConfig, EvalHandlingEnum, ScoredDataGroup
from atroposlib.envs.eval_helpers import drain_metrics, run_eval_set
from atroposlib.envs.reward_fns.math_answers import (
    answer_after_think,
    parse_gold,
    parse_prediction,
    verify_parsed,
)
from atroposlib.envs.rollout_helpers import managed_chat_rollouts
from atroposlib.envs.server_handling.server_baseline import APIServerConfig
from atroposlib.type_definitions import Item
from atroposlib.utils.dataset_loading import SkipCounter, load_rows

logger = logging.getLogger(__name__)

SYSTEM_PROMPT = (
    "You are a deep thinking AI, you may use extremely long chains of thought to deeply consider the "
    "problem and deliberate with yourself via systematic reasoning processes to help come to a correct "
    "solution prior to answering. You should enclose your thoughts and internal monologue inside "
    "<think> </think> tags, and then provide your solution or response to the problem.\n\n"
    "You are allocated a maximum of 2048 tokens, please strive to use less.\n\n"
    "You will then provide your answer like this: \\boxed{your answer here}\n"
    "It is important that you provide your answer in the correct format.\n"
    "If you do not, you will not receive credit for your answer.\n"
    "So please end your answer with \\boxed{your answer here}"
)
MIN_UNMASKED_TOKENS = 10
DEFAULT_MODEL = "NousResearch/DeepHermes-3-Llama-3-3B-Preview"


class GSM8kConfig(BaseEnvConfig):
    """GSM8K settings on top of :class:`BaseEnvConfig`."""

    dataset_name: str = Field(
        "gsm8k", description="Hugging Face dataset to load when no data_path is set."
    )
    dataset_config: str | None = Field(
        "main",
        description="Configuration of the Hugging Face dataset (None for a local dataset directory).",
    )
    data_path: str | None = Field(
        None,
        description="Local jsonl for training (rows with 'question' and 'answer' ending in '#### N'); "
        "overrides the Hugging Face dataset.",
    )
    eval_data_path: str | None = Field(
        None, description="Local jsonl for evaluation; defaults to data_path when that is set."
    )
    shuffle_seed: int = Field(42, description="Seed for shuffling the train and test splits.")
    train_temperature: float = Field(1.0, description="Sampling temperature of training rollouts.")
    eval_temperature: float = Field(0.6, description="Sampling temperature of evaluation.")
    max_eval_items: int = Field(-1, description="Evaluate at most this many test items (-1 = all).")


def gold_from_answer(answer: str) -> str:
    """The final answer of a GSM8K solution: text after the last ``#``, no commas."""
    return answer.split("#")[-1].strip().replace(",", "")


def length_penalty_scores(lengths: List[int], max_token_length: int) -> List[float]:
    """1.0 up to half of ``max_token_length``, then linearly down to 0.0 at the maximum."""
    threshold = max_token_length * 0.5
    scores = []
    for length in lengths:
        if length <= threshold:
            scores.append(1.0)
        else:
            fraction = min((length - threshold) / (max_token_length - threshold), 1.0)
            scores.append(1.0 - fraction)
    return scores


def score_response(text: str, gold_parsed: List[Any]) -> float:
    """+1.0 when the boxed answer after ``</think>`` verifies against the gold, else -1.0."""
    return 1.0 if verify_parsed(gold_parsed, parse_prediction(text)) else -1.0


class GSM8kEnv(BaseEnv):
    """GSM8K math with boxed answers (docs/design.md, "Bundled environments")."""

    name = "gsm8k"
    env_config_cls = GSM8kConfig

    def __init__(
        self, config: GSM8kConfig, server_configs: Any, slurm: bool = False, testing: bool = False
    ):
        super().__init__(config, server_configs, slurm, testing)
        self.config: GSM8kConfig = config
        self.iter = 0
        self.percent_correct_buffer: List[float] = []
        self.eval_metrics: Dict[str, float] = {}
        self.skips = SkipCounter(self.name)
        self.eval_skips = SkipCounter(f"{self.name} (eval)")
        self.train: List[Dict[str, str]] = []
        self.test: List[Dict[str, str]] = []

    @classmethod
    def config_init(cls) -> Tuple[GSM8kConfig, APIServerConfig]:
        env_config = GSM8kConfig(
            tokenizer_name=DEFAULT_MODEL,
            group_size=8,
            use_wandb=True,
            rollout_server_url="http://localhost:8000",
            total_steps=1000,
            batch_size=12,
            steps_per_eval=100,
            max_token_length=2048,
            wandb_name="gsm8k",
            eval_handling=EvalHandlingEnum.STOP_TRAIN,
        )
        server_config = APIServerConfig(
            model_name=DEFAULT_MODEL,
            base_url="http://localhost:9001/v1",
            api_key="x",
            num_requests_for_eval=256,
        )
        return env_config, server_config

    def _items(
        self, rows: List[Dict[str, Any]], skips: SkipCounter | None = None
    ) -> List[Dict[str, str]]:
        skips = skips or self.skips
        items = []
        for row in rows:
            if not skips.require(row, "question", "answer"):
                continue
            if not isinstance(row["question"], str) or not isinstance(row["answer"], str):
                skips.skip("non_text_fields", repr(row)[:120])
                continue
            if "#" not in row["answer"] or not gold_from_answer(row["answer"]):
                skips.skip("no_final_answer", row["answer"][-60:])
                continue
            items.append(
                {"question": row["question"], "gold_answer": gold_from_answer(row["answer"])}
            )
        return items

    async def setup(self) -> None:
        cfg = self.config
        eval_path = cfg.eval_data_path or cfg.data_path
        self.train = self._items(
            load_rows(
                cfg.dataset_name,
                cfg.dataset_config,
                "train",
                cfg.data_path,
                self.skips,
                cfg.shuffle_seed,
            )
        )
        self.test = self._items(
            load_rows(
                cfg.dataset_name,
                cfg.dataset_config,
                "test",
                eval_path,
                self.eval_skips,
                cfg.shuffle_seed,
            ),
            self.eval_skips,
        )
        if cfg.max_eval_items >= 0:
            self.test = self.test[: cfg.max_eval_items]
        if not self.train:
            raise ValueError(f"gsm8k: no usable training rows ({self.skips.summary()})")
        logger.info(
            "gsm8k: %d train, %d test items; %s",
            len(self.train),
            len(self.test),
            self.skips.summary(),
        )
        self.iter = 0

    def save_checkpoint(self, step: int, data: Dict[str, Any] | None = None) -> None:
        super().save_checkpoint(step, {"iter": self.iter} if data is None else data)

    async def get_next_item(self) -> Item:
        item = self.train[self.iter % len(self.train)]
        self.iter += 1
        return item

    async def collect_trajectories(self, item: Item) -> Tuple[ScoredDataGroup | None, List[Item]]:
        messages = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": item["question"]},
        ]
        rollouts = await managed_chat_rollouts(
            self, messages, temperature=self.config.train_temperature
        )
        return await self.score(rollouts, item["gold_answer"]), []

    async def score(
        self, rollouts: List[Dict[str, Any]], gold_answer: str
    ) -> ScoredDataGroup | None:
        """Score rollouts against the gold; None when the group should be dropped."""
        gold_parsed = parse_gold(gold_answer)
        if len(gold_parsed) == 0:
            self.skips.skip("gold_unparseable", gold_answer)
            return None
        random.shuffle(rollouts)
        group = ScoredDataGroup(tokens=[], masks=[], scores=[], inference_logprobs=[], messages=[])
        for rollout in rollouts:
            if sum(1 for m in rollout["masks"] if m != -100) < MIN_UNMASKED_TOKENS:
                continue
            reward = score_response(rollout["messages"][-1]["content"], gold_parsed)
            group["tokens"].append(rollout["tokens"])
            group["masks"].append(rollout["masks"])
            group["inference_logprobs"].append(rollout["logprobs"])
            group["messages"].append(rollout["messages"])
            group["scores"].append(reward)
            if len(group["tokens"]) >= self.config.group_size:
                break
        if not group["tokens"]:
            return None
        self.percent_correct_buffer.extend(max(s, 0.0) for s in group["scores"])
        if all(s == 1.0 for s in group["scores"]):
            group["scores"] = length_penalty_scores(
                [len(t) for t in group["tokens"]], self.config.max_token_length
            )
        if self.config.ensure_scores_are_not_same and len(set(group["scores"])) == 1:
            return None
        return group

    async def rollout_and_score_eval(self, item: Dict[str, str]) -> Dict[str, Any]:
        """One greedy-ish answer to a test question, scored like training."""
        messages = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": item["question"]},
        ]
        completion = await self.server.chat_completion(
            messages=messages,
            n=1,
            max_tokens=self.config.max_token_length,
            temperature=self.config.eval_temperature,
            split="eval",
        )
        choice = completion.choices[0]
        text = choice.message.content or ""
        gold_parsed = parse_gold(item["gold_answer"])
        model_parsed = parse_prediction(text)
        score = score_response(text, gold_parsed) if gold_parsed else -1.0
        return {
            "messages": messages + [{"role": "assistant", "content": text}],
            "question": item["question"],
            "gold_answer": item["gold_answer"],
            "gold_parsed": str(gold_parsed[0]) if gold_parsed else None,
            "model_parsed": str(model_parsed[0]) if model_parsed else None,
            "score": 1 if score > 0 else 0,
            "correct": score > 0,
            "finish_reason": choice.finish_reason,
            "response_after_think": answer_after_think(text),
        }

    async def evaluate(self, *args: Any, **kwargs: Any) -> None:
        self.eval_metrics = await run_eval_set(
            self,
            self.test,
            self.rollout_and_score_eval,
            generation_parameters={
                "temperature": self.config.eval_temperature,
                "max_tokens": self.config.max_token_length,
            },
        )

    async def wandb_log(self, wandb_metrics: Dict[str, Any] | None = None) -> None:
        train = {"train/percent_correct": self.percent_correct_buffer}
        metrics = drain_metrics(wandb_metrics, self.eval_metrics, train=train)
        await super().wandb_log({**metrics, **self.skips.metrics()})


if __name__ == "__main__":
    GSM8kEnv.cli()
