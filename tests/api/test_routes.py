"""run-api's routes: every endpoint is a route of the one router, documented as FastAPI writes it."""

from __future__ import annotations

import json

import pytest
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient

from atroposlib.api import APISettings, create_app
from atroposlib.api import routes as api_routes
from atroposlib.api.models import ScoredData
from atroposlib.api.persistence import SqlitePersistence
from atroposlib.api.store import RolloutStore
from tests.api.store_helpers import REG, env_request

_ENDPOINTS = {
    ("GET", "/"),
    ("GET", "/health"),
    ("GET", "/metrics"),
    ("POST", "/register"),
    ("POST", "/register-env"),
    ("POST", "/disconnect-env"),
    ("GET", "/wandb_info"),
    ("GET", "/info"),
    ("POST", "/scored_data"),
    ("POST", "/scored_data_list"),
    ("GET", "/batch"),
    ("POST", "/batch/ack"),
    ("GET", "/status-env"),
    ("GET", "/latest_example"),
    ("GET", "/status"),
    ("POST", "/reset_data"),
    ("GET", "/reset_data"),
}


def _methods_and_paths(routes) -> set[tuple[str, str]]:
    return {(m, r.path) for r in routes if isinstance(r, APIRoute) for m in r.methods}


def test_every_endpoint_is_a_route_of_the_one_router():
    assert _methods_and_paths(api_routes.router.routes) == _ENDPOINTS
    app = create_app(APISettings())
    assert _methods_and_paths(app.routes) == _ENDPOINTS  # the router's, and none of its own
    documented = {(m.upper(), p) for p, ops in app.openapi()["paths"].items() for m in ops}
    assert documented == _ENDPOINTS - {("GET", "/reset_data")}  # the old GET form is unlisted


def test_the_schema_documents_the_raw_body_endpoints_as_a_route_would():
    schema = create_app(APISettings()).openapi()
    post = schema["paths"]["/scored_data"]["post"]
    body = post["requestBody"]["content"]["application/json"]["schema"]
    model = ScoredData.model_json_schema()
    # As FastAPI writes any model's schema (its OpenAPI model drops null defaults).
    assert set(body["properties"]) == set(model["properties"]) == set(ScoredData.model_fields)
    assert body["required"] == model["required"] and body["title"] == model["title"]
    assert post["requestBody"]["required"] is True
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
def test_other_methods_on_a_route_are_405_with_allow(method: str, path: str, allow: str):
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
def test_a_path_with_a_trailing_slash_is_redirected(method: str, path: str, location: str):
    app = create_app(APISettings())
    with TestClient(app, base_url="http://127.0.0.1", follow_redirects=False) as client:
        answer = client.request(method, path, json={})
    assert answer.status_code == 307
    assert answer.headers["location"] == "http://127.0.0.1" + location


def test_a_post_is_committed_before_its_answer(tmp_path):
    """The route of /scored_data defers to the group commit and answers after it."""
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
