"""Poison groups at ingest: token ids a trainer cannot take are refused by a real run-api.

Ids below 0 or above int64 (in ``tokens`` and ``distill_token_ids``) are always refused,
and ids at or above the trainer's ``vocab_size`` once it registered one (an optional
``/register`` field; without it the original's behaviour holds). Every refusal is a 422
naming the field and index, on both group routes and both decoding paths, and counted.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.api.conftest import TRAINER, Api, group

INT64_OVER = 2**63  # 9223372036854775808
VOCAB = 2739


def _distill(size: int = 4, seq_len: int = 3, bad: int | None = None) -> dict:
    """A group with teacher rows; ``bad`` replaces the id at ``[1][2][0]``."""
    g = group(size, seq_len)
    ids = [[[1, 2] for _ in range(seq_len)] for _ in range(size)]
    if bad is not None:
        ids[1][2][0] = bad
    g["distill_token_ids"] = ids
    g["distill_logprobs"] = [[[-0.5, -1.5] for _ in range(seq_len)] for _ in range(size)]
    return g


def _with_token(bad: int) -> dict:
    """A group whose ``tokens[2][1]`` is ``bad`` (its mask keeps the id, as a real env's)."""
    g = group(4, 3)
    g["tokens"][2][1] = bad
    g["masks"][2][1] = bad
    return g


def _post(api: Api, payload: dict, many: bool) -> Any:
    if many:
        return api.client.post("/scored_data_list", json=[group(4, 3), payload])
    return api.client.post("/scored_data", json=payload)


def _loc(detail: list, many: bool, *loc: Any) -> None:
    want = ["body", *((1,) if many else ()), *loc]
    assert detail[0]["loc"] == want, detail  # (a poisoned mask is named after it)


@pytest.mark.parametrize("many", [False, True], ids=["scored_data", "scored_data_list"])
@pytest.mark.parametrize(
    "payload, loc",
    [
        (_with_token(INT64_OVER), ("tokens", 2, 1)),
        (_with_token(-7), ("tokens", 2, 1)),
        (_distill(bad=INT64_OVER), ("distill_token_ids", 1, 2, 0)),
        (_distill(bad=-1), ("distill_token_ids", 1, 2, 0)),
    ],
    ids=["token-above-int64", "token-negative", "distill-above-int64", "distill-negative"],
)
def test_ids_outside_int64_or_negative_are_refused_naming_field_and_index(
    fresh: Api, payload: dict, loc: tuple, many: bool
) -> None:
    fresh.start_trainer()
    r = _post(fresh, payload, many)
    assert r.status_code == 422, r.text
    _loc(r.json()["detail"], many, *loc)
    assert fresh.client.get("/status").json()["queue_size"] == 0


@pytest.mark.parametrize("many", [False, True], ids=["scored_data", "scored_data_list"])
@pytest.mark.parametrize(
    "payload, loc, value",
    [
        (_with_token(1_000_000), ("tokens", 2, 1), 1_000_000),
        (_with_token(VOCAB), ("tokens", 2, 1), VOCAB),
        (_distill(bad=1_000_000), ("distill_token_ids", 1, 2, 0), 1_000_000),
    ],
    ids=["token-1000000", "token-equal-to-vocab", "distill-1000000"],
)
def test_ids_at_or_above_the_registered_vocab_size_are_refused(
    fresh: Api, payload: dict, loc: tuple, value: int, many: bool
) -> None:
    fresh.start_trainer(vocab_size=VOCAB)
    before = _rejected(fresh)
    r = _post(fresh, payload, many)
    assert r.status_code == 422, r.text
    detail = r.json()["detail"]
    _loc(detail, many, *loc)
    assert f"is {value}" in detail[0]["msg"] and f"vocab_size {VOCAB}" in detail[0]["msg"]
    assert _rejected(fresh) == before + 1
    assert fresh.client.get("/status").json()["queue_size"] == 0
    # The highest id the trainer has is taken, on both decoding paths.
    for ok in (_with_token(VOCAB - 1), _distill(bad=VOCAB - 1)):
        assert _post(fresh, ok, many).status_code == 200


def test_without_vocab_size_large_ids_are_stored_as_the_original_stores_them(fresh: Api) -> None:
    r = fresh.client.post("/register", json=TRAINER)  # the original's fields only
    assert r.status_code == 200, r.text
    fresh.client.get("/batch")
    assert fresh.client.post("/scored_data", json=_with_token(1_000_000)).status_code == 200
    assert fresh.client.post("/scored_data", json=_distill(bad=10**12)).status_code == 200


@pytest.mark.parametrize("value", [0, -3, 2**63 + 1, "big", 1.5])
def test_a_bad_vocab_size_is_a_422_naming_it(fresh: Api, value: Any) -> None:
    r = fresh.client.post("/register", json={**TRAINER, "vocab_size": value})
    assert r.status_code == 422, r.text
    assert r.json()["detail"][0]["loc"] == ["body", "vocab_size"]


def test_the_vocab_size_survives_a_restart_with_persistence(tmp_path) -> None:
    from tests.api.conftest import start_api

    db = tmp_path / "api.db"
    for attempt in range(2):
        ctx, url = start_api(tmp_path, "--persist", str(db))
        with ctx as proc:
            api = Api(url, proc=proc)
            if attempt == 0:
                api.start_trainer(vocab_size=VOCAB)
            r = api.client.post("/scored_data", json=_with_token(VOCAB))
            assert r.status_code == 422, r.text
            assert api.client.post("/scored_data", json=_with_token(VOCAB - 1)).status_code == 200
            api.client.close()


def _rejected(api: Api) -> float:
    for line in api.client.get("/metrics").text.splitlines():
        if line.startswith('atropos_rejected_total{reason="invalid"}'):
            return float(line.split()[-1])
    raise AssertionError('no atropos_rejected_total{reason="invalid"} in /metrics')
