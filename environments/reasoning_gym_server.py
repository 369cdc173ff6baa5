"""reasoning-gym's procedural tasks (106 in 0.1.25) as one environment, offline.

Needs ``pip install 'atroposlib[reasoning-gym]'``. The adapter is
:class:`atroposlib.envs.adapters.reasoning_gym.ReasoningGymEnv`; this file runs it.
Pick tasks with ``--env.tasks`` (``all``, ``'["chain_sum","leg_counting"]'`` or
``'{"chain_sum": 3, "leg_counting": 1}'``), tune generators with ``--env.task_configs``.

Try it against the tiny model (after ``atropos-serve-model MODEL_DIR --port 9001``)::

    python environments/reasoning_gym_server.py process --env.tasks all \\
        --env.order round_robin --env.total_steps 8 --env.group_size 2 \\
        --env.max_answer_tokens 32 --env.tokenizer_name MODEL_DIR \\
        --openai.base_url http://127.0.0.1:9001/v1 --openai.model_name MODEL_DIR \\
        --env.data_path_to_save_groups out/reasoning_gym.jsonl

For ``example_trainer/configs/reasoning_gym_cpu.yaml`` (a CPU learning run), this file
also gives the supervised warm-up examples (:func:`sft_examples`: gold answers of the
training seed) and the held-out evaluation (:func:`greedy_eval`: items of the eval seed)
of one small task, :data:`DEMO_TASK` with :data:`DEMO_CONFIG`.
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import httpx

from atroposlib.envs.adapters import _rg_worker
from atroposlib.envs.adapters.reasoning_gym import (
    ReasoningGymEnv,
    ReasoningGymEnvConfig,
    extract_answer,
    task_seed,
)

__all__ = ["ReasoningGymEnv", "ReasoningGymEnvConfig", "greedy_eval", "sft_examples"]

# "Alice in Wonderland" sibling questions ("Sarah has 5 sisters and she also has 3
# brothers. How many sisters does Robert's brother have?" -> 6): a short prompt, an
# answer from 2 to 7, and one rule (the sisters named, plus the girl herself) that a
# tiny model can find by trial: every group of samples holds right and wrong answers.
DEMO_TASK = "aiw"
DEMO_CONFIG: Dict[str, Any] = {"task_types": ["siblings"], "task_type_weights": [1.0]}
DEMO_TRAIN_SEED = 0  # the env's --env.seed
DEMO_EVAL_SEED = ReasoningGymEnvConfig.model_fields["eval_seeds"].default[0]
DEMO_SIZE = ReasoningGymEnvConfig.model_fields["dataset_size"].default
DEMO_EVAL_SIZE = 200  # the run passes --env.eval_items_per_task 200: the same items


def _demo_item(seed: int, index: int) -> Dict[str, Any]:
    # chain_sum does not depend on PYTHONHASHSEED, so in-process generation matches the
    # env's generator process.
    return _rg_worker.generate_item(
        DEMO_TASK, DEMO_CONFIG, task_seed(DEMO_TASK, seed), DEMO_SIZE, index
    )


def _demo_messages(question: str) -> List[Dict[str, str]]:
    # No system prompt: the run passes --env.system_prompt "" so the sequences stay short.
    return [{"role": "user", "content": question}]


def sft_examples(n: int, seed: int = 0) -> List[Tuple[List[Dict[str, str]], str]]:
    """``n`` (prompt messages, ``<answer>gold</answer>``) pairs from the training seed's
    dataset (items from index ``seed`` on, eval questions skipped), for the warm-up."""
    held_out = _eval_questions()
    pairs = []
    i = seed
    while len(pairs) < n:
        item = _demo_item(DEMO_TRAIN_SEED, i)
        i += 1
        if item["question"] in held_out:
            continue  # as the env does (exclude_eval_questions): eval stays unseen
        pairs.append((_demo_messages(item["question"]), f"<answer>{item['answer']}</answer>"))
    return pairs


def _eval_questions() -> set:
    return {_demo_item(DEMO_EVAL_SEED, i)["question"] for i in range(DEMO_EVAL_SIZE)}


def greedy_eval(
    base_url: str,
    tokenizer: Any,
    max_tokens: int = 16,
    timeout: float = 120.0,
    limit: int = 0,
    model: str | None = None,
) -> float:
    """Greedy accuracy (score 1.0 from the task's own scorer) of the server at ``base_url``
    on :data:`DEMO_EVAL_SIZE` items of the held-out eval seed, in one batched request.
    ``model``: the model name to request (default: the server's)."""
    items = [_demo_item(DEMO_EVAL_SEED, i) for i in range(limit or DEMO_EVAL_SIZE)]
    prompts = [
        list(
            tokenizer.apply_chat_template(
                _demo_messages(item["question"]),
                tokenize=True,
                add_generation_prompt=True,
                return_dict=False,
            )
        )
        for item in items
    ]
    root = base_url.rstrip("/").removesuffix("/v1")
    with httpx.Client(timeout=timeout) as client:
        resp = client.post(
            f"{root}/v1/completions",
            json={
                "prompt": prompts,
                "max_tokens": max_tokens,
                "temperature": 0.0,
                **({"model": model} if model is not None else {}),
            },
        )
    if resp.status_code != 200:
        raise RuntimeError(f"eval request failed: HTTP {resp.status_code}: {resp.text[:300]}")
    correct = 0
    for choice in resp.json()["choices"]:
        item = items[int(choice["index"])]
        text = (choice.get("text") or "").split("<|im_end|>")[0]
        [(score, _)] = _rg_worker.score_answers(
            DEMO_TASK,
            DEMO_CONFIG,
            task_seed(DEMO_TASK, DEMO_EVAL_SEED),
            DEMO_SIZE,
            [extract_answer(text, "answer_tag")],
            item,
        )
        correct += score >= 1.0
    return correct / max(len(items), 1)


greedy_eval.eval_set = {  # type: ignore[attr-defined]
    "held_out": True,
    "size": DEMO_EVAL_SIZE,
    "task": DEMO_TASK,
    "eval_seed": DEMO_EVAL_SEED,
}

if __name__ == "__main__":
    ReasoningGymEnv.cli()
