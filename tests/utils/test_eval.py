"""Standalone eval framework: pass@k, evaluate_log files, EvalBase aggregation."""

from __future__ import annotations

import json
from math import comb

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from atroposlib.envs.eval import EvalBase, evaluate_log, pass_at_k, run_eval


@settings(deadline=None)
@given(
    st.integers(1, 30).flatmap(
        lambda m: st.tuples(st.just(m), st.integers(0, m), st.integers(1, m))
    )
)
def test_pass_at_k_equals_the_combinatorial_definition(mck):
    m, c, k = mck
    assert pass_at_k(m, c, k) == pytest.approx(1 - comb(m - c, k) / comb(m, k), abs=1e-9)


@pytest.mark.parametrize("m, c, k", [(5, 6, 1), (5, -1, 1), (5, 2, 0), (5, 2, 6)])
def test_pass_at_k_rejects_impossible_counts(m, c, k):
    with pytest.raises(ValueError):
        pass_at_k(m, c, k)


def test_evaluate_log_writes_metrics_and_samples(tmp_path):
    record = evaluate_log(
        {"eval/percent_correct": 0.5},
        eval_dir=str(tmp_path / "e"),
        task_name="gsm8k_eval",
        model_name="m",
        start_time=10.0,
        end_time=12.5,
        generation_parameters={"temperature": 0.6},
        samples=[{"score": 1}],
        verbose=False,
    )
    on_disk = json.loads((tmp_path / "e" / "metrics.json").read_text())
    assert on_disk == record
    assert on_disk["config_general"] == {
        "model_name": "m",
        "total_evaluation_time_seconds": "2.5",
        "generation_parameters": {"temperature": 0.6},
    }
    assert on_disk["results"] == {
        "atropos|gsm8k_eval|0": {"eval/percent_correct": 0.5},
        "all": {"eval/percent_correct": 0.5},
    }
    assert [json.loads(x) for x in (tmp_path / "e" / "samples.jsonl").read_text().splitlines()] == [
        {"score": 1}
    ]


def test_evaluate_log_without_a_dir_writes_nothing(tmp_path, caplog):
    assert evaluate_log({"a": 1.0}, eval_dir=None, verbose=False) is None
    assert "not written" in caplog.text


class _Echo:
    async def chat_completion(self, messages, **kwargs):
        return messages[-1]["content"]


class _ToyEval(EvalBase):
    def setup_data(self):
        return ["4", "5", "boom", "4"]

    async def run_item(self, server, item):
        if item == "boom":
            raise RuntimeError("broken item")
        answer = await server.chat_completion(messages=[{"role": "user", "content": item}])
        ok = answer == "4"
        return {"accuracy": float(ok), **self.pass_metrics(2, 2 if ok else 0)}, [
            {"item": item, "ok": ok}
        ]


async def test_eval_base_averages_metrics_and_counts_failed_items(tmp_path):
    toy = _ToyEval(pass_at_n=1, max_concurrency=2)
    assert toy.task_name == "_ToyEval@1"
    metrics = await run_eval(toy, _Echo(), eval_dir=str(tmp_path), model_name="echo", verbose=False)
    assert metrics["accuracy"] == pytest.approx(2 / 3)
    assert metrics["pass@1"] == pytest.approx(2 / 3)
    assert toy.failed_items == 1 and "failed_items" not in metrics
    written = json.loads((tmp_path / "metrics.json").read_text())
    assert written["results"]["all"]["accuracy"] == pytest.approx(2 / 3)
    assert len((tmp_path / "samples.jsonl").read_text().splitlines()) == 3
