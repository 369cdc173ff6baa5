"""The hot path: one declaration per endpoint (handler and schema), answered nowhere else."""

from __future__ import annotations

import json

import pytest
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient

from atroposlib.api import APISettings, create_app
from atroposlib.api.fastpath import HOT_ENDPOINTS, openapi_paths
from atroposlib.api.models import ScoredData
from atroposlib.api.persistence import SqlitePersistence
from atroposlib.api.store import RolloutStore
from tests.api.store_helpers import REG, env_request

_HOT = {(e.method, e.path) for e in HOT_ENDPOINTS}


def test_the_hot_endpoints_have_no_fastapi_route():
    app = create_app(APISettings())
    routes = {
        (method, r.path) for r in app.routes if isinstance(r, APIRoute) for method in r.methods
    }
    assert _HOT == {
        ("POST", "/scored_data"),
        ("POST", "/scored_data_list"),
        ("GET", "/batch"),
        ("GET", "/status-env"),
    }
    assert not routes & _HOT


def test_the_schema_documents_each_hot_endpoint_as_a_route_would():
    schema = create_app(APISettings()).openapi()
    assert {(m.upper(), p) for p, ops in openapi_paths().items() for m in ops} == _HOT
    post = schema["paths"]["/scored_data"]["post"]
    body = post["requestBody"]["content"]["application/json"]["schema"]
    assert body == ScoredData.model_json_schema() and post["requestBody"]["required"] is True
    assert post["operationId"] == "scored_data_scored_data_post"
    listed = schema["paths"]["/scored_data_list"]["post"]["requestBody"]["content"]
    assert listed["application/json"]["schema"]["items"] == body
    batch = schema["paths"]["/batch"]["get"]
    assert [p["name"] for p in batch["parameters"]] == ["ack"]
    assert batch["responses"]["422"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/HTTPValidationError"
    }
    assert "HTTPValidationError" in schema["components"]["schemas"]
    json.dumps(schema)  # serialisable as /openapi.json


@pytest.mark.parametrize(
    ("method", "path", "allow"),
    [
        ("GET", "/scored_data", "POST"),
        ("PUT", "/batch", "GET"),
        ("GET", "/scored_data_list", "POST"),
    ],
)
def test_other_methods_on_a_hot_path_are_405_with_allow(method: str, path: str, allow: str):
    with TestClient(create_app(APISettings()), base_url="http://127.0.0.1") as client:
        answer = client.request(method, path)
    assert answer.status_code == 405 and answer.headers["allow"] == allow
    assert answer.json() == {"detail": "Method Not Allowed"}


@pytest.mark.parametrize(
    ("method", "path", "location"),
    [
        ("POST", "/scored_data/", "/scored_data"),
        ("GET", "/batch/?ack=x", "/batch?ack=x"),
        ("POST", "/scored_data_list/", "/scored_data_list"),
    ],
)
def test_a_hot_path_with_a_trailing_slash_is_redirected_as_a_route_would_be(
    method: str, path: str, location: str
):
    app = create_app(APISettings())
    with TestClient(app, base_url="http://127.0.0.1", follow_redirects=False) as client:
        answer = client.request(method, path, json={})
    assert answer.status_code == 307
    assert answer.headers["location"] == "http://127.0.0.1" + location


def test_a_post_is_committed_before_its_answer(tmp_path):
    """The one handler of /scored_data defers to the group commit and answers after it."""
    db = tmp_path / "api.db"
    store = RolloutStore(10**9, SqlitePersistence(db))
    store.register_trainer(REG)
    store.next_batch()
    store.register_env(env_request("a", group_size=REG.batch_size))
    n = REG.batch_size
    group = {"tokens": [[1, 2]] * n, "masks": [[1, 2]] * n, "scores": [1.0] * n, "env_id": 0}
    with TestClient(create_app(APISettings(), store), base_url="http://127.0.0.1") as client:
        assert client.post("/scored_data", json=group).json() == {"status": "received"}
        assert store.pending_ticket is None  # committed, not merely deferred
        on_disk = SqlitePersistence(db)
        assert len(on_disk.load().groups) == 1
        on_disk.close()
        served = client.get("/batch").json()
    assert (
        served["batch"][0]["tokens"] == group["tokens"] and served["step"] == REG.starting_step + 1
    )
