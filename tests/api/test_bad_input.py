"""Every bad-input path answers a clear 4xx (never a 500) and changes nothing."""

from __future__ import annotations

import gzip
import json

import httpx
import pytest

from atroposlib.cli.run_api import parse_settings
from tests.api.conftest import Api, group, start_api


def _detail_locs(r: httpx.Response) -> list:
    return [tuple(d["loc"]) for d in r.json()["detail"]]


@pytest.mark.parametrize(
    "path", ["/scored_data", "/scored_data_list", "/register", "/register-env", "/disconnect-env"]
)
def test_malformed_json_is_422_on_every_post(fresh: Api, path: str):
    r = fresh.client.post(
        path, content=b'{"tokens": [[1, 2]', headers={"Content-Type": "application/json"}
    )
    assert r.status_code == 422
    assert r.json()["detail"][0]["type"] == "json_invalid"


@pytest.mark.parametrize(
    "payload, loc",
    [
        ({"tokens": "abc", "masks": [[1]], "scores": [1.0]}, ("body", "tokens")),
        ({"tokens": [[1.5]], "masks": [[1]], "scores": [1.0]}, ("body", "tokens", 0, 0)),
        ({"tokens": [[1]], "masks": [[1]], "scores": ["high"]}, ("body", "scores", 0)),
        ({"tokens": [[1]], "masks": [[1]]}, ("body", "scores")),
        ({"tokens": [[1]], "masks": [[1]], "scores": [1.0], "env_id": "zero"}, ("body", "env_id")),
        ({"tokens": [], "masks": [], "scores": []}, ("body", "tokens")),
    ],
)
def test_wrong_types_are_422_naming_the_field(fresh: Api, payload: dict, loc: tuple):
    r = fresh.client.post("/scored_data", json=payload)
    assert r.status_code == 422
    assert loc in _detail_locs(r)
    assert fresh.client.get("/status").json()["queue_size"] == 0


@pytest.mark.parametrize(
    "change, loc",
    [
        ({"masks": [[-100, 1, 2]] * 3}, ("body", "masks")),
        ({"masks": [[-100, 1, 2]] * 3 + [[1]]}, ("body", "masks", 3)),
        ({"scores": [1.0]}, ("body", "scores")),
        ({"tokens": [[1, 2, 3]] * 3}, ("body", "scores")),
    ],
)
def test_mismatched_lengths_are_422_naming_field_and_index(fresh: Api, change: dict, loc: tuple):
    r = fresh.client.post("/scored_data", json={**group(4), **change})
    assert r.status_code == 422
    assert _detail_locs(r) == [loc]
    assert loc[1] in r.json()["detail"][0]["msg"]
    assert fresh.client.get("/status").json()["queue_size"] == 0


def test_bad_element_of_a_list_is_422_with_its_index_and_nothing_is_stored(fresh: Api):
    bad = {**group(4, base=2), "masks": [[1]] * 4}
    r = fresh.client.post("/scored_data_list", json=[group(4), bad])
    assert r.status_code == 422
    assert _detail_locs(r) == [("body", 1, "masks", 0)]
    assert fresh.client.get("/status").json()["queue_size"] == 0


def test_message_without_role_or_content_is_422(fresh: Api):
    r = fresh.client.post("/scored_data", json=group(4, messages=[[{"role": "user"}]] * 4))
    assert r.status_code == 422 and "content" in r.json()["detail"][0]["msg"]
    ok = fresh.client.post(
        "/scored_data", json=group(4, messages=[[{"role": "critic", "content": "x", "x": 1}]])
    )
    assert ok.status_code == 200


def test_unknown_env_id_is_404_everywhere(fresh: Api):
    fresh.start_trainer()
    env = fresh.register_env()
    for r in (
        fresh.client.post("/scored_data", json=group(4, env_id=env + 1)),
        fresh.client.post("/scored_data", json=group(4, env_id=-1)),
        fresh.client.post("/scored_data_list", json=[group(4, env_id=env), group(4, env_id=99)]),
        fresh.client.get("/status-env", params={"env_id": 42}),
        fresh.client.post("/disconnect-env", json={"env_id": 42}),
    ):
        assert r.status_code == 404, r.text
        assert "env_id" in r.json()["detail"]
    assert fresh.client.get("/status").json()["queue_size"] == 0


def test_status_env_without_or_with_bad_env_id_is_422(fresh: Api):
    fresh.start_trainer()
    assert fresh.client.get("/status-env").status_code == 422
    assert fresh.client.get("/status-env", params={"env_id": "one"}).status_code == 422
    assert fresh.client.request("GET", "/status-env", content=b"{oops").status_code == 422


def test_status_env_before_trainer_registration_is_a_payload_not_an_error(fresh: Api):
    r = fresh.client.get("/status-env", params={"env_id": 0})
    assert r.status_code == 200 and r.json()["queue_size"] == 0


def test_invalid_registrations_are_422(fresh: Api):
    assert fresh.client.post("/register", json={"wandb_group": "g"}).status_code == 422
    fresh.start_trainer()
    bad = {"max_token_length": 10, "desired_name": "x", "weight": 1, "group_size": 0}
    r = fresh.client.post("/register-env", json=bad)
    assert r.status_code == 422 and ("body", "group_size") in _detail_locs(r)
    r = fresh.client.post(
        "/register-env", json={**bad, "group_size": 2, "min_batch_allocation": 1.5}
    )
    assert r.status_code == 422 and ("body", "min_batch_allocation") in _detail_locs(r)


def test_bad_gzip_body_is_400(fresh: Api):
    for body in (b"not gzip at all", gzip.compress(b'{"tokens": [[1]]}')[:-6]):
        r = fresh.client.post(
            "/scored_data",
            content=body,
            headers={"Content-Encoding": "gzip", "Content-Type": "application/json"},
        )
        assert r.status_code == 400 and r.text == "Invalid gzip payload"


def test_body_over_max_request_mb_is_413(fresh: Api):
    big = group(4, seq_len=60_000)  # ~2.5 MB of JSON, limit is 1 MiB
    r = fresh.client.post("/scored_data", json=big)
    assert r.status_code == 413 and "max-request-mb" in r.json()["detail"]
    bomb = gzip.compress(json.dumps(big).encode())
    assert len(bomb) < 2**20
    r = fresh.client.post(
        "/scored_data",
        content=bomb,
        headers={"Content-Encoding": "gzip", "Content-Type": "application/json"},
    )
    assert r.status_code == 413
    chunked = fresh.client.post(
        "/scored_data",
        content=iter([json.dumps(big).encode()]),
        headers={"Content-Type": "application/json"},
    )
    assert chunked.status_code == 413
    assert fresh.client.get("/status").json()["queue_size"] == 0


def test_full_queue_answers_503_with_retry_after_until_drained(fresh: Api):
    fresh.start_trainer(batch_size=4)
    payload = group(4, seq_len=10_000)  # ~0.4 MB; the queue budget is 2 MiB
    statuses = [fresh.client.post("/scored_data", json=payload).status_code for _ in range(8)]
    assert statuses[0] == 200 and statuses[-1] == 503
    accepted = statuses.count(200)
    r = fresh.client.post("/scored_data", json=payload)
    assert r.status_code == 503 and r.headers["Retry-After"] == "1" and "full" in r.json()["detail"]
    assert fresh.client.post("/scored_data_list", json=[payload]).status_code == 503
    assert fresh.client.get("/status").json()["queue_size"] == accepted
    assert fresh.client.get("/batch").json()["batch"] is not None
    assert fresh.client.post("/scored_data", json=payload).status_code == 200


def test_api_key_is_required_everywhere_but_root_and_health(tmp_path):
    ctx, url = start_api(tmp_path, "--api-key", "s3cret")
    with ctx, httpx.Client(base_url=url, timeout=10) as c:
        assert c.get("/").status_code == 200 and c.get("/health").status_code == 200
        for method, path in (
            ("GET", "/batch"),
            ("GET", "/status"),
            ("POST", "/scored_data"),
            ("GET", "/metrics"),
            ("GET", "/openapi.json"),
            ("GET", "/reset_data"),
        ):
            r = c.request(method, path, json=group(4))
            assert r.status_code == 401, path
            assert r.headers["www-authenticate"] == "Bearer"
        wrong = c.get("/status", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        good = {"Authorization": "Bearer s3cret"}
        assert c.post("/scored_data", json=group(4), headers=good).json() == {"status": "received"}
        assert c.get("/status", headers=good).json()["queue_size"] == 1


def test_api_key_is_read_from_environment(monkeypatch):
    monkeypatch.setenv("ATROPOS_API_KEY", "from-env")
    assert parse_settings([]).api_key == "from-env"
    assert parse_settings(["--api-key", "flag"]).api_key == "flag"


def test_default_bind_is_loopback():
    assert parse_settings([]).host == "127.0.0.1"


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--port", "70000"], "--port"),
        (["--gzip-level", "0"], "--gzip-level"),
        (["--max-queue-mb", "0"], "--max-queue-mb"),
        (["--max-staleness", "-1"], "--max-staleness"),
    ],
)
def test_run_api_value_out_of_bounds_exits_2_naming_the_flag(argv, needle, capsys):
    with pytest.raises(SystemExit) as info:
        parse_settings(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("run-api: error: invalid value: ") and needle in err


def test_run_api_bad_environment_variable_exits_2_naming_it(monkeypatch, capsys):
    monkeypatch.setenv("ATROPOS_MAX_REQUEST_MB", "-5")
    with pytest.raises(SystemExit) as info:
        parse_settings([])
    assert info.value.code == 2
    assert "--max-request-mb (or ATROPOS_MAX_REQUEST_MB)" in capsys.readouterr().err


def test_run_api_console_exits_2_with_one_line_on_a_bad_port(capsys):
    """``main`` (the console entry): one line on stderr, exit 2, nothing raised past it.
    (tests/api/test_hardening.py::test_api_key_file_works_for_a_real_server is run-api's
    process smoke.)"""
    from atroposlib.cli.run_api import main

    with pytest.raises(SystemExit) as info:
        main(["--port", "70000"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().splitlines() == [
        "run-api: error: invalid value: --port (or ATROPOS_PORT): "
        "Input should be less than or equal to 65535"
    ]


def test_public_bind_without_key_warns(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
):
    import atroposlib.cli.run_api as run_api

    monkeypatch.setattr(run_api.uvicorn, "run", lambda *a, **k: None)
    with caplog.at_level("INFO", logger=run_api.__name__):
        run_api.main(["--host", "0.0.0.0", "--port", "1"])
    assert any(
        r.levelname == "WARNING" and "WITHOUT an API key" in r.message for r in caplog.records
    )
    caplog.clear()
    with caplog.at_level("INFO", logger=run_api.__name__):
        run_api.main(["--host", "127.0.0.1", "--port", "1"])
    assert not any(r.levelname == "WARNING" for r in caplog.records)
    assert any("--host 0.0.0.0" in r.message for r in caplog.records)


def test_unusable_persist_path_exits_with_a_clear_error(tmp_path, caplog: pytest.LogCaptureFixture):
    import atroposlib.cli.run_api as run_api

    with caplog.at_level("ERROR", logger=run_api.__name__), pytest.raises(SystemExit) as info:
        run_api.main(["--persist", str(tmp_path), "--port", "1"])  # a directory, not a file
    assert info.value.code == 2
    assert any("persistence database" in r.message for r in caplog.records)


def test_uvicorn_import_string_app_reads_atropos_env(monkeypatch: pytest.MonkeyPatch):
    import atroposlib.api as api_pkg
    import atroposlib.api.server as server_mod

    monkeypatch.setenv("ATROPOS_MAX_QUEUE_MB", "3")
    monkeypatch.setattr(server_mod, "_app", None)
    app = api_pkg.app
    assert app is server_mod.app
    assert app.title == "AtroposLib API"
    assert app.atropos_store.max_queue_bytes == 3 * 2**20
    monkeypatch.setattr(server_mod, "_app", None)
