"""Integration tests of every endpoint against a real ``run-api`` process."""

from __future__ import annotations

import gzip
import json
from typing import Iterator

import pytest
from fastapi.testclient import TestClient

from atroposlib.api import APISettings, create_app
from atroposlib.cli.run_api import build_parser
from tests.api.conftest import TRAINER, Api, group, start_api


def test_root_and_health_answer(api: Api):
    assert api.client.get("/").json() == {"message": "AtroposLib API"}
    assert api.client.get("/health").json() == {"status": "ok"}


@pytest.fixture
def never_registered(tmp_path) -> Iterator[Api]:
    """A server no trainer ever registered with (``/reset_data`` keeps ``max_token_len``, as
    the original's does, so the shared one will not do)."""
    ctx, url = start_api(tmp_path)
    with ctx as proc:
        a = Api(url, proc=proc)
        yield a
        a.client.close()


def test_before_registration_info_wandb_status_and_batch_have_defaults(never_registered: Api):
    c = never_registered.client
    assert c.get("/info").json() == {"batch_size": -1, "max_token_len": -1}
    assert c.get("/wandb_info").json() == {"group": None, "project": None}
    assert c.get("/status").json().items() >= {"current_step": 0, "queue_size": 0}.items()
    assert c.get("/batch").json() == {
        "status": "error",
        "message": "Trainer not registered. Call /register first.",
        "batch": [],
    }
    r = c.post(
        "/register-env",
        json={"max_token_length": 10, "desired_name": "x", "weight": 1, "group_size": 2},
    )
    assert r.json() == {"status": "wait for trainer to start"}


def test_register_sets_config_once_and_returns_uuid(fresh: Api):
    c = fresh.client
    first = c.post("/register", json=TRAINER).json()
    second = c.post("/register", json={**TRAINER, "batch_size": 64}).json()
    assert isinstance(first["uuid"], int) and first["uuid"] != second["uuid"]
    assert c.get("/info").json() == {"batch_size": 8, "max_token_len": 512}
    assert c.get("/wandb_info").json() == {"group": "grp", "project": "proj"}


def test_register_env_waits_for_first_batch_poll_then_names_envs(fresh: Api):
    c = fresh.client
    c.post("/register", json={**TRAINER, "starting_step": 7})
    body = {"max_token_length": 100, "desired_name": "gsm8k", "weight": 1.0, "group_size": 4}
    assert c.post("/register-env", json=body).json()["status"] == "wait for trainer to start"
    assert c.get("/batch").json() == {"batch": None}
    first = c.post("/register-env", json=body).json()
    assert first == {
        "status": "success",
        "env_id": 0,
        "wandb_name": "gsm8k_0",
        "checkpoint_dir": "ckpts",
        "starting_step": 7,
        "checkpoint_interval": 5,
        "num_steps": 100,
    }
    assert c.post("/register-env", json=body).json()["wandb_name"] == "gsm8k_1"


@pytest.mark.smoke
def test_scored_data_round_trips_every_field_through_batch(fresh: Api):
    fresh.start_trainer()
    env = fresh.register_env(group_size=4)
    full = group(
        4,
        env_id=env,
        advantages=[[0.5] * 3] * 4,
        ref_logprobs=[[-0.1] * 3] * 4,
        messages=[[{"role": "user", "content": "hi", "reward": 1.0}]] * 4,
        generation_params={"temperature": 0.8},
        inference_logprobs=[[1.0, -0.5, -0.25]] * 4,
        overrides=[{"set_advantage_to_zero": True}] * 4,
        group_overrides={"group_size": 4},
        images=["aGVsbG8="],
        distill_token_ids=[[[1, 2]] * 3] * 4,
        distill_logprobs=[[[-0.1, -2.0]] * 3] * 4,
    )
    minimal = group(4, env_id=env, base=2)
    assert fresh.client.post("/scored_data", json=full).json() == {"status": "received"}
    assert fresh.client.post("/scored_data", json=minimal).json() == {"status": "received"}
    batch = fresh.client.get("/batch").json()["batch"]
    assert batch[0] == full
    assert batch[1] == {**{k: None for k in full}, **minimal}
    assert (
        fresh.client.get("/status").json().items() >= {"current_step": 1, "queue_size": 0}.items()
    )


def test_batch_is_fifo_one_batch_per_call_and_step_counts_batches(fresh: Api):
    fresh.start_trainer(batch_size=8)
    env = fresh.register_env(group_size=4)
    for i in range(6):
        fresh.client.post("/scored_data", json=group(4, env_id=env, base=i + 1))
    firsts = []
    for expected_step in (1, 2, 3):
        batch = fresh.client.get("/batch").json()["batch"]
        firsts += [g["tokens"][0][0] // 1000 for g in batch]
        assert fresh.client.get("/status").json()["current_step"] == expected_step
    assert firsts == [1, 2, 3, 4, 5, 6]
    assert fresh.client.get("/batch").json() == {"batch": None}


def test_batch_is_fifo_across_envs(fresh: Api):
    fresh.start_trainer(batch_size=8)
    a, b = fresh.register_env("a"), fresh.register_env("b")
    for i, env in enumerate([b, a, b, a]):
        fresh.client.post("/scored_data", json=group(4, env_id=env, base=i + 1))
    batch = fresh.client.get("/batch").json()["batch"]
    assert [(g["env_id"], g["tokens"][0][0] // 1000) for g in batch] == [(b, 1), (a, 2)]


def test_odd_sized_groups_are_buffered_then_flushed(fresh: Api):
    fresh.start_trainer()
    env = fresh.register_env(group_size=4)
    assert fresh.client.post("/scored_data", json=group(3, env_id=env)).json() == {
        "status": "buffered",
        "buffer_size": 3,
    }
    assert fresh.client.get("/status").json()["queue_size"] == 0
    assert fresh.client.post("/scored_data", json=group(1, env_id=env, base=2)).json() == {
        "status": "buffered",
        "buffer_size": 0,
    }
    assert fresh.client.get("/status").json()["queue_size"] == 2


def test_scored_data_list_reports_processed_and_buffered(fresh: Api):
    fresh.start_trainer()
    env = fresh.register_env(group_size=4)
    answer = fresh.client.post(
        "/scored_data_list", json=[group(4, env_id=env), group(2, env_id=env, base=2)]
    )
    assert answer.json() == {
        "status": "received",
        "groups_processed": 2,
        "buffered": 1,
        "last_buffer_size": 2,
    }
    plain = fresh.client.post("/scored_data_list", json=[group(4, env_id=env, base=3)])
    assert plain.json() == {"status": "received", "groups_processed": 1}


def test_latest_example_is_a_placeholder_on_a_new_server():
    with TestClient(create_app(APISettings()), base_url="http://127.0.0.1") as client:
        latest = client.get("/latest_example").json()
    assert (
        latest["tokens"] == [] and latest["messages"] == [] and latest["inference_logprobs"] == []
    )


def test_latest_example_is_the_last_queued_group_and_survives_reset(fresh: Api):
    fresh.client.post("/scored_data", json=group(2, base=5))
    assert fresh.client.get("/latest_example").json()["tokens"] == group(2, base=5)["tokens"]
    fresh.reset()
    assert fresh.client.get("/latest_example").json()["tokens"] == group(2, base=5)["tokens"]


def test_status_env_accepts_query_param_and_legacy_json_body(fresh: Api):
    fresh.start_trainer(batch_size=8)
    env = fresh.register_env(group_size=4)
    fresh.client.post("/scored_data", json=group(4, env_id=env))
    by_query = fresh.client.get("/status-env", params={"env_id": env}).json()
    by_body = fresh.client.request("GET", "/status-env", json={"env_id": env}).json()
    assert by_query == by_body
    assert by_query == {
        "current_step": 0,
        "queue_size": 1,
        "unallocated_fraction": 1.0,
        "self_queue_size": 1,
        "max_group_size": 4,
        "env_weight": 1.0,
        "self_buffered_groups": 0,
        "current_version": 0,
    }


def test_disconnect_env_marks_disconnected_and_changes_weights(fresh: Api):
    fresh.start_trainer()
    a, b = fresh.register_env("a"), fresh.register_env("b")
    assert fresh.client.get("/status-env", params={"env_id": a}).json()["env_weight"] == 0.5
    assert fresh.client.post("/disconnect-env", json={"env_id": b}).json() == {"status": "success"}
    assert fresh.client.get("/status-env", params={"env_id": a}).json()["env_weight"] == 1.0


def test_reset_data_answers_plain_text_and_forgets_state(fresh: Api):
    fresh.start_trainer()
    fresh.client.post("/scored_data", json=group(4))
    r = fresh.client.get("/reset_data")
    assert r.text == "Reset successful" and r.headers["content-type"].startswith("text/plain")
    assert (
        fresh.client.get("/status").json().items() >= {"current_step": 0, "queue_size": 0}.items()
    )
    assert fresh.client.get("/info").json()["batch_size"] == -1


def test_gzip_request_body_is_accepted_and_large_responses_are_gzipped(fresh: Api):
    fresh.start_trainer(batch_size=4)
    big = group(4, seq_len=200)
    r = fresh.client.post(
        "/scored_data",
        content=gzip.compress(json.dumps(big).encode()),
        headers={"Content-Encoding": "gzip", "Content-Type": "application/json"},
    )
    assert r.json() == {"status": "received"}
    r = fresh.client.get("/batch", headers={"Accept-Encoding": "gzip"})
    assert r.headers.get("content-encoding") == "gzip"
    assert r.json()["batch"][0]["tokens"] == big["tokens"]
    small = fresh.client.get("/health", headers={"Accept-Encoding": "gzip"})
    assert "content-encoding" not in small.headers


def _metric(api: Api, name: str) -> float:
    for line in api.client.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not in /metrics")


def test_metrics_expose_queue_counters_step_and_envs(fresh: Api):
    served_before = _metric(fresh, "atropos_batches_served_total")
    ingested_before = _metric(fresh, "atropos_groups_ingested_total")
    fresh.start_trainer(batch_size=4)
    env = fresh.register_env()
    fresh.client.post("/scored_data", json=group(4, env_id=env))
    fresh.client.post("/scored_data", json=group(4, env_id=env, base=2))
    fresh.client.get("/batch")
    assert _metric(fresh, "atropos_batches_served_total") == served_before + 1
    assert _metric(fresh, "atropos_groups_ingested_total") == ingested_before + 2
    invalid_before = _metric(fresh, 'atropos_rejected_total{reason="invalid"}')
    fresh.client.post("/scored_data", json={**group(4), "masks": [[1]]})
    assert _metric(fresh, 'atropos_rejected_total{reason="invalid"}') == invalid_before + 1
    lines = set(fresh.client.get("/metrics").text.splitlines())
    assert "atropos_internal_errors_total 0" in lines
    assert f'atropos_queue_groups{{env_id="{env}"}} 1' in lines
    assert "atropos_step 1" in lines
    assert "atropos_envs_connected 1" in lines
    assert any(line.startswith(f'atropos_queue_bytes{{env_id="{env}"}} ') for line in lines)


def test_openapi_and_docs_are_served(api: Api):
    schema = api.client.get("/openapi.json").json()
    assert {"/scored_data", "/status-env", "/batch", "/register"} <= set(schema["paths"])
    assert api.client.get("/docs").status_code == 200


def test_run_api_help_lists_flags():
    out = build_parser().format_help()
    for flag in (
        "--host",
        "--port",
        "--reload",
        "--persist",
        "--api-key",
        "--max-queue-mb",
        "--max-request-mb",
    ):
        assert flag in out


def test_min_batch_allocation_reserves_share_for_newer_env(fresh: Api):
    fresh.start_trainer(batch_size=8)
    plain = fresh.register_env("plain")
    reserved = fresh.register_env("reserved", min_batch_allocation=0.5)
    for i in range(3):
        fresh.client.post("/scored_data", json=group(4, env_id=plain, base=i + 1))
    fresh.client.post("/scored_data", json=group(4, env_id=reserved, base=9))
    status = fresh.client.get("/status-env", params={"env_id": plain}).json()
    assert status["unallocated_fraction"] == 0.5
    batch = fresh.client.get("/batch").json()["batch"]
    assert [(g["env_id"], g["tokens"][0][0] // 1000) for g in batch] == [(reserved, 9), (plain, 1)]
    # The reserved env has nothing left: its quota blocks further batches, as in the original.
    assert fresh.client.get("/batch").json() == {"batch": None}


def test_cors_is_closed_by_default_and_opens_for_configured_origins():
    origin = {"Origin": "http://dashboard.local"}
    with TestClient(create_app(APISettings()), base_url="http://127.0.0.1") as closed:
        assert "access-control-allow-origin" not in closed.get("/health", headers=origin).headers
    with TestClient(
        create_app(APISettings(cors_origins=["http://dashboard.local"])),
        base_url="http://127.0.0.1",
    ) as opened:
        r = opened.get("/health", headers=origin)
        assert r.headers["access-control-allow-origin"] == "http://dashboard.local"


def test_responses_are_not_gzipped_when_the_client_does_not_ask(fresh: Api):
    fresh.start_trainer(batch_size=4)
    fresh.client.post("/scored_data", json=group(4, seq_len=200))
    r = fresh.client.get("/batch", headers={"Accept-Encoding": "identity"})
    assert "content-encoding" not in r.headers and len(r.content) > 1000
