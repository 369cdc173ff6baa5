"""``DatasetEnv``: prompts and answers from any dataset, scored by configurable rewards.

Point it at a Hugging Face dataset (``dataset_name``) or a local jsonl (``data_path``),
name the prompt and answer fields, and choose reward functions from
:mod:`atroposlib.envs.reward_fns` by name or config dict. The rewards are combined
with :class:`~atroposlib.envs.reward_fns.CombinedReward`; each completion is passed as
the assistant text and the row's answer as ``solution``.

Example YAML (``--config environments/dataset_environment/configs/gsm8k.yaml``)::

    env:
      dataset_name: gsm8k
      dataset_config: main
      prompt_field: question
      answer_field: answer
      answer_after: "####"
      reward_functions:
        - {type: accuracy, weight: 1.0}
        - {type: format, weight: 0.2, params: {preferred_tags: [think]}}

Run::

    python environments/dataset_environment/dataset_env.py process \\
        --config environments/dataset_environment/configs/gsm8k.yaml --env.total_steps 8
"""

from __future__ import annotations

import logging
from typing import Any, Dict, List, Tuple, Union

from pydantic import Field, field_validator

from atroposlib.envs.base import BaseEnv, BaseEnvConfig, ScoredDataGroup
from atroposlib.envs.eval_helpers import drain_metrics, run_eval_set
from atroposlib.envs.reward_fns import CombinedReward, registry
from atroposlib.envs.rollout_helpers import managed_chat_rollouts, scored_group
from atroposlib.envs.server_handling.server_baseline import APIServerConfig
from atroposlib.type_definitions import Item
from atroposlib.utils.dataset_loading import SkipCounter, load_rows

logger = logging.getLogger(__name__)

RewardSpec = Union[str, Dict[str, Any]]


class DatasetEnvConfig(BaseEnvConfig):
    """Dataset, fields, prompt and rewards of a :class:`DatasetEnv`."""

    dataset_name: str | None = Field(
        None, description="Hugging Face dataset name (unless data_path is set)."
    )
    dataset_config: str | None = Field(None, description="Hugging Face dataset configuration.")
    split: str = Field("train", description="Split used for training.")
    eval_split: str | None = Field(
        None, description="Split used for evaluation; None = a held-out slice."
    )
    data_path: str | None = Field(
        None, description="Local training jsonl (wins over dataset_name)."
    )
    eval_data_path: str | None = Field(None, description="Local evaluation jsonl.")
    eval_holdout: int = Field(
        32, ge=0, description="Rows held out for evaluation when there is no eval split/file."
    )
    prompt_field: str = Field("prompt", description="Row field holding the prompt.")
    answer_field: str | None = Field(
        "answer", description="Row field holding the reference answer (or None)."
    )
    answer_after: str | None = Field(
        None,
        description="Keep only the text after the last occurrence of this "
        "marker in the answer (e.g. '####' for GSM8K).",
    )
    system_prompt: str | None = Field(
        None, description="System message placed before every prompt."
    )
    prompt_template: str = Field(
        "{prompt}", description="Format string for the user message; {prompt} is the field."
    )
    reward_functions: List[RewardSpec] = Field(
        default_factory=lambda: ["accuracy"],
        description="Rewards from atroposlib.envs.reward_fns: names or {type, weight, params} dicts.",
    )
    reward_normalization: str = Field(
        "none", description="How rewards are combined: none, sum or minmax."
    )
    temperature: float = Field(1.0, description="Sampling temperature of training rollouts.")
    eval_temperature: float = Field(0.0, description="Sampling temperature of evaluation.")
    shuffle_seed: int = Field(42, description="Seed for shuffling the rows.")

    @field_validator("reward_functions")
    @classmethod
    def _known_rewards(cls, value: List[RewardSpec]) -> List[RewardSpec]:
        if not value:
            raise ValueError("reward_functions needs at least one reward")
        for spec in value:
            name = spec if isinstance(spec, str) else (spec.get("type") or spec.get("name"))
            if not isinstance(name, str):
                raise ValueError(f"reward {spec!r} has no 'type'")
            try:
                registry.get(name)
            except KeyError as err:  # pydantic reports ValueErrors as validation errors
                raise ValueError(err.args[0]) from None
        return value

    @field_validator("prompt_template")
    @classmethod
    def _has_placeholder(cls, value: str) -> str:
        if "{prompt}" not in value:
            raise ValueError("prompt_template must contain {prompt}")
        return value


class DatasetEnv(BaseEnv):
    """Generic dataset environment with YAML-chosen rewards."""

    name = "dataset"
    env_config_cls = DatasetEnvConfig

    def __init__(
        self,
        config: DatasetEnvConfig,
        server_configs: Any,
        slurm: bool = False,
        testing: bool = False,
    ):
        super().__init__(config, server_configs, slurm, testing)
        self.config: DatasetEnvConfig = config
        self.iter = 0
        self.skips = SkipCounter(self.name)
        self.train: List[Dict[str, Any]] = []
        self.test: List[Dict[str, Any]] = []
        self.reward = CombinedReward(
            config.reward_functions, normalization=config.reward_normalization
        )
        self.score_buffer: List[float] = []
        self.eval_metrics: Dict[str, float] = {}

    @classmethod
    def config_init(cls) -> Tuple[DatasetEnvConfig, APIServerConfig]:
        model = "NousResearch/DeepHermes-3-Llama-3-3B-Preview"
        return (
            DatasetEnvConfig(
                tokenizer_name=model,
                group_size=8,
                batch_size=16,
                max_token_length=2048,
                steps_per_eval=100,
                total_steps=1000,
                wandb_name="dataset",
            ),
            APIServerConfig(model_name=model, base_url="http://localhost:9001/v1", api_key="x"),
        )

    def _items(self, rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
        cfg = self.config
        fields = [cfg.prompt_field] + ([cfg.answer_field] if cfg.answer_field else [])
        items = []
        for row in rows:
            if not self.skips.require(row, *fields):
                continue
            answer = row[cfg.answer_field] if cfg.answer_field else None
            if answer is not None and cfg.answer_after:
                answer = str(answer).split(cfg.answer_after)[-1].strip()
                if not answer:
                    self.skips.skip("empty_answer_after_marker")
                    continue
            items.append(
                {
                    "prompt": str(row[cfg.prompt_field]),
                    "answer": None if answer is None else str(answer),
                }
            )
        return items

    async def setup(self) -> None:
        cfg = self.config
        items = self._items(
            load_rows(
                cfg.dataset_name,
                cfg.dataset_config,
                cfg.split,
                cfg.data_path,
                self.skips,
                cfg.shuffle_seed,
            )
        )
        if cfg.eval_data_path or (cfg.eval_split and not cfg.data_path):
            self.train = items
            self.test = self._items(
                load_rows(
                    cfg.dataset_name,
                    cfg.dataset_config,
                    cfg.eval_split or "test",
                    cfg.eval_data_path,
                    self.skips,
                )
            )
        else:
            holdout = min(cfg.eval_holdout, len(items) // 2)
            self.test, self.train = items[:holdout], items[holdout:]
        if not self.train:
            raise ValueError(f"dataset env: no usable rows ({self.skips.summary()})")
        logger.info(
            "dataset env: %d train, %d test rows; %s",
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

    def messages_for(self, item: Dict[str, Any]) -> List[Dict[str, str]]:
        """Optional system prompt, then the templated user prompt."""
        messages = (
            [{"role": "system", "content": self.config.system_prompt}]
            if self.config.system_prompt
            else []
        )
        return messages + [
            {"role": "user", "content": self.config.prompt_template.format(prompt=item["prompt"])}
        ]

    def score(self, completions: List[str], answer: str | None) -> List[float]:
        """Combined reward of each completion against ``answer``."""
        kwargs = {"solution": answer} if answer is not None else {}
        return self.reward(completions, **kwargs)

    async def collect_trajectories(self, item: Item) -> Tuple[ScoredDataGroup | None, List[Item]]:
        rollouts = await managed_chat_rollouts(
            self, self.messages_for(item), temperature=self.config.temperature
        )
        scores = self.score([r["text"] for r in rollouts], item["answer"])
        self.score_buffer.extend(scores)
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
            return {
                "messages": self.messages_for(item) + [{"role": "assistant", "content": text}],
                "gold_answer": item["answer"],
                "score": self.score([text], item["answer"])[0],
            }

        self.eval_metrics = await run_eval_set(
            self,
            self.test,
            one,
            metric="eval/mean_score",
            value="score",
            generation_parameters={"temperature": self.config.eval_temperature},
        )

    async def wandb_log(self, wandb_metrics: Dict[str, Any] | None = None) -> None:
        train = {"train/mean_score": self.score_buffer}
        metrics = drain_metrics(wandb_metrics, self.eval_metrics, train=train)
        await super().wandb_log({**metrics, **self.skips.metrics()})


if __name__ == "__main__":
    DatasetEnv.cli()
