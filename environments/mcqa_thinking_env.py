"""Multiple-choice QA (MMLU-style): think, then answer with one letter.

Each item is a question with lettered choices; the model may reason inside
``<think></think>`` and must finish with ``\\boxed{X}`` (or "Answer: X"). The right
letter scores +1, a wrong, missing or ambiguous letter -1. Evaluation reports accuracy.

Data: Hugging Face ``cais/mmlu`` (``all``) by default, or a local jsonl in the same
schema: ``{"question": str, "choices": [str, ...], "answer": int | "B"}``.

Run::

    python environments/mcqa_thinking_env.py process --env.data_path mcqa.jsonl \\
        --env.total_steps 8 --openai.server_type vllm --openai.base_url http://localhost:9001/v1
"""

from __future__ import annotations

import logging
import re
import string
from typing import Any, Dict, List, Tuple

from pydantic import Field

from atroposlib.envs.base import BaseEnv, BaseEnvConfig, ScoredDataGroup
from atroposlib.envs.eval_helpers import drain_metrics, run_eval_set
from atroposlib.envs.rollout_helpers import managed_chat_rollouts, scored_group
from atroposlib.envs.server_handling.server_baseline import APIServerConfig
from atroposlib.type_definitions import Item
from atroposlib.utils.dataset_loading import SkipCounter, load_rows

logger = logging.getLogger(__name__)

LETTERS = string.ascii_uppercase
SYSTEM_PROMPT = (
    "You are a careful expert. Think about the question inside <think> </think> tags, then give "
    "the letter of the single best choice as \\boxed{X}."
)
_BOXED = re.compile(r"\\boxed\{\s*\(?([A-Za-z])\)?\s*\}")
_ANSWER_IS = re.compile(r"answer\s*(?:is|:)\s*\(?([A-Z])\)?(?![A-Za-z])", re.IGNORECASE)


class MCQAConfig(BaseEnvConfig):
    """Multiple-choice QA settings on top of :class:`BaseEnvConfig`."""

    dataset_name: str = Field(
        "cais/mmlu", description="Hugging Face dataset when no data_path is set."
    )
    dataset_config: str | None = Field(
        "all",
        description="Configuration of the Hugging Face dataset (None for a local dataset directory).",
    )
    train_split: str = Field("auxiliary_train", description="Split used for training items.")
    eval_split: str = Field("test", description="Split used for evaluation.")
    data_path: str | None = Field(
        None, description="Local training jsonl (question, choices, answer)."
    )
    eval_data_path: str | None = Field(
        None, description="Local evaluation jsonl; defaults to data_path."
    )
    shuffle_seed: int = Field(42, description="Seed for shuffling the data.")
    eval_temperature: float = Field(0.0, description="Sampling temperature of evaluation.")
    max_eval_items: int = Field(-1, description="Evaluate at most this many items (-1 = all).")


def format_question(question: str, choices: List[str]) -> str:
    """The question followed by ``A. ...`` lines."""
    lines = [question.strip(), ""]
    lines += [f"{LETTERS[i]}. {str(choice).strip()}" for i, choice in enumerate(choices)]
    return "\n".join(lines)


def answer_letter(answer: Any, n_choices: int) -> str | None:
    """The gold letter from an index (0-based) or a letter; None when out of range or malformed."""
    if isinstance(answer, bool):
        return None
    if isinstance(answer, int):
        return LETTERS[answer] if 0 <= answer < n_choices else None
    if isinstance(answer, str):
        text = answer.strip().upper()
        if text.isdigit():
            return answer_letter(int(text), n_choices)
        if len(text) == 1 and text in LETTERS[:n_choices]:
            return text
    return None


def extract_letter(text: str, n_choices: int) -> str | None:
    """The answered letter after ``</think>``: ``\\boxed{X}`` or "answer is X"; None when
    missing, out of range, or when different letters are given."""
    tail = text.split("</think>")[-1]
    found = [m.upper() for m in _BOXED.findall(tail)] or [
        m.upper() for m in _ANSWER_IS.findall(tail)
    ]
    valid = {letter for letter in found if letter in LETTERS[:n_choices]}
    if len(valid) != 1 or len(set(found)) != 1:
        return None
    return valid.pop()


def score_letter(text: str, gold: str, n_choices: int) -> float:
    """+1.0 for the gold letter, -1.0 otherwise (wrong, missing or ambiguous)."""
    return 1.0 if extract_letter(text, n_choices) == gold else -1.0


class MCQAThinkingEnv(BaseEnv):
    """Letter-answer multiple-choice QA with thinking."""

    name = "mcqa"
    env_config_cls = MCQAConfig

    def __init__(
        self, config: MCQAConfig, server_configs: Any, slurm: bool = False, testing: bool = False
    ):
        super().__init__(config, server_configs, slurm, testing)
        self.config: MCQAConfig = config
        self.iter = 0
        self.skips = SkipCounter(self.name)
        self.eval_skips = SkipCounter(f"{self.name} (eval)")
        self.train: List[Dict[str, Any]] = []
        self.test: List[Dict[str, Any]] = []
        self.percent_correct_buffer: List[float] = []
        self.eval_metrics: Dict[str, float] = {}

    @classmethod
    def config_init(cls) -> Tuple[MCQAConfig, APIServerConfig]:
        model = "NousResearch/DeepHermes-3-Llama-3-3B-Preview"
        return (
            MCQAConfig(
                tokenizer_name=model,
                group_size=8,
                batch_size=16,
                max_token_length=2048,
                steps_per_eval=100,
                total_steps=1000,
                wandb_name="mcqa",
            ),
            APIServerConfig(
                model_name=model,
                base_url="http://localhost:9001/v1",
                api_key="x",
                num_requests_for_eval=256,
            ),
        )

    def _items(
        self, rows: List[Dict[str, Any]], skips: SkipCounter | None = None
    ) -> List[Dict[str, Any]]:
        skips = skips or self.skips
        items = []
        for row in rows:
            if not skips.require(row, "question"):
                continue
            choices = row.get("choices")
            if not isinstance(choices, list) or not 2 <= len(choices) <= len(LETTERS):
                skips.skip("bad_choices", repr(choices)[:80])
                continue
            gold = answer_letter(row.get("answer"), len(choices))
            if gold is None:
                skips.skip("bad_answer", repr(row.get("answer")))
                continue
            items.append(
                {
                    "prompt": format_question(str(row["question"]), choices),
                    "gold": gold,
                    "n_choices": len(choices),
                }
            )
        return items

    async def setup(self) -> None:
        cfg = self.config
        self.train = self._items(
            load_rows(
                cfg.dataset_name,
                cfg.dataset_config,
                cfg.train_split,
                cfg.data_path,
                self.skips,
                cfg.shuffle_seed,
            )
        )
        self.test = self._items(
            load_rows(
                cfg.dataset_name,
                cfg.dataset_config,
                cfg.eval_split,
                cfg.eval_data_path or cfg.data_path,
                self.eval_skips,
                cfg.shuffle_seed,
            ),
            self.eval_skips,
        )
        if cfg.max_eval_items >= 0:
            self.test = self.test[: cfg.max_eval_items]
        if not self.train:
            raise ValueError(f"mcqa: no usable training rows ({self.skips.summary()})")
        logger.info(
            "mcqa: %d train, %d test items; %s",
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

    async def collect_trajectories(self, item: Item) -> Tuple[ScoredDataGroup | None, List[Item]]:
        messages = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": item["prompt"]},
        ]
        rollouts = await managed_chat_rollouts(self, messages, temperature=1.0)
        scores = [score_letter(r["text"], item["gold"], item["n_choices"]) for r in rollouts]
        self.percent_correct_buffer.extend(max(s, 0.0) for s in scores)
        if not rollouts or (self.config.ensure_scores_are_not_same and len(set(scores)) == 1):
            return None, []
        return scored_group(rollouts, scores), []

    async def evaluate(self, *args: Any, **kwargs: Any) -> None:
        async def one(item: Dict[str, Any]) -> Dict[str, Any]:
            messages = [
                {"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": item["prompt"]},
            ]
            out = await self.server.chat_completion(
                messages=messages,
                n=1,
                split="eval",
                max_tokens=self.config.max_token_length,
                temperature=self.config.eval_temperature,
            )
            text = out.choices[0].message.content or ""
            predicted = extract_letter(text, item["n_choices"])
            return {
                "messages": messages + [{"role": "assistant", "content": text}],
                "gold_answer": item["gold"],
                "model_answer": predicted,
                "correct": predicted == item["gold"],
                "score": 1 if predicted == item["gold"] else 0,
                "finish_reason": out.choices[0].finish_reason,
            }

        self.eval_metrics = await run_eval_set(
            self,
            self.test,
            one,
            metric="eval/accuracy",
            generation_parameters={"temperature": self.config.eval_temperature},
        )

    async def wandb_log(self, wandb_metrics: Dict[str, Any] | None = None) -> None:
        train = {"train/percent_correct": self.percent_correct_buffer}
        metrics = drain_metrics(wandb_metrics, self.eval_metrics, train=train)
        await super().wandb_log({**metrics, **self.skips.metrics()})


if __name__ == "__main__":
    MCQAThinkingEnv.cli()
