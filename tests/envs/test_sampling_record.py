"""Groups carry what they were sampled with: ``generation_params["temperature"]`` and, for
``ManagedServer`` sequences, ``overrides[i]["finish_reason"]`` (read by the trainer's
temperature scaling and ``--mask-truncated``).

Unit tests of the stamping, and ``tests/envs/sampling_env.py`` run in ``process`` mode
against the real ``atropos-serve-model`` (tiny model).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import List

from atroposlib.envs.server_handling.sampling_record import (
    note_request,
    note_sequence,
    recording_sampling,
    stamp_sampling,
)
from atroposlib.testing.launch import run_api_cmd as api_cmd
from atroposlib.testing.ports import free_port
from atroposlib.testing.processes import running_process, start_process, stop_process
from atroposlib.testing.trainer import FakeTrainer
from tests.compat.test_env_files import clean_env, run_env, wait_exit

SAMPLING_ENV = Path(__file__).resolve().parent / "sampling_env.py"


def group(n: int = 2, **extra):
    return {"tokens": [[1, 2, 3 + i] for i in range(n)], "masks": [[-100, 2, 3]] * n, **extra}


# ----------------------------------------------------------------- stamping


def test_one_temperature_is_stamped_and_finish_reasons_follow_the_tokens():
    with recording_sampling() as record:
        note_request({"temperature": 0.7, "max_tokens": 4})
        note_request({"extra_body": {"temperature": 0.7}})
        note_sequence([1, 2, 4], "length")
        note_sequence([9, 9], "stop")  # not in the group
    g = group()
    stamp_sampling(g, record)
    assert g["generation_params"] == {"temperature": 0.7}
    assert g["overrides"] == [{}, {"finish_reason": "length"}]


def test_a_request_without_temperature_counts_as_the_default_one():
    with recording_sampling() as record:
        note_request({"max_tokens": 4})
    g = group()
    stamp_sampling(g, record)
    assert g["generation_params"] == {"temperature": 1.0}
    assert "overrides" not in g  # no tracked sequence


def test_what_the_environment_set_is_kept():
    with recording_sampling() as record:
        note_request({"temperature": 0.7})
        note_sequence([1, 2, 3], "length")
        note_sequence([1, 2, 4], "length")
    g = group(
        generation_params={"temperature": 0.3, "top_p": 0.9},
        overrides=[{"finish_reason": "stop"}, {"temperature": 0.5}],
    )
    stamp_sampling(g, record)
    assert g["generation_params"] == {"temperature": 0.3, "top_p": 0.9}
    assert g["overrides"] == [
        {"finish_reason": "stop"},
        {"temperature": 0.5, "finish_reason": "length"},
    ]
    g = group(generation_params={"top_p": 0.9})
    stamp_sampling(g, record)
    assert g["generation_params"] == {"top_p": 0.9, "temperature": 0.7}


def test_mixed_temperatures_stamp_none_and_nothing_is_recorded_outside_a_block():
    with recording_sampling() as record:
        note_request({"temperature": 0.7})
        note_request({"temperature": 1.0})
    g = group()
    stamp_sampling(g, record)
    assert "generation_params" not in g
    note_request({"temperature": 0.2})  # no block: ignored
    note_sequence([1], "length")
    assert record.temperatures == [0.7, 1.0] and record.finish_reasons == {}


# ----------------------------------------------------------------- end to end


def run_sampling_env(tmp_path: Path, serve, *flags: str) -> List[dict]:
    out = tmp_path / "groups.jsonl"
    proc = run_env(
        [
            str(SAMPLING_ENV),
            "process",
            "--env.data_path_to_save_groups",
            str(out),
            "--env.tokenizer_name",
            serve["model"],
            "--openai.base_url",
            serve["base_url"],
            "--openai.model_name",
            serve["model"],
            *flags,
        ],
        tmp_path,
        HF_HUB_OFFLINE="1",
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    groups = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    assert len(groups) == 2
    return groups


def generated(masks: List[int]) -> int:
    return sum(1 for m in masks if m != -100)


def consistent_reason(masks: List[int], reason: str, limit: int = 3) -> bool:
    """A cut at the token limit is "length"; an end-of-sequence token before it, or as the
    limit's last token, is "stop" (so exactly ``limit`` tokens may be either)."""
    n = generated(masks)
    return (reason == "length" and n == limit) or (reason == "stop" and n <= limit)


def test_managed_groups_carry_their_temperature_and_finish_reasons(tmp_path, serve_model):
    groups = run_sampling_env(
        tmp_path, serve_model, "--env.sample_temperature", "0.7", "--env.max_new_tokens", "3"
    )
    reasons = []
    for g in groups:
        assert g["generation_params"] == {"temperature": 0.7}
        assert len(g["overrides"]) == len(g["tokens"]) == 4
        for masks, override in zip(g["masks"], g["overrides"], strict=True):
            assert set(override) == {"finish_reason"}
            assert consistent_reason(masks, override["finish_reason"]), (masks, override)
            reasons.append(override["finish_reason"])
    assert "length" in reasons


def test_plain_completion_groups_carry_the_default_temperature(tmp_path, serve_model):
    groups = run_sampling_env(
        tmp_path, serve_model, "--env.mode", "plain", "--env.sample_temperature", "None"
    )
    for g in groups:
        assert g["generation_params"] == {"temperature": 1.0}
        assert g.get("overrides") is None  # no tracked sequences to take a reason from


def test_the_environments_own_values_win(tmp_path, serve_model):
    groups = run_sampling_env(tmp_path, serve_model, "--env.own_params", "true")
    for g in groups:
        assert g["generation_params"] == {"temperature": 0.25, "top_p": 0.9}
        assert g["overrides"][0] == {"finish_reason": "stop"}
        for masks, override in zip(g["masks"][1:], g["overrides"][1:], strict=True):
            assert override["finish_reason"] == ("length" if generated(masks) == 3 else "stop")


def test_serve_mode_groups_reach_the_trainer_with_temperature_and_finish_reasons(
    tmp_path, serve_model
):
    serve = serve_model
    api_port = free_port()
    log = tmp_path / "env.log"
    with running_process(
        api_cmd(api_port),
        health_url=f"http://127.0.0.1:{api_port}/health",
        log_path=tmp_path / "api.log",
    ):
        trainer = FakeTrainer(api_port, batch_size=4, num_steps=2)
        trainer.register()
        trainer.start()
        env = start_process(
            [
                sys.executable,
                str(SAMPLING_ENV),
                "serve",
                "--env.rollout_server_url",
                f"http://127.0.0.1:{api_port}",
                "--env.tokenizer_name",
                serve["model"],
                "--openai.base_url",
                serve["base_url"],
                "--openai.model_name",
                serve["model"],
                "--env.sample_temperature",
                "0.5",
            ],
            log_path=log,
            env=clean_env(tmp_path, WANDB_MODE="disabled", HF_HUB_OFFLINE="1"),
        )
        try:
            assert wait_exit(env, 180, log) == 0, log.read_text()[-3000:]
        finally:
            stop_process(env)
            trainer.stop()
        trainer.drain()
    groups = [g for batch in trainer.batches for g in batch]
    assert groups, log.read_text()[-3000:]
    from example_trainer.data import group_to_samples

    lengths = 0
    for g in groups:
        assert g["generation_params"] == {"temperature": 0.5}
        reasons = [o["finish_reason"] for o in g["overrides"]]
        assert all(consistent_reason(m, r) for m, r in zip(g["masks"], reasons, strict=True))
        # what the trainer makes of them: scored at 0.5, --mask-truncated drops "length"
        samples = group_to_samples(g, mask_truncated=True)
        for sample, reason in zip(samples, reasons, strict=True):
            assert sample.temperature == 0.5
            assert sample.truncated == (reason == "length")
            assert any(label != -100 for label in sample.labels) == (reason == "stop")
        lengths += reasons.count("length")
    assert lengths > 0
