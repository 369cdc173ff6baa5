"""Schemathesis over the running server's own OpenAPI schema: no input yields a 5xx."""

from __future__ import annotations

from typing import Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from tests.api.conftest import TRAINER, start_api


@pytest.fixture(scope="module")
def api_schema(tmp_path_factory: pytest.TempPathFactory) -> Iterator[schemathesis.BaseSchema]:
    """A persisting server with a registered trainer and env, and its schema."""
    tmp = tmp_path_factory.mktemp("schemathesis")
    ctx, url = start_api(tmp, "--persist", str(tmp / "api.db"), "--max-request-mb", "1")
    with ctx:
        import httpx

        with httpx.Client(base_url=url, timeout=10) as c:
            c.post("/register", json=TRAINER)
            c.get("/batch")
            c.post(
                "/register-env",
                json={"max_token_length": 64, "desired_name": "s", "weight": 1.0, "group_size": 4},
            )
        yield schemathesis.openapi.from_url(f"{url}/openapi.json")


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_input_makes_the_server_answer_5xx(
    api_schema: schemathesis.BaseSchema, mode: GenerationMode
) -> None:
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert len(operations) >= 14
    for operation in operations:
        if mode is GenerationMode.NEGATIVE and not (operation.body or operation.query):
            continue  # nothing to make invalid

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(
            max_examples=8, deadline=None, suppress_health_check=list(HealthCheck), database=None
        )
        def call(case: schemathesis.Case) -> None:
            case.call_and_validate(checks=[not_a_server_error], timeout=10)

        call()
