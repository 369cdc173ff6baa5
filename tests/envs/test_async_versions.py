"""Async RL end to end: an environment keeps generating through five weight syncs, and every
group it posts records the weight version the inference server actually used.

Real processes: ``atropos-serve-model`` (tiny model), ``run-api`` and the arithmetic
environment, unchanged (it knows nothing of versions: ``BaseEnv`` stamps them from the
server's answers). The test plays a trainer: it pulls batches and, five times, pushes
another checkpoint with ``/update_weights``. The ground truth of which weights produced a
group is recomputed from the group itself: its ``inference_logprobs`` must be those of the
checkpoint that the server's swap history (``/weights_history``) lists for the recorded
version, and of no other checkpoint.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import httpx
import torch

from atroposlib.testing.launch import run_api_cmd
from atroposlib.testing.ports import free_port
from atroposlib.testing.processes import running_process
from atroposlib.testing.trainer import register_trainer
from tests.serving.support import direct_logprobs, serve_cmd

ROOT = Path(__file__).resolve().parents[2]
SYNCS = 5


def _env_cmd(api: str, inference: str, model: str) -> list[str]:
    return [
        sys.executable,
        str(ROOT / "environments" / "arithmetic_server.py"),
        "serve",
        "--env.rollout_server_url",
        api,
        "--env.tokenizer_name",
        model,
        "--env.group_size",
        "4",
        "--env.use_wandb",
        "false",
        "--env.ensure_scores_are_not_same",
        "false",
        "--openai.base_url",
        f"{inference}/v1",
        "--openai.model_name",
        model,
        "--openai.server_type",
        "vllm",
    ]


def _pull(client: httpx.Client, deadline: float) -> list[dict]:
    while time.monotonic() < deadline:
        batch = client.get("/batch").json()["batch"]
        if batch:
            return batch
        time.sleep(0.05)
    raise AssertionError("no batch in time")


def _checkpoints(base_dir: str, root: Path) -> dict[int, tuple[str, object]]:
    """Version -> (directory, model): the base weights, each version perturbed differently."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    out = {0: (base_dir, AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32))}
    for v in range(1, SYNCS + 1):
        model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        gen = torch.Generator().manual_seed(100 + v)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 0.05)
        path = root / f"weights_v{v}"
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        out[v] = (str(path), model.eval())
    return out


def test_every_group_records_the_version_the_server_used(tiny_model_dir, tmp_path):
    made = _checkpoints(str(tiny_model_dir), tmp_path)
    checkpoints = {v: path for v, (path, _) in made.items()}
    sm_port, api_port = free_port(), free_port()
    inference, api = f"http://127.0.0.1:{sm_port}", f"http://127.0.0.1:{api_port}"
    serve = serve_cmd(tiny_model_dir, sm_port, "--weights-root", str(tmp_path))
    run_api = run_api_cmd(api_port)
    groups: list[dict] = []
    with (
        running_process(serve, f"{inference}/health", 180, tmp_path / "serve.log"),
        running_process(run_api, f"{api}/health", 60, tmp_path / "api.log"),
        httpx.Client(base_url=api, timeout=30) as client,
        httpx.Client(base_url=inference, timeout=120) as server,
    ):
        register_trainer(
            api,
            batch_size=8,
            max_token_len=256,
            num_steps=1000,
            checkpoint_dir=str(tmp_path / "ckpt"),
        )
        with running_process(
            _env_cmd(api, inference, str(tiny_model_dir)),
            log_path=tmp_path / "env.log",
            env={"WANDB_MODE": "disabled"},
        ):
            deadline = time.monotonic() + 240
            for version in range(SYNCS + 1):
                # Train until a group made by the weights just pushed comes back, then sync.
                while not any(g["policy_version"][0] == version for g in groups):
                    groups.extend(_pull(client, deadline))
                if version < SYNCS:
                    upd = server.post(
                        "/update_weights",
                        json={"path": checkpoints[version + 1], "version": version + 1},
                    )
                    assert upd.status_code == 200, upd.text
        history = server.get("/weights_history").json()
    # The server's own record of which directory it served under which version.
    served = {0: str(tiny_model_dir), **{s["version"]: s["path"] for s in history["swaps"]}}
    assert served == {v: str(Path(p).resolve()) if v else p for v, p in checkpoints.items()}
    models = {v: model for v, (_, model) in made.items()}
    assert {g["policy_version"][0] for g in groups} == set(range(SYNCS + 1))
    for g in groups:
        recorded = set(g["policy_version"])
        assert len(recorded) == 1 and "policy_version_max" not in g  # one request per group
        (version,) = recorded
        for i, (tokens, masks, lps) in enumerate(
            zip(g["tokens"], g["masks"], g["inference_logprobs"], strict=True)
        ):
            start = next(j for j, m in enumerate(masks) if m != -100)
            # Every sequence against the recorded version; the first also against all others.
            errors = {
                v: max(
                    abs(a - b)
                    for a, b in zip(
                        direct_logprobs(model, tokens[:start], tokens[start:]),
                        lps[start:],
                        strict=True,
                    )
                )
                for v, model in models.items()
                if i == 0 or v == version
            }
            assert errors[version] < 2e-3, (version, errors)
            assert min(errors, key=errors.get) == version, (version, errors)
