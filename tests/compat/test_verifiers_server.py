"""The original's ``environments/verifiers_server.py``, unchanged, on our library.

The original file is fetched from its sdist (``originals.py``; skipped without network).
It loads the verifiers environment ``vf-tiny-env`` (``vf_tiny_env.py`` here, importable by
name through ``PYTHONPATH``) with ``vf.load_environment``, runs each group's rollouts
concurrently through ``ManagedServerAdapter`` and pairs ``results["state"][i]`` with node
``i``. verifiers returns the states in the order the rollouts finish, so the nodes a
rollout recorded through the adapter must be listed in that order too: the tests check
that every written rollout's score is the rubric's score of its own tokens, also when the
server answers the concurrent rollouts in reverse order.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Dict, List

import pytest

from atroposlib.envs.server_handling.managed_server import ManagedServer, ManagedServerAdapter
from atroposlib.testing.ports import free_port
from atroposlib.testing.processes import running_process
from atroposlib.testing.tokenizers import llama_style_tokenizer
from tests.compat.originals import OriginalUnavailable, original_environments
from tests.compat.test_env_files import groups_in, run_env
from tests.envs.server_handling.test_original_interface import RecordingServer

# The extra is outside "all" (verifiers pins its own dependencies): without it, skip.
pytest.importorskip("verifiers", reason="needs the verifiers extra (atroposlib[verifiers])")
from tests.compat import vf_tiny_env  # noqa: E402

HERE = Path(__file__).resolve().parent
PROXY = HERE / "reverse_order_proxy.py"
GROUP_SIZE = 4


@pytest.fixture(scope="session")
def original_verifiers_server() -> Path:
    """Path of the original's ``environments/verifiers_server.py`` (downloaded once)."""
    try:
        return original_environments() / "verifiers_server.py"
    except OriginalUnavailable as e:
        pytest.skip(f"the original's environments/ are not available: {e}")


# ----------------------------------------------------------------- in process


async def test_verifiers_states_pair_with_nodes_when_answers_arrive_reversed():
    """verifiers' own ``generate`` over the adapter: rollout i's state is node i."""
    tok = llama_style_tokenizer()
    words = ["six", "seven", "Hello", "there"]
    outs = [tok.encode(f" {w}!!", add_special_tokens=False) for w in words]
    # The first request is answered last, the last first.
    server = RecordingServer(outs, delays=[0.4, 0.3, 0.2, 0.0])
    managed = ManagedServer(server, tok)
    env = vf_tiny_env.load_environment()
    item = env.get_dataset().to_list()[0]
    inputs = [
        {k: item[k] for k in ("prompt", "answer", "example_id", "task")} for _ in range(GROUP_SIZE)
    ]
    results = await env.generate(
        inputs=inputs,
        client=ManagedServerAdapter(managed),
        model="m",
        sampling_args={"temperature": 1.0},
        max_concurrent=GROUP_SIZE,
        independent_scoring=True,
        use_tqdm=False,
    )
    nodes = managed.get_state()["nodes"]
    states = results["state"]
    answers = [s["completion"][-1]["content"] for s in states]
    assert sorted(answers) == sorted(tok.decode(o) for o in outs)
    assert answers != [tok.decode(o) for o in outs]  # verifiers' order is not request order
    for state, node in zip(states, nodes, strict=True):
        generated = [t for t, m in zip(node.tokens, node.masked_tokens, strict=True) if m != -100]
        text = tok.decode(generated, skip_special_tokens=True)
        assert state["completion"][-1]["content"] == text
        assert state["reward"] == vf_tiny_env.score_text(text)


async def test_direct_managed_calls_keep_request_order_next_to_adapter_calls():
    """Only the adapter's calls follow their task's completion; plain calls in one task
    stay in request order."""
    tok = llama_style_tokenizer()
    outs = [tok.encode(f" {w}", add_special_tokens=False) for w in ("six", "seven")]
    server = RecordingServer(outs, delays=[0.2, 0.0])
    managed = ManagedServer(server, tok)
    await asyncio.gather(*(managed.completion(prompt=p) for p in ("Hello", "What is")))
    assert [n.full_text for n in managed.get_state()["nodes"]] == [
        "Hello" + tok.decode(outs[0]),
        "What is" + tok.decode(outs[1]),
    ]


# ----------------------------------------------------------------- as a process


def run_original(
    script: Path, tmp_path: Path, serve: Dict[str, str], base_url: str, steps: int
) -> List[dict]:
    out = tmp_path / "groups.jsonl"
    proc = run_env(
        [
            str(script),
            "process",
            "--env.vf_env_name",
            "vf-tiny-env",
            "--env.data_path_to_save_groups",
            str(out),
            "--env.total_steps",
            str(steps),
            "--env.group_size",
            str(GROUP_SIZE),
            "--env.use_wandb",
            "false",
            "--env.max_token_length",
            "48",
            "--env.tokenizer_name",
            serve["model"],
            "--openai.base_url",
            base_url,
            "--openai.model_name",
            serve["model"],
            # config_init names sglang; atropos-serve-model speaks vLLM's /generate
            "--openai.server_type",
            "vllm",
            "--openai.timeout",
            "120",
        ],
        tmp_path,
        PYTHONPATH=str(HERE),  # vf.load_environment imports vf_tiny_env by name
        HF_HUB_OFFLINE="1",
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    groups = groups_in(out)
    assert len(groups) == steps
    return groups


def check_groups(groups: List[dict], model: str) -> None:
    """Tokens, masks and logprobs align; each score and message is its own rollout's."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    for group in groups:
        assert len(group["tokens"]) == GROUP_SIZE
        texts = []
        for tokens, masks, lps, score, messages in zip(
            group["tokens"],
            group["masks"],
            group["inference_logprobs"],
            group["scores"],
            group["messages"],
            strict=True,
        ):
            assert len(tokens) == len(masks) == len(lps)
            prompt_len = masks.index(next(m for m in masks if m != -100))
            assert prompt_len > 0 and masks[:prompt_len] == [-100] * prompt_len
            assert masks[prompt_len:] == tokens[prompt_len:]
            assert lps[:prompt_len] == [1.0] * prompt_len
            assert all(lp <= 0.0 for lp in lps[prompt_len:])
            text = tok.decode(tokens[prompt_len:], skip_special_tokens=True)
            assert messages[-1] == {"role": "assistant", "content": text}
            assert score == vf_tiny_env.score_text(text)
            texts.append(text)
        # distinct rollouts, so a score paired with the wrong one would show
        assert len(set(texts)) == GROUP_SIZE


def test_original_verifiers_server_process_writes_aligned_groups(
    original_verifiers_server, serve_model, tmp_path
):
    groups = run_original(
        original_verifiers_server, tmp_path, serve_model, serve_model["base_url"], steps=3
    )
    check_groups(groups, serve_model["model"])


def test_original_verifiers_server_scores_stay_with_rollouts_answered_in_reverse(
    original_verifiers_server, serve_model, tmp_path
):
    port = free_port()
    upstream = serve_model["base_url"].removesuffix("/v1")
    cmd = [sys.executable, str(PROXY), "--upstream", upstream, "--port", str(port)]
    cmd += ["--batch", str(GROUP_SIZE), "--gap", "0.2"]
    with running_process(
        cmd, health_url=f"http://127.0.0.1:{port}/health", log_path=tmp_path / "proxy.log"
    ):
        groups = run_original(
            original_verifiers_server, tmp_path, serve_model, f"http://127.0.0.1:{port}/v1", 2
        )
    check_groups(groups, serve_model["model"])
    assert json.dumps(groups)  # written as plain JSON
