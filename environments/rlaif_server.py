"""RLAIF: a judge model compares pairs of answers; its preferences become the scores.

The policy answers a chat prompt ``group_size`` times. Answers are compared in pairs
(a ring: 0-1, 1-2, ..., n-1-0; one pair for groups of two), in random A/B order to
cancel position bias, by a judge that replies ``[[A]]``, ``[[B]]`` or ``[[tie]]``. An
answer's score is (wins - losses) / comparisons, in [-1, 1]. An unreadable verdict
counts as a tie (and is counted).

The judge is any OpenAI-compatible server (``judge_base_url``, ``judge_model_name``);
without one, the policy's own servers judge (handy offline, useless for training).
``judge_criterion`` says what "better" means — the personality you are shaping.

Data: ``allenai/WildChat`` (first user turn) by default, or a local jsonl of
``{"prompt": str}`` rows.

Run::

    python environments/rlaif_server.py serve --openai.server_type vllm \\
        --openai.base_url http://localhost:9001/v1 --env.judge_base_url https://api.openai.com/v1 \\
        --env.judge_model_name gpt-4o-mini
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import re
from typing import Any, Dict, List, Tuple

from pydantic import Field

from atroposlib.envs.base import BaseEnv, BaseEnvConfig, ScoredDataGroup
from atroposlib.envs.eval_helpers import drain_metrics, run_eval_set
from atroposlib.envs.server_handling.server_baseline import APIServerConfig
from atroposlib.type_definitions import Item
from atroposlib.utils.dataset_loading import SkipCounter, load_rows
from atroposlib.utils.message_history_utils import strip_thinking

logger = logging.getLogger(__name__)

JUDGE_TEMPLATE = (
    "You are judging two assistant responses to the same user message.\n"
    "Criterion: {criterion}\n\n"
    "[User message]\n{prompt}\n\n[Response A]\n{a}\n\n[Response B]\n{b}\n\n"
    "Think briefly, then end your reply with exactly one verdict: [[A]] if A is better, "
    "[[B]] if B is better, or [[tie]]."
)
EVAL_TEMPLATE = (
    "Rate the assistant response to the user message on a 1-10 scale.\nCriterion: {criterion}\n\n"
    "[User message]\n{prompt}\n\n[Response]\n{answer}\n\nEnd your reply with 'Rating: N'."
)
_VERDICT = re.compile(r"\[\[\s*(A|B|tie)\s*\]\]", re.IGNORECASE)
_RATING = re.compile(r"rating\s*:\s*(10|[1-9])\b", re.IGNORECASE)


def parse_verdict(text: str) -> str | None:
    """``"A"``, ``"B"`` or ``"tie"`` from the judge's last verdict; None when there is none."""
    found = _VERDICT.findall(text or "")
    if not found:
        bare = (text or "").strip().upper()
        return bare if bare in ("A", "B") else None
    last = found[-1]
    return "tie" if last.lower() == "tie" else last.upper()


def parse_rating(text: str) -> int | None:
    """The ``Rating: N`` (1-10) at the end of a judge reply; None when missing."""
    found = _RATING.findall(text or "")
    return int(found[-1]) if found else None


def comparison_pairs(n: int) -> List[Tuple[int, int]]:
    """Ring pairs over ``n`` answers (one pair when n == 2, none when n < 2)."""
    if n < 2:
        return []
    if n == 2:
        return [(0, 1)]
    return [(i, (i + 1) % n) for i in range(n)]


def preference_scores(n: int, outcomes: List[Tuple[int, int, int | None]]) -> List[float]:
    """Scores from ``(i, j, winner)`` outcomes (winner i, j, or None for a tie):
    ``(wins - losses) / comparisons`` per answer, 0.0 for an answer never compared."""
    net = [0.0] * n
    seen = [0] * n
    for i, j, winner in outcomes:
        seen[i] += 1
        seen[j] += 1
        if winner == i:
            net[i] += 1
            net[j] -= 1
        elif winner == j:
            net[j] += 1
            net[i] -= 1
    return [net[k] / seen[k] if seen[k] else 0.0 for k in range(n)]


def prompt_from_row(row: Dict[str, Any]) -> str | None:
    """The user prompt of a ``{"prompt"}`` row or a WildChat ``conversation`` row."""
    if isinstance(row.get("prompt"), str) and row["prompt"].strip():
        return row["prompt"]
    conversation = row.get("conversation")
    if isinstance(conversation, list):
        for turn in conversation:
            if (
                isinstance(turn, dict)
                and turn.get("role") == "user"
                and isinstance(turn.get("content"), str)
            ):
                return turn["content"] if turn["content"].strip() else None
    return None


class RLAIFConfig(BaseEnvConfig):
    """RLAIF settings on top of :class:`BaseEnvConfig`."""

    dataset_name: str = Field(
        "allenai/WildChat", description="Hugging Face dataset when no data_path is set."
    )
    data_path: str | None = Field(None, description="Local jsonl of {prompt} (or WildChat) rows.")
    shuffle_seed: int = Field(42, description="Seed for shuffling prompts and A/B order.")
    eval_holdout: int = Field(16, ge=0, description="Prompts held out for evaluation.")
    judge_criterion: str = Field(
        "Which response is more helpful, honest and warm, while staying concise?",
        description="What the judge prefers: the behaviour being shaped.",
    )
    judge_base_url: str | None = Field(
        None, description="OpenAI-compatible judge URL; None = the policy servers."
    )
    judge_model_name: str = Field("default", description="Judge model name.")
    judge_api_key: str | None = Field(
        None, description="Judge API key (default: env OPENAI_API_KEY, else 'x')."
    )
    judge_max_tokens: int = Field(512, ge=1, description="Judge reply budget.")
    judge_temperature: float = Field(0.0, description="Judge sampling temperature.")
    max_prompt_chars: int = Field(4000, ge=1, description="Prompts longer than this are skipped.")


class RLAIFEnv(BaseEnv):
    """Pairwise AI-feedback preferences as rewards."""

    name = "rlaif"
    env_config_cls = RLAIFConfig

    def __init__(
        self, config: RLAIFConfig, server_configs: Any, slurm: bool = False, testing: bool = False
    ):
        super().__init__(config, server_configs, slurm, testing)
        self.config: RLAIFConfig = config
        self.iter = 0
        self.skips = SkipCounter(self.name)
        self.rng = random.Random(config.shuffle_seed)
        self.train: List[str] = []
        self.test: List[str] = []
        self.judge: Any = None
        self.unparsed_verdicts = 0
        self.eval_metrics: Dict[str, float] = {}

    @classmethod
    def config_init(cls) -> Tuple[RLAIFConfig, APIServerConfig]:
        model = "NousResearch/DeepHermes-3-Llama-3-3B-Preview"
        return (
            RLAIFConfig(
                tokenizer_name=model,
                group_size=4,
                batch_size=16,
                max_token_length=2048,
                steps_per_eval=100,
                total_steps=1000,
                wandb_name="rlaif",
            ),
            APIServerConfig(model_name=model, base_url="http://localhost:9001/v1", api_key="x"),
        )

    async def setup(self) -> None:
        cfg = self.config
        prompts = []
        for row in load_rows(
            cfg.dataset_name, None, "train", cfg.data_path, self.skips, cfg.shuffle_seed
        ):
            prompt = prompt_from_row(row)
            if prompt is None:
                self.skips.skip("missing_prompt", repr(row)[:120])
            elif len(prompt) > cfg.max_prompt_chars:
                self.skips.skip("prompt_too_long", f"{len(prompt)} chars")
            else:
                prompts.append(prompt)
        holdout = min(cfg.eval_holdout, len(prompts) // 2)
        self.test, self.train = prompts[:holdout], prompts[holdout:]
        if not self.train:
            raise ValueError(f"rlaif: no usable prompts ({self.skips.summary()})")
        if cfg.judge_base_url:
            from atroposlib.envs.server_handling.server_manager import ServerManager

            api_key = cfg.judge_api_key or os.environ.get("OPENAI_API_KEY") or "x"
            self.judge = ServerManager(
                [
                    APIServerConfig(
                        base_url=cfg.judge_base_url,
                        model_name=cfg.judge_model_name,
                        api_key=api_key,
                        server_type="openai",
                    )
                ]
            )
        else:
            logger.warning("rlaif: no judge_base_url; the policy servers judge their own answers")
            self.judge = self.server
        logger.info(
            "rlaif: %d train, %d eval prompts; %s",
            len(self.train),
            len(self.test),
            self.skips.summary(),
        )

    def save_checkpoint(self, step: int, data: Dict[str, Any] | None = None) -> None:
        super().save_checkpoint(step, {"iter": self.iter} if data is None else data)

    async def get_next_item(self) -> Item:
        prompt = self.train[self.iter % len(self.train)]
        self.iter += 1
        return {"prompt": prompt}

    async def ask_judge(self, prompt: str, first: str, second: str) -> str | None:
        """The judge's verdict ("A", "B", "tie") on ``first`` (A) vs ``second`` (B)."""
        content = JUDGE_TEMPLATE.format(
            criterion=self.config.judge_criterion,
            prompt=prompt,
            a=strip_thinking(first),
            b=strip_thinking(second),
        )
        out = await self.judge.chat_completion(
            messages=[{"role": "user", "content": content}],
            n=1,
            max_tokens=self.config.judge_max_tokens,
            temperature=self.config.judge_temperature,
        )
        verdict = parse_verdict(out.choices[0].message.content or "")
        if verdict is None:
            self.unparsed_verdicts += 1
        return verdict

    async def judge_group(self, prompt: str, answers: List[str]) -> List[float]:
        """Pairwise preference scores for ``answers``."""

        async def compare(i: int, j: int) -> Tuple[int, int, int | None]:
            swap = self.rng.random() < 0.5
            a, b = (j, i) if swap else (i, j)
            verdict = await self.ask_judge(prompt, answers[a], answers[b])
            winner = a if verdict == "A" else b if verdict == "B" else None
            return i, j, winner

        outcomes = await asyncio.gather(*(compare(i, j) for i, j in comparison_pairs(len(answers))))
        return preference_scores(len(answers), list(outcomes))

    async def collect_trajectories(self, item: Item) -> Tuple[ScoredDataGroup | None, List[Item]]:
        messages = [{"role": "user", "content": item["prompt"]}]
        async with self.server.managed_server(tokenizer=self.tokenizer) as managed:
            completion = await managed.chat_completion(
                messages=messages,
                n=self.config.group_size,
                max_tokens=self.config.max_token_length,
                temperature=1.0,
            )
            nodes = managed.get_state()["nodes"]
        answers = [choice.message.content or "" for choice in completion.choices][: len(nodes)]
        scores = await self.judge_group(item["prompt"], answers)
        group = ScoredDataGroup(
            tokens=[list(n.tokens) for n in nodes[: len(answers)]],
            masks=[list(n.masked_tokens) for n in nodes[: len(answers)]],
            inference_logprobs=[list(n.logprobs) for n in nodes[: len(answers)]],
            messages=[messages + [{"role": "assistant", "content": a}] for a in answers],
            scores=scores,
        )
        if not group["tokens"] or (
            self.config.ensure_scores_are_not_same and len(set(scores)) == 1
        ):
            return None, []
        return group, []

    async def evaluate(self, *args: Any, **kwargs: Any) -> None:
        async def one(prompt: str) -> Dict[str, Any]:
            out = await self.server.chat_completion(
                messages=[{"role": "user", "content": prompt}],
                n=1,
                max_tokens=self.config.max_token_length,
                temperature=0.0,
                split="eval",
            )
            answer = out.choices[0].message.content or ""
            rating_prompt = EVAL_TEMPLATE.format(
                criterion=self.config.judge_criterion, prompt=prompt, answer=strip_thinking(answer)
            )
            judged = await self.judge.chat_completion(
                messages=[{"role": "user", "content": rating_prompt}],
                n=1,
                max_tokens=self.config.judge_max_tokens,
                temperature=self.config.judge_temperature,
            )
            return {
                "messages": [
                    {"role": "user", "content": prompt},
                    {"role": "assistant", "content": answer},
                ],
                "score": parse_rating(judged.choices[0].message.content or ""),
            }

        def unrated(samples: List[Dict[str, Any]]) -> Dict[str, float]:
            missing = sum(s["score"] is None for s in samples)
            return {"eval/unrated_fraction": missing / len(samples) if samples else 0.0}

        self.eval_metrics = await run_eval_set(
            self,
            self.test,
            one,
            metric="eval/mean_rating",
            value="score",
            extra_metrics=unrated,
            generation_parameters={"temperature": 0.0},
        )

    async def wandb_log(self, wandb_metrics: Dict[str, Any] | None = None) -> None:
        metrics = drain_metrics(wandb_metrics, self.eval_metrics)
        metrics["train/judge_unparsed_verdicts"] = self.unparsed_verdicts
        metrics.update(self.skips.metrics())
        await super().wandb_log(metrics)


if __name__ == "__main__":
    RLAIFEnv.cli()
