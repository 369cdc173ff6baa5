"""The 403 for a state-changing GET sent by a browser names endpoints that exist.

Before, a browser ``GET /batch`` was told to "use POST /batch", which does not exist.
"""

from __future__ import annotations

import re

import pytest

from tests.api.conftest import Api


@pytest.mark.parametrize("path", ["/batch", "/reset_data"])
def test_browser_get_refusal_names_only_real_endpoints(fresh: Api, path: str):
    r = fresh.client.get(path, headers={"Sec-Fetch-Site": "cross-site"})
    assert r.status_code == 403
    detail = r.json()["detail"]
    named = re.findall(r"\b(GET|POST) (/[\w/-]*)", detail.split("refused:", 1)[1])
    assert named, detail
    schema = fresh.client.get("/openapi.json").json()["paths"]
    for method, endpoint in named:
        assert method.lower() in schema.get(endpoint, {}), (method, endpoint, detail)
