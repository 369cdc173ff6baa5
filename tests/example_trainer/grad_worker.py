"""Run by ``torchrun`` (or plainly, for one process) from test_grad_parity.py: train one
API batch with the real :class:`GRPOTrainer` and save, on rank 0, the full gradient of
every optimizer step and the step's metrics.

    python -m tests.example_trainer.grad_worker BATCH.json CONFIG.json OUT.pt
"""

from __future__ import annotations

import json
import sys

import torch

from example_trainer.config import TrainingConfig
from example_trainer.trainers import GRPOTrainer


def main(batch_path: str, config_path: str, out_path: str) -> None:
    torch.set_num_threads(1)
    batch = json.loads(open(batch_path).read())
    config = TrainingConfig(**json.loads(open(config_path).read()))
    trainer = GRPOTrainer(config)
    grads: list[dict[str, torch.Tensor]] = []
    apply = trainer.update.apply

    def capture(finite: bool) -> None:
        step = {}
        for name, p in trainer.model.named_parameters():
            if p.grad is None:
                continue
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            step[name] = g.detach().double().clone()
        grads.append(step)
        apply(finite)

    trainer.update.apply = capture  # type: ignore[method-assign]
    try:
        metrics = trainer.train_on_batch(batch if trainer.ctx.is_main else None)
        if trainer.ctx.is_main:
            torch.save(
                {"grads": grads, "metrics": metrics, "world_size": trainer.ctx.world_size},
                out_path,
            )
    finally:
        trainer.close()


if __name__ == "__main__":
    main(*sys.argv[1:4])
