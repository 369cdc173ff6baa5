"""``EvalBase.__call__(server_manager)`` as eval files written for the original use it: items run
concurrently under a progress bar, one printed line ``{ClassName}@{pass_at_n}[:{samples}]
metrics: {...}``, ``evaluate_log`` called with that task name and the instance's
``eval_dir``/``verbose``, and the metrics dict returned. Failed items and the samples stay
readable as attributes."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import pytest

import atroposlib.envs.eval as eval_mod
from atroposlib.envs.eval import EvalBase


class Manager:
    """A server manager whose chat answers echo the last message."""

    def __init__(self) -> None:
        self.servers = [SimpleNamespace(config=SimpleNamespace(model_name="echo-model"))]
        self.requests: list[dict[str, Any]] = []

    async def chat_completion(self, **kwargs: Any) -> str:
        self.requests.append(kwargs)
        return kwargs["messages"][-1]["content"]


class Arith(EvalBase):
    def setup_data(self):
        return ["4", "5", "4"]

    async def run_item(self, server, data_item):
        # Every item waits until all have started: passes only when they run concurrently.
        self.started += 1
        if self.started == len(self.data):
            self.all_started.set()
        await asyncio.wait_for(self.all_started.wait(), 5)
        answer = await self.chat_completion(server, [{"role": "user", "content": data_item}])
        ok = answer == "4"
        return {"accuracy": float(ok)}, [{"item": data_item, "ok": ok}]


def arith(**kwargs: Any) -> Arith:
    env = Arith(**kwargs)
    env.started = 0
    env.all_started = asyncio.Event()
    return env


async def test_call_prints_one_line_and_returns_the_metrics_dict(capsys):
    env = arith()
    metrics = await env(Manager())
    assert metrics == {"accuracy": pytest.approx(2 / 3)}
    out = capsys.readouterr()
    assert out.out.splitlines() == [f"Arith@1 metrics: {metrics}"]
    assert "3/3" in out.err  # the progress bar
    assert env.failed_items == 0
    assert env.eval_samples == [
        {"item": "4", "ok": True},
        {"item": "5", "ok": False},
        {"item": "4", "ok": True},
    ]


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"pass_at_n": 2, "pass_at_n_samples": 4}, "Arith@2:4"),
        ({"pass_at_n": 3, "pass_at_n_samples": 3}, "Arith@3"),
        ({"pass_at_n": 2}, "Arith@2:1"),
    ],
)
async def test_task_name_and_evaluate_log_arguments(monkeypatch, capsys, kwargs, name):
    logged: list[tuple[Any, dict[str, Any]]] = []
    monkeypatch.setattr(eval_mod, "evaluate_log", lambda m, **kw: logged.append((m, kw)))
    env = arith(eval_dir="/somewhere", verbose=True, **kwargs)
    metrics = await env(Manager())
    assert capsys.readouterr().out.startswith(f"{name} metrics: ")
    [(logged_metrics, kw)] = logged
    assert logged_metrics == metrics
    assert kw["task_name"] == name
    assert (kw["eval_dir"], kw["verbose"], kw["model_name"]) == ("/somewhere", True, "echo-model")
    assert kw["generation_parameters"] == env.get_generation_params()
    assert kw["start_time"] <= kw["end_time"]
    assert len(kw["samples"]) == 3


async def test_eval_dir_from_the_instance_gets_the_files(tmp_path, capsys):
    env = arith(eval_dir=str(tmp_path))
    metrics = await env(Manager())
    record = json.loads((tmp_path / "metrics.json").read_text())
    assert record["results"]["atropos|Arith@1|0"] == metrics
    assert record["config_general"]["model_name"] == "echo-model"
    assert len((tmp_path / "samples.jsonl").read_text().splitlines()) == 3
    assert capsys.readouterr().out.splitlines() == [f"Arith@1 metrics: {metrics}"]  # no table


class Flaky(EvalBase):
    def setup_data(self):
        return ["4", "boom"]

    async def run_item(self, server, data_item):
        if data_item == "boom":
            raise RuntimeError("broken item")
        return {"accuracy": 1.0}, [{"item": data_item}]


async def test_a_failed_item_is_counted_on_the_instance_not_in_the_metrics(capsys):
    env = Flaky()
    metrics = await env(Manager())
    assert metrics == {"accuracy": 1.0}
    assert env.failed_items == 1
    assert capsys.readouterr().out.splitlines() == ["Flaky@1 metrics: {'accuracy': 1.0}"]


def test_generation_params_follow_the_instance_settings():
    env = arith(pass_at_n=1, pass_at_n_samples=4, temperature=1.0, top_p=0.9, max_tokens=64)
    assert env.get_generation_params() == {
        "temperature": 1.0,
        "n": 4,
        "top_p": 0.9,
        "max_tokens": 64,
    }
    defaults = arith().get_generation_params()
    assert (defaults["temperature"], defaults["n"], defaults["top_p"]) == (0.0, 1, 1.0)
