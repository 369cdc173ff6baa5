"""``POST /batch/ack`` parses batch ids strictly: only the form the server writes.

Before, ``isdigit()`` let '²' through to ``int()`` (500), a 5,000-digit number hit
Python's int-string limit (500), and ``<token>-01`` or ``<token>-١`` answered
"already acknowledged" while batch 1 was still pending.
"""

from __future__ import annotations

import pytest

from tests.api.conftest import Api, group


def _pending_batch(api: Api) -> str:
    c = api.client
    api.start_trainer(batch_size=4)
    env = api.register_env(group_size=4)
    for tag in (1, 2):
        assert c.post("/scored_data", json=group(4, env_id=env, base=tag)).status_code == 200
    return c.get("/batch", params={"ack": ""}).json()["batch_id"]


_ARABIC_INDIC = str.maketrans("0123456789", "٠١٢٣٤٥٦٧٨٩")
_SUPERSCRIPT = str.maketrans("0123456789", "⁰¹²³⁴⁵⁶⁷⁸⁹")


@pytest.mark.parametrize(
    "form",
    [
        lambda n: f"0{n}",
        lambda n: f"{n}".translate(_ARABIC_INDIC),
        lambda n: f"{n}".translate(_SUPERSCRIPT),
        lambda n: f"{n} ",
        lambda n: f"+{n}",
        lambda n: "0",
        lambda n: "9" * 5000,
        lambda n: "1" * 19,
    ],
    ids=["leading zero", "arabic-indic", "superscript", "space", "plus", "zero", "5000", "19"],
)
def test_non_canonical_batch_ids_are_404_and_leave_the_batch_pending(fresh: Api, form):
    batch_id = _pending_batch(fresh)
    token, _, number = batch_id.rpartition("-")
    r = fresh.client.post("/batch/ack", json={"batch_id": f"{token}-{form(int(number))}"})
    assert r.status_code == 404, r.text
    assert "unknown batch_id" in r.json()["detail"] and len(r.json()["detail"]) < 300
    assert fresh.client.get("/status").json()["unacknowledged_batch"] == batch_id
    ack = fresh.client.post("/batch/ack", json={"batch_id": batch_id}).json()
    assert ack["status"] == "acknowledged"
    again = fresh.client.post("/batch/ack", json={"batch_id": batch_id}).json()
    assert again["status"] == "already acknowledged"


def test_ids_that_are_not_strings_are_4xx_not_500(fresh: Api):
    _pending_batch(fresh)
    for literal in ("1" * 5000, "null", '["a"]', '{"a": 1}'):
        r = fresh.client.post(
            "/batch/ack",
            content='{"batch_id": ' + literal + "}",
            headers={"Content-Type": "application/json"},
        )
        assert 400 <= r.status_code < 500, (literal[:20], r.status_code, r.text[:200])
