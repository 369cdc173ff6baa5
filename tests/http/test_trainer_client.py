"""One trainer-side client of the rollout API (``atroposlib/http/trainer_client.py``), used by
the example trainer, the tools and the tests' fake trainer; against a real ``run-api``."""

from __future__ import annotations

import inspect
from pathlib import Path

import httpx
import pytest

import atroposlib.frontend.api_client as tools_client
import atroposlib.testing.trainer as fake_trainer
import example_trainer.api as trainer_api
from atroposlib.http import trainer_client
from atroposlib.http.trainer_client import (
    RolloutAPIError,
    RolloutAPIUnreachable,
    TrainerAPIClient,
    registration_body,
)
from atroposlib.testing.ports import free_port
from tests.api.conftest import Api, group, start_api

USERS = (tools_client, trainer_api, fake_trainer)


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory):
    """One run-api for the module; each test resets it."""
    ctx, url = start_api(tmp_path_factory.mktemp("api"))
    with ctx as proc:
        server = Api(url, proc=proc)
        yield server
        server.client.close()


def test_only_the_shared_client_builds_register_and_the_three_users_stand_on_it():
    assert '"/register"' in inspect.getsource(trainer_client)
    for module in USERS:
        source = Path(inspect.getfile(module)).read_text()
        assert '/register"' not in source, module.__name__  # no URL of the route
        assert "httpx.post(" not in source and "httpx.get(" not in source, module.__name__
    assert issubclass(tools_client.TrainerClient, TrainerAPIClient)
    assert issubclass(trainer_api.BatchClient, TrainerAPIClient)
    assert isinstance(fake_trainer.FakeTrainer(1, 2, 3).client, TrainerAPIClient)
    assert tools_client.ApiError is trainer_api.AtroposAPIError is RolloutAPIError


def test_the_three_registration_bodies_keep_their_fields():
    assert tools_client.registration(16, 2048, 100) == registration_body(
        16,
        2048,
        100,
        wandb_group="test",
        wandb_project="test",
        checkpoint_dir="checkpoints",
        save_checkpoint_interval=10,
    )
    assert fake_trainer.trainer_registration(4)["save_checkpoint_interval"] == -1
    assert set(fake_trainer.trainer_registration(4)) == set(registration_body(4, 1, 1))


def test_no_answer_is_unreachable_with_the_hint_and_still_an_httpx_error():
    client = TrainerAPIClient(f"http://127.0.0.1:{free_port()}", timeout=2, hint="Start it.")
    with pytest.raises(RolloutAPIUnreachable, match=r"GET /info: cannot reach .* Start it\.$"):
        client.info()
    with pytest.raises(httpx.HTTPError):  # what callers that retry on httpx's errors catch
        client.get_batch()


def _two_batches(api: Api) -> None:
    api.reset()
    TrainerAPIClient(api.base_url).register(registration_body(2, 512, 10))
    api.client.get("/batch")  # the first poll lets environments register
    env = api.register_env(group_size=2)
    for base in (1, 2):
        assert api.client.post("/scored_data", json=group(2, env_id=env, base=base)).is_success


def _tag(batch: list) -> int:
    return batch[0]["tokens"][0][0] // 1000


def test_pulls_acknowledge_the_last_batch_and_a_new_trainer_gets_the_pending_one(live):
    _two_batches(live)
    first = TrainerAPIClient(live.base_url)
    assert _tag(first.get_batch()) == 1
    # Not acknowledged yet: a trainer restarted before training on it gets it again.
    again = TrainerAPIClient(live.base_url)
    assert _tag(again.get_batch()) == 1 and again.last_batch_id == first.last_batch_id
    assert _tag(again.get_batch()) == 2  # asking again acknowledged batch 1
    again.acknowledge()
    assert again.get_batch() is None
    assert live.client.get("/status").json()["queue_size"] == 0


def test_a_tool_leaves_the_first_acknowledgement_to_the_api_as_the_originals_did(live):
    _two_batches(live)
    assert _tag(TrainerAPIClient(live.base_url).get_batch()) == 1
    tool = tools_client.TrainerClient(live.base_url)
    try:
        assert _tag(tool.get_batch()) == 2  # its plain GET /batch took batch 1 as received
    finally:
        tool.close()


def test_an_error_answer_names_the_route_and_the_status(live):
    live.reset()
    with pytest.raises(RolloutAPIError, match=r"POST /register: HTTP 422"):
        TrainerAPIClient(live.base_url).register({"batch_size": "many"})
