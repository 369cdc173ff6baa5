"""Repository-wide test configuration: offline, no W&B network, shared fixtures."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Dict, Iterator

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.pop("ATROPOS_API_KEY", None)
os.environ.pop("ATROPOS_PROXY_URL", None)

from atroposlib.testing.ports import free_port  # noqa: E402
from tests.fake_servers import FakeServer, fake_servers  # noqa: E402

# Per-file times (.cache/test-times.json) and the default tier's budget (make test's --budget).
pytest_plugins = ["tests._timing", "pytester"]


@pytest.fixture
def port() -> int:
    """A free TCP port on 127.0.0.1."""
    return free_port()


@pytest.fixture(scope="session")
def fake_pool() -> Iterator[list[FakeServer]]:
    """Five fake inference servers (processes) with 5 ms latency, started together and
    shared by the server-layer and proxy tests.

    Servers 0-2 are never reconfigured for long; 3-4 are the failover tests' pair.
    """
    with fake_servers(5, "--latency-ms", "5") as servers:
        yield servers


@pytest.fixture(scope="session")
def rollout_api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One in-memory ``run-api`` process per test session (per xdist worker), shared by the
    tests that need a plain one; each resets it first (``rollout_api.reset()``).

    A :class:`~atroposlib.testing.api.RunningApi`; tests that need other flags start their
    own with :func:`~atroposlib.testing.api.running_api`.
    """
    from atroposlib.testing.api import running_api

    with running_api(tmp_path_factory.mktemp("rollout_api") / "api.log") as api:
        yield api


@pytest.fixture(scope="session")
def tokenizer() -> Any:
    """The offline tiny tokenizer (ChatML template, eos <|im_end|>)."""
    from atroposlib.tiny_model import load_tiny_tokenizer

    return load_tiny_tokenizer()


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """Directory of the offline tiny causal LM + tokenizer (built once, cached on disk)."""
    from atroposlib.tiny_model import ensure_tiny_model

    return Path(ensure_tiny_model())


@pytest.fixture(scope="session")
def serve_model(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Dict[str, str]]:
    """``{"base_url", "model"}`` of one running ``atropos-serve-model`` on the tiny model
    (seed 0), shared by every test of the session that asks for it."""
    from atroposlib.testing.launch import serve_model_cmd
    from atroposlib.testing.processes import running_process

    port = free_port()
    log = tmp_path_factory.mktemp("serve_model") / "serve.log"
    cmd = serve_model_cmd(tiny_model_dir, port, "--seed", "0")
    with running_process(
        cmd, health_url=f"http://127.0.0.1:{port}/health", timeout=180, log_path=log
    ):
        yield {"base_url": f"http://127.0.0.1:{port}/v1", "model": str(tiny_model_dir)}


# The second tier (make test-tier2): full stacks, floods, real vLLM, multi-node rehearsals.
# `make test` runs `-m "not tier2"` under its time budget. These markers put a test there too.
TIER2_IMPLIED_BY = ("slow", "vllm", "multinode", "slurm")


# Files and tests of the second tier, by node-id prefix, with their reason. Their seconds are
# the per-file report's (.cache/test-times.json) on a loaded 2-core machine, 2026-11-28.
TIER2_TESTS = (
    # full stacks: atropos-grpo-run / torchrun with run-api, serve-model and environments
    "tests/example_trainer/test_supervision.py",  # 270 s: three torchrun runs, ended three ways
    "tests/example_trainer/test_e2e.py",  # 150 s: the one-command run, and the launcher killed twice
    "tests/example_trainer/test_grad_parity.py",  # 100 s: two torchrun ranks vs one process
    "tests/example_trainer/test_distributed.py",  # 55 s: the same loss curve on two processes
    "tests/envs/test_async_versions.py",  # 35 s: a trainer, serve-model and an environment
    "tests/envs/test_serve_loop.py",  # 30 s: no group lost across 503s and an API restart
    # server restarts
    "tests/example_trainer/test_sync_and_api.py::test_lora_restart_serves_the_merged_adapter",  # 50 s
    "tests/example_trainer/test_sync_and_api.py::test_restart_mode_restarts_a_real_server",  # 50 s
    "tests/example_trainer/test_original_interface.py::test_vllm_manager_functions_over_a_real_server",
    "tests/environments/test_textarena_opponent.py::test_process_mode_against_a_second_serve",
    "tests/environments/test_gsm8k_teacher_distill.py",  # 18 s: a second serve-model as teacher
    "tests/proxy/test_proxy_abandoned.py",  # 28 s: its own slot-limited serve-model
    "tests/compat/test_verifiers_server.py",  # 32 s: the original's verifiers env, in processes
    # long demos: the README's and the tutorial's commands run as written
    "tests/docs/test_readme_commands.py",  # 85 s
    "tests/docs/test_tutorial.py",  # 40 s
    # processes started to time out or hang, and a browser
    "tests/environments/test_reasoning_gym.py::test_items_are_the_same_in_processes_with_",
    "tests/environments/test_reasoning_gym.py::test_generator_pool_raises_on_a_failing_call",
    "tests/environments/test_textarena_workers.py::test_games_hung_in_c_end_at_the_limit",
    "tests/environments/test_text_game_steps.py::test_games_stuck_in_c_stall_nothing",
    "tests/compat/test_env_files.py::test_env_stops_after_max_server_downtime",
    "tests/proxy/test_proxy_body_timeout.py",  # 20 s: bodies that trickle to a timeout
    "tests/serving/test_swap_in_place.py::test_in_place_loader_holds_one_tensor_at_a_time",
    "tests/cli/test_view_run.py::test_file_mode_page_shows_group_text_and_score_in_chromium",
    # the slowest files left after the above on a fresh clone (590 s default tier, load ~1,
    # 2026-11-28): each starts its own processes (environments, servers, a Gradio app)
    "tests/compat/test_env_files.py",  # 44 s: the original's env files run as processes
    "tests/environments/test_verifiers_v1.py",  # 26 s: verifiers tasksets through the proxy
    "tests/proxy/test_proxy_hostile.py",  # 25 s: hostile clients against the proxy
    "tests/envs/test_sampling_record.py",  # 21 s: environments against serve-model
    "tests/cli/test_view_run.py",  # 20 s: the Gradio viewer
    "tests/serving/test_weight_check.py",  # 15 s: checkpoints refused by a real server
    "tests/api/test_schemathesis.py",  # 13 s: property-based requests to run-api
    "tests/api/test_disk_full.py",  # 12 s: run-api on a full file system
    "tests/api/test_poison.py::test_the_vocab_size_survives_a_restart",  # 16 s: run-api twice
    "tests/example_trainer/test_poison_groups.py::test_poison_batches_leave_a_run_training",  # 15 s: run-api, trainer restarted twice
    "tests/serving/test_fuzz.py",  # property-based requests to a serve-model of its own
    "tests/serving/test_body_timeout.py",  # 10 s: bodies that trickle to a timeout
    "tests/utils/test_pipelining_bound.py",  # 10 s: connections whose answers are not taken
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if any(item.get_closest_marker(name) for name in TIER2_IMPLIED_BY) or any(
            item.nodeid.startswith(prefix) for prefix in TIER2_TESTS
        ):
            item.add_marker(pytest.mark.tier2)
