"""BaseEnv hooks and the pieces of the send path that need no network."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from atroposlib.envs.base import BaseEnv, BaseEnvConfig, EvalHandlingEnum, ScoredDataGroup
from atroposlib.envs.server_handling.server_baseline import APIServerConfig

SERVER = APIServerConfig(base_url="http://127.0.0.1:9/v1", model_name="m", health_check=False)


class ByteTokenizer:
    """Decodes byte-valued token ids (enough for message synthesis and rollout tables)."""

    def decode(self, ids):
        return bytes(i % 256 for i in ids).decode("latin-1")


class ItemEnv(BaseEnv):
    name = "item_env"

    def __init__(self, *args, results=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.results = list(results or [])
        self.tokenizer = ByteTokenizer()

    async def setup(self):
        pass

    async def get_next_item(self):
        return "item"

    async def collect_trajectory(self, item):
        return self.results.pop(0)

    async def evaluate(self, *args, **kwargs):
        pass


def make_env(**config) -> ItemEnv:
    config.setdefault("use_wandb", False)
    env = ItemEnv(BaseEnvConfig(**config), [SERVER])
    return env


def group(n=4, scores=None, length=5, **extra) -> ScoredDataGroup:
    g = ScoredDataGroup(
        tokens=[[65 + j] * length for j in range(n)],
        masks=[[-100] + [65 + j] * (length - 1) for j in range(n)],
        scores=scores if scores is not None else [float(j) for j in range(n)],
    )
    g.update(extra)
    return g


def test_config_defaults_match_the_original():
    cfg = BaseEnvConfig()
    assert (
        cfg.group_size,
        cfg.max_num_workers,
        cfg.max_eval_workers,
        cfg.max_num_workers_per_node,
    ) == (4, -1, 16, 8)
    assert (cfg.steps_per_eval, cfg.max_token_length, cfg.eval_handling) == (
        100,
        2048,
        EvalHandlingEnum.STOP_TRAIN,
    )
    assert (cfg.batch_size, cfg.max_batches_offpolicy, cfg.total_steps, cfg.worker_timeout) == (
        -1,
        3,
        1000,
        600,
    )
    assert cfg.rollout_server_url == "http://localhost:8000" and cfg.use_wandb is True
    assert cfg.tokenizer_name == "NousResearch/DeepHermes-3-Llama-3-3B-Preview"
    assert (
        cfg.num_rollouts_to_keep,
        cfg.num_rollouts_per_group_for_logging,
        cfg.min_items_sent_before_logging,
    ) == (32, 1, 2)
    assert (
        cfg.min_batch_allocation is None
        and cfg.wandb_name is None
        and cfg.ensure_scores_are_not_same
    )
    for name, info in BaseEnvConfig.model_fields.items():
        assert info.description, f"{name} has no description"


@pytest.mark.parametrize(
    "field, value",
    [("reasoning_effort", "huge"), ("max_reasoning_tokens", 10), ("min_batch_allocation", 1.5)],
)
def test_config_rejects_out_of_range_values(field, value):
    with pytest.raises(ValueError, match=field):
        BaseEnvConfig(**{field: value})


async def test_default_collect_trajectories_assembles_a_group():
    items = [
        (
            {
                "tokens": [1, 2],
                "masks": [-100, 2],
                "scores": 1.0,
                "group_overrides": {"a": 1},
                "overrides": {"temperature": 0.5},
            },
            ["b1"],
        ),
        (
            {
                "tokens": [3, 4],
                "masks": [-100, 4],
                "scores": 0.0,
                "group_overrides": {"b": 2},
                "overrides": {"temperature": 0.7},
            },
            [],
        ),
    ]
    env = make_env(group_size=2, results=None)
    env.results = items
    scored, backlog = await env.collect_trajectories("x")
    assert scored["tokens"] == [[1, 2], [3, 4]] and scored["scores"] == [1.0, 0.0]
    assert scored["masks"] == [[-100, 2], [-100, 4]]
    assert scored["overrides"] == [{"temperature": 0.5}, {"temperature": 0.7}]
    assert scored["group_overrides"] == {"a": 1, "b": 2}
    assert backlog == ["b1"]


async def test_collect_trajectory_returning_a_non_dict_raises():
    env = make_env(group_size=1)
    env.results = [(["not", "a", "dict"], [])]
    with pytest.raises(ValueError, match="ScoredDataItem"):
        await env.collect_trajectories("x")


async def test_drops_are_logged_and_counted_per_reason(tmp_path, caplog):
    env = make_env(group_size=4, data_path_to_save_groups=str(tmp_path / "g.jsonl"))
    env.max_token_len = 10
    await env.handle_send_to_api(group(n=3), do_send_to_api=False)
    await env.handle_send_to_api(group(scores=[1.0] * 4), do_send_to_api=False)
    await env.handle_send_to_api(group(length=10), do_send_to_api=False)
    await env.handle_send_to_api(None, do_send_to_api=False)
    await env.handle_send_to_api(
        [group(), group(n=2, group_overrides={"group_size": 2})], do_send_to_api=False
    )
    assert env.items_rejected == {
        "wrong_group_size": 1,
        "scores_all_equal": 1,
        "max_token_len_exceeded": 1,
    }
    assert "wrong_group_size" in caplog.text and "max_token_len_exceeded" in caplog.text
    env.jsonl_writer.close()
    lines = [json.loads(line) for line in (tmp_path / "g.jsonl").read_text().splitlines()]
    assert len(lines) == 2
    assert all(line["ref_logprobs"] is None and line["overrides"] is None for line in lines)
    metrics = env.perf_metrics()
    assert metrics["train/items_rejected"] == 3
    assert metrics["train/items_rejected/scores_all_equal"] == 1


async def test_long_sequences_kept_when_not_aborting_and_unknown_max_len():
    env = make_env(group_size=4)
    env.max_token_len = 3
    env.config.data_path_to_save_groups = None
    await env.handle_send_to_api(
        group(length=10), do_send_to_api=False, abort_on_any_max_length_exceeded=False
    )
    env.max_token_len = -1
    await env.handle_send_to_api(group(length=10), do_send_to_api=False)
    assert not env.items_rejected
    assert env.completion_lengths == [9] * 8


async def test_include_messages_synthesises_user_messages():
    env = make_env(group_size=4, include_messages=True)
    g = group()
    await env.handle_send_to_api(g, do_send_to_api=False)
    assert g["messages"][0] == [{"role": "user", "content": "AAAAA"}]


async def test_sending_without_a_serve_loop_is_an_error():
    env = make_env(group_size=4)
    with pytest.raises(RuntimeError, match="serve loop"):
        await env.handle_send_to_api(group())


def test_jsonl_writer_never_overwrites(tmp_path):
    from atroposlib.envs.files import JsonlGroupWriter

    (tmp_path / "g.jsonl").write_text("old\n")
    (tmp_path / "g_1.jsonl").write_text("old\n")
    writer = JsonlGroupWriter(tmp_path / "g.jsonl")
    writer.write({"x": 1})
    writer.close()
    assert writer.path.name == "g_2.jsonl" and (tmp_path / "g.jsonl").read_text() == "old\n"


async def test_evaluate_log_writes_metrics_and_samples(tmp_path):
    env = make_env(data_dir_to_save_evals=str(tmp_path / "evals"), max_token_length=99)
    await env.evaluate_log(
        {"eval/acc": 0.25},
        start_time=100.0,
        end_time=102.5,
        generation_parameters={"temperature": 0.6},
        samples=[{"q": 1}, {"q": 2}],
    )
    doc = json.loads((tmp_path / "evals" / "metrics.json").read_text())
    assert doc["results"] == {
        "atropos|item_env_eval|0": {"eval/acc": 0.25},
        "all": {"eval/acc": 0.25},
    }
    general = doc["config_general"]
    assert general["model_name"] == "m" and general["total_evaluation_time_seconds"] == "2.5"
    assert general["generation_parameters"] == {"max_new_tokens": 99, "temperature": 0.6}
    samples = (tmp_path / "evals" / "samples.jsonl").read_text().splitlines()
    assert [json.loads(s) for s in samples] == [{"q": 1}, {"q": 2}]


async def test_evaluate_log_without_dir_writes_nothing(tmp_path, caplog, monkeypatch):
    monkeypatch.chdir(tmp_path)
    env = make_env()
    await env.evaluate_log({"eval/acc": 1.0})
    assert "data_dir_to_save_evals is not set" in caplog.text
    assert list(tmp_path.iterdir()) == []


def test_checkpoint_round_trip(tmp_path):
    env = make_env()
    env.checkpoint_dir, env.wandb_prepend = str(tmp_path), "item_env_0"
    env.save_checkpoint(10)  # data=None is a no-op
    assert not (tmp_path / "env_checkpoints").exists()
    env.save_checkpoint(10, {"iter": 42})
    path = tmp_path / "env_checkpoints" / "item_env_0" / "step-10.json"
    assert json.loads(path.read_text()) == {"iter": 42}
    other = make_env()
    other.checkpoint_dir, other.wandb_prepend, other.curr_step = str(tmp_path), "item_env_0", 13
    other.load_checkpoint()  # newest at or before step 13
    assert other.iter == 42


async def test_failed_collect_is_timed_as_failure_and_does_not_crash():
    env = make_env(group_size=1)

    async def boom(item):
        raise RuntimeError("model exploded")

    env.collect_trajectories = boom
    key = env.runner.pool.spawn("x", env.handle_env)
    await env.runner.pool.wait_all(5)
    assert len(env.failed_task_duration) == 1 and not env.succeeded_task_duration
    assert key not in env.running_items


def test_wandb_off_never_imports_it_and_offline_run_gets_prefixed_keys(tmp_path):
    code = f"""
import asyncio, sys
sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})
sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
from tests.envs.test_base_hooks import make_env, group
off = make_env(group_size=4)
asyncio.run(off.handle_send_to_api(group(), do_send_to_api=False))
asyncio.run(off.wandb_log({{"x": 1}}))
assert "wandb" not in sys.modules, "use_wandb=False imported wandb"
from atroposlib.envs import wandb_logging as wl
import wandb
env = make_env(group_size=4, use_wandb=True)
env.wandb_prepend = "item_env_0"
env.max_token_len = 100
wl.init_run("proj", "grp", wl.run_name("item_env"), env.config.model_dump(mode="json"))
asyncio.run(env.handle_send_to_api(group(), do_send_to_api=False))
env.task_duration = [0.1, 0.3]
asyncio.run(env.wandb_log({{"train/percent_correct": 0.5}}))
wandb.finish()
"""
    env = {
        **__import__("os").environ,
        "WANDB_MODE": "offline",
        "WANDB_DIR": str(tmp_path),
        "WANDB_SILENT": "true",
    }
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    runs = list(tmp_path.rglob("*.wandb"))
    assert runs, "no offline run was written"
    data = runs[0].read_bytes()
    for key in (
        b"item_env_0_train/percent_correct",
        b"item_env_0_train/completion_lengths",
        b"item_env_0_train_perf/task_duration_mean",
        b"item_env_0_train/rollouts",
        b"item_env_0_train/items_rejected",
        b"server/",
    ):
        assert key in data, key


async def test_error_while_sending_is_logged_and_counted(caplog):
    env = make_env(group_size=4, include_messages=True)

    class BrokenTokenizer:
        def decode(self, ids):
            raise RuntimeError("no tokenizer")

    env.tokenizer = BrokenTokenizer()

    async def one_group(item):
        return group(), []

    env.collect_trajectories = one_group
    env.runner.pool.spawn("x", env.handle_env)
    await env.runner.pool.wait_all(5)
    assert env.items_rejected["send_error"] == 1
    assert "group is dropped" in caplog.text
