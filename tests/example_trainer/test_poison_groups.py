"""A group the model cannot take never stops training: the trainer drops it, logs and
counts it, and a batch left with nothing to train on is acknowledged and skipped, so a
restarted trainer is not served it again (one bad group once crashed every restart).

The poisons: a token id at or above the vocabulary (1000000), one above int64
(9223372036854775808, which an API that does not check passes on), negative ids, and
the same in the teacher's ``distill_token_ids``.
"""

from __future__ import annotations

import copy
import json
import logging
from typing import Any, Dict, List

import httpx
import pytest

from atroposlib.testing.launch import run_api_cmd
from atroposlib.testing.ports import free_port
from atroposlib.testing.processes import running_process
from atroposlib.testing.trainer import trainer_registration
from example_trainer import api, trainers
from example_trainer.batching import EmptyBatchError, prepare_batch
from example_trainer.data import check_token_ids
from example_trainer.trainers import GRPOTrainer, embedding_rows
from example_trainer.weight_sync import WeightSync
from tests.example_trainer.conftest import cpu_config, make_batch

HUGE = 1_000_000
INT64_OVER = 2**63


def _with_distill(group: Dict[str, Any], bad: int | None = None) -> Dict[str, Any]:
    """``group`` with teacher rows of two ids per position; ``bad`` at ``[1][3][0]``."""
    g = copy.deepcopy(group)
    g["distill_token_ids"] = [[[t, 0] for t in row] for row in g["tokens"]]
    g["distill_logprobs"] = [[[-0.1, -2.5] for _ in row] for row in g["tokens"]]
    if bad is not None:
        g["distill_token_ids"][1][3][0] = bad
    return g


def _poisoned(group: Dict[str, Any], bad: int) -> Dict[str, Any]:
    """``group`` whose last sequence's last token (a trained one) is ``bad``."""
    g = copy.deepcopy(group)
    g["tokens"][-1][-1] = bad
    g["masks"][-1][-1] = bad
    return g


POISONS = {
    "token-above-vocab": lambda g: _poisoned(g, HUGE),
    "token-above-int64": lambda g: _poisoned(g, INT64_OVER),
    "token-negative": lambda g: _poisoned(g, -5),
    "distill-above-vocab": lambda g: _with_distill(g, HUGE),
    "distill-above-int64": lambda g: _with_distill(g, INT64_OVER),
}


@pytest.mark.parametrize("poison", sorted(POISONS))
def test_a_poisoned_group_is_dropped_and_counted_the_rest_trained(tiny_tokenizer, poison):
    good, other = make_batch(tiny_tokenizer, n_groups=2, group_size=4, seed=5)
    bad = POISONS[poison](other)
    vocab = len(tiny_tokenizer)
    prepared = prepare_batch([good, bad], 1, 4, vocab_size=vocab)
    assert prepared.summary["train/rejected_groups"] == 1.0
    assert prepared.summary["train/rejected_sequences"] == 4.0
    kept = prepared.shares[0]
    assert len(kept) == 4 and {s.group for s in kept} == {0}
    with pytest.raises(EmptyBatchError, match="1 groups rejected") as err:
        prepare_batch([bad], 1, 4, vocab_size=vocab)
    assert (err.value.rejected_groups, err.value.rejected_sequences) == (1, 4)


def test_the_id_check_names_field_and_index(tiny_tokenizer):
    (group,) = make_batch(tiny_tokenizer, n_groups=1, group_size=2, seed=1)
    last, vocab = len(group["tokens"][1]) - 1, len(tiny_tokenizer)
    with pytest.raises(
        ValueError, match=rf"tokens\[1\]\[{last}\] is 1000000: .*vocab_size {vocab}"
    ):
        check_token_ids(_poisoned(group, HUGE), vocab_size=vocab)
    with pytest.raises(
        ValueError, match=r"distill_token_ids\[1\]\[3\]\[0\] is 9223372036854775808"
    ):
        check_token_ids(_with_distill(group, INT64_OVER))
    with pytest.raises(ValueError, match=r"tokens\[1\]\[\d+\] is 'x', not an integer"):
        check_token_ids(_poisoned(group, "x"))  # type: ignore[arg-type]
    check_token_ids(_with_distill(group), vocab_size=len(tiny_tokenizer))  # a valid group passes


def _metrics(path) -> List[Dict[str, Any]]:
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


def test_poison_batches_leave_a_run_training_across_restarts(
    tiny_model_dir, tiny_tokenizer, tmp_path, monkeypatch, caplog
):
    """Against a real run-api that does not check ids (a first trainer registered no
    vocab_size): a batch of poison only, served to a trainer that dies on it without
    acknowledging, is served again to the restarted trainer, which skips it, acknowledges
    it and trains on; a mixed batch trains on its good group. Restarted again, the trainer
    is never served the poison-only batch a third time (the mixed batch, not acknowledged
    when the run ended, is served again: at least once)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    good = make_batch(tiny_tokenizer, n_groups=4, group_size=2, seed=3)
    poison = [
        _poisoned(good[0], HUGE),
        _with_distill(good[1], HUGE),
    ]
    # 4 sequences per API batch (2 groups of 2): [poison, poison], [poison, good], [good, good]
    queue = poison + [_poisoned(good[2], HUGE), good[0], good[1], good[3]]
    monkeypatch.setattr(trainers, "make_weight_sync", lambda c, m, t: WeightSync(c, m, t))
    caplog.set_level(logging.ERROR, logger="example_trainer")

    def run(save: str, steps: int) -> List[Dict[str, Any]]:
        monkeypatch.setattr(api, "_batch_clients", {})  # a restarted process's fresh client
        cfg = cpu_config(
            tiny_model_dir, tmp_path / save, atropos_url=url, training_steps=steps,
            batch_size=2, batch_poll_interval=0.05, distill_enabled=True, checkpoint_interval=0,
        )  # fmt: skip
        trainer = GRPOTrainer(cfg)
        # What it registers and checks against: the rows of its embedding table.
        assert trainer.vocab_size == embedding_rows(trainer.model) == len(tiny_tokenizer)
        assert trainer.train() is not None
        return _metrics(tmp_path / save)

    with running_process(
        run_api_cmd(port, "--log-level", "warning"), health_url=f"{url}/health", timeout=60
    ):
        with httpx.Client(base_url=url, timeout=10) as c:
            # The first registration sets the run's config: this one has no vocab_size.
            assert c.post("/register", json=trainer_registration(4)).status_code == 200
            c.get("/batch")
            for g in queue:
                assert c.post("/scored_data", json=g).status_code == 200, g
            # A trainer took the first batch and died on it: nothing acknowledged it.
            first = c.get("/batch").json()
            assert [g["tokens"] for g in first["batch"]] == [g["tokens"] for g in poison]
        first_run = run("a", steps=1)
        assert len(first_run) == 1
        assert first_run[0]["train/skipped_batches"] == 1.0
        # The poison-only batch (2 groups) and the mixed batch's bad group.
        assert first_run[0]["train/rejected_groups"] == 3.0
        assert first_run[0]["train/rejected_sequences"] == 6.0
        assert "skipped, not trained on" in caplog.text
        assert "1000000" in caplog.text
        second_run = run("b", steps=2)  # restarted again
        with httpx.Client(base_url=url, timeout=10) as c:
            status = c.get("/status").json()
    assert [r["train/skipped_batches"] for r in second_run] == [0.0, 0.0]
    assert [r["train/rejected_groups"] for r in second_run] == [1.0, 0.0]
    assert status["queue_size"] == 0
