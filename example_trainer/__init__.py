"""Example GRPO trainer for Atropos (`atropos-grpo`) and the one-command loop (`atropos-grpo-run`).

See ``example_trainer/README.md``. Torch-dependent modules are imported lazily by the
entry points, so ``import example_trainer.config`` works without the trainer extra.
"""
