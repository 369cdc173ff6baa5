"""``atropos-grpo``: the example GRPO trainer's entry point.

Example::

    atropos-grpo --model-name ./my-model --training-steps 20 --batch-size 8 \\
        --gradient-accumulation-steps 2 --weight-bridge-mode http_reload --vllm-port 9001

    # the same on 4 processes (FSDP2; rank 0 talks to run-api and inference)
    torchrun --nproc-per-node 4 -m example_trainer.grpo --model-name ./my-model ...
"""

from __future__ import annotations

import logging
import sys
from typing import Sequence

from atroposlib.utils.model_check import model_problem

from .cli import config_from_args
from .config import TrainingConfig
from .launch import supervision

TRAINING_LIBRARIES = ("transformers", "tokenizers", "torch", "accelerate", "peft")
"""Libraries the trainer depends on; checked against the declared ranges at start."""


def main(argv: Sequence[str] | None = None) -> int:
    """Parse flags, train, print where the final model went."""
    # First, so the window in which a parent's death goes unnoticed is as short as it can be.
    # SIGTERM/SIGINT become SystemExit so `finally` blocks stop owned inference servers;
    # a rank stuck in a collective, or whose parent died, still ends within the grace period.
    supervision.install()
    config: TrainingConfig = config_from_args(argv)
    from atroposlib.utils.dependencies import exit_if_unsupported

    exit_if_unsupported("atropos-grpo", TRAINING_LIBRARIES)
    problem = model_problem(config.model_name)
    if problem is not None:
        print(f"atropos-grpo: error: {problem}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)
    from .api import AtroposAPIError
    from .distributed import DistributedError
    from .policy_update import TrainingDivergedError
    from .trainers import train
    from .weight_sync import WeightSyncError

    try:
        final = train(config)
    except (AtroposAPIError, WeightSyncError, DistributedError, TrainingDivergedError) as exc:
        logging.getLogger("atropos-grpo").error("%s", exc)
        return 1
    if final is not None:  # rank 0 (or the only process)
        print(f"final model saved to {final}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
