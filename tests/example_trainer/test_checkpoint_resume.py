"""Checkpoints are complete and --resume restores weights, optimizer state and step."""

from __future__ import annotations

import pytest
import torch

from example_trainer.checkpointing import (
    find_latest_checkpoint,
    load_trainer_state,
    save_checkpoint,
)
from example_trainer.config import TrainingConfig
from example_trainer.trainers import GRPOTrainer
from tests.example_trainer.conftest import cpu_config, make_batch


@pytest.mark.smoke
def test_train_step_changes_weights_and_reports_finite_loss(
    tiny_model_dir, tiny_tokenizer, tmp_path
):
    trainer = GRPOTrainer(cpu_config(tiny_model_dir, tmp_path))
    before = [p.detach().clone() for p in trainer.model.parameters()]
    m = trainer.train_on_batch(make_batch(tiny_tokenizer, with_logprobs=True))
    assert torch.isfinite(torch.tensor(m["train/loss"]))
    assert m["train/tokens_per_second"] > 0 and m["train/num_tokens"] > 0
    assert any(
        not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters(), strict=False)
    )


def test_resume_restores_step_weights_and_optimizer(tiny_model_dir, tiny_tokenizer, tmp_path):
    cfg = cpu_config(tiny_model_dir, tmp_path)
    t1 = GRPOTrainer(cfg)
    for i in range(2):
        t1.train_on_batch(make_batch(tiny_tokenizer, seed=i))
        t1.step += 1
    save_checkpoint(t1.model, t1.tokenizer, t1.optimizer, t1.scheduler, 1, tmp_path)
    save_checkpoint(t1.model, t1.tokenizer, t1.optimizer, t1.scheduler, t1.step, tmp_path)
    assert find_latest_checkpoint(tmp_path).name == "step_2"
    assert load_trainer_state(tmp_path / "step_2").step == 2

    t2 = GRPOTrainer(cfg.model_copy(update={"resume": True}))
    assert t2.step == 2
    for a, b in zip(t1.model.state_dict().values(), t2.model.state_dict().values(), strict=False):
        assert torch.equal(a, b)
    s1, s2 = t1.optimizer.state_dict(), t2.optimizer.state_dict()
    assert s1["state"].keys() == s2["state"].keys()
    k = next(iter(s1["state"]))
    assert torch.equal(s1["state"][k]["exp_avg"], s2["state"][k]["exp_avg"])
    assert float(s2["state"][k]["step"]) == 2

    # Both continue identically from the restored state.
    batch = make_batch(tiny_tokenizer, seed=7)
    l1, l2 = t1.train_on_batch(batch)["train/loss"], t2.train_on_batch(batch)["train/loss"]
    assert l1 == l2


def test_incomplete_checkpoint_is_ignored_by_resume(tmp_path):
    (tmp_path / "step_5").mkdir()  # no trainer_state.pt: a crash mid-save
    (tmp_path / "step_3.tmp").mkdir()
    assert find_latest_checkpoint(tmp_path) is None


def test_kl_reference_model_is_frozen_copy(tiny_model_dir, tiny_tokenizer, tmp_path):
    trainer = GRPOTrainer(cpu_config(tiny_model_dir, tmp_path, kl_coef=0.1))
    ref_before = [p.clone() for p in trainer.ref_model.parameters()]
    m = trainer.train_on_batch(make_batch(tiny_tokenizer))
    assert "train/kl" in m
    assert all(
        torch.equal(a, b) for a, b in zip(ref_before, trainer.ref_model.parameters(), strict=False)
    )


def test_wandb_offline_logging_works_without_a_key(tmp_path, monkeypatch):
    import wandb

    from example_trainer.metrics import MetricsWriter

    wandb.teardown()  # an earlier test in this process may have set wandb up with another dir
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    writer = MetricsWriter(
        TrainingConfig(model_name="m", use_wandb=True, wandb_project="p", save_path=str(tmp_path))
    )
    writer.log({"train/loss": 0.5, "grpo/mean_ratio": 1.0}, step=1)
    writer.close()
    assert list((tmp_path / "wandb").glob("offline-run-*"))
    assert '"train/loss": 0.5' in (tmp_path / "metrics.jsonl").read_text()


def test_checkpoint_records_the_last_trained_batch_id_and_resume_skips_that_batch(
    tiny_model_dir, tmp_path
):
    import httpx

    from example_trainer import api

    url = "http://api-for-resume-test"
    cfg = cpu_config(tiny_model_dir, tmp_path, atropos_url=url)
    t1 = GRPOTrainer(cfg)
    t1.step, t1.trained_batch_id = 3, "batch-7"
    t1._save()
    assert load_trainer_state(tmp_path / "step_3").last_batch_id == "batch-7"

    t2 = GRPOTrainer(cfg.model_copy(update={"resume": True}))
    assert t2.step == 3 and t2.trained_batch_id == "batch-7"
    api._batch_clients.pop(url, None)
    try:
        t2.seed_batch_client()
        # The API serves batch-7 again (its acknowledgement was lost in the crash), then batch-8.
        served = iter(["batch-7", "batch-8"])
        acks = []

        def handler(request: httpx.Request) -> httpx.Response:
            acks.append(request.url.params.get("ack"))
            return httpx.Response(200, json={"batch": [{"n": 1}], "batch_id": next(served)})

        client = httpx.Client(transport=httpx.MockTransport(handler))
        assert api.get_batch(url, client=client) == [{"n": 1}]
        assert acks == ["batch-7", "batch-7"]  # acknowledged, skipped, asked again
        assert api.batch_client(url).last_batch_id == "batch-8"
    finally:
        api._batch_clients.pop(url, None)


def test_checkpoints_without_a_batch_id_still_load(tmp_path):
    root = tmp_path / "step_1"
    root.mkdir()
    torch.save({"step": 1, "scheduler": None}, root / "trainer_state.pt")
    assert load_trainer_state(root).last_batch_id is None
