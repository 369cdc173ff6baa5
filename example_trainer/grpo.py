"""``atropos-grpo``: the example GRPO trainer's entry point.

Example::

    atropos-grpo --model-name ./my-model --training-steps 20 --batch-size 8 \\
        --gradient-accumulation-steps 2 --weight-bridge-mode http_reload --vllm-port 9001

    # the same on 4 processes (FSDP2; rank 0 talks to run-api and inference)
    torchrun --nproc-per-node 4 -m example_trainer.grpo --model-name ./my-model ...
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Sequence

from .cli import config_from_args
from .config import TrainingConfig
from .launch import supervision

TRAINING_LIBRARIES = ("transformers", "tokenizers", "torch", "accelerate", "peft")
"""Libraries the trainer depends on; checked against the declared ranges at start."""


def model_problem(name: str) -> str | None:
    """Why ``name`` cannot be loaded, in one line, or None when it can.

    A local directory is fine. A hub name must be in the local cache or reachable;
    otherwise transformers would print pages of traceback after a long wait.
    """
    if Path(os.path.expanduser(name)).exists():
        return None
    import huggingface_hub
    from huggingface_hub.errors import HFValidationError
    from transformers import AutoConfig

    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    huggingface_hub.logging.set_verbosity_error()
    try:
        AutoConfig.from_pretrained(name)
    except (OSError, ValueError, HFValidationError):
        if offline:
            return (
                f"--model-name {name}: not a local directory and not in the Hugging Face cache "
                "(HF_HUB_OFFLINE=1 is set, so the hub was not asked)"
            )
        return (
            f"--model-name {name}: not a local directory, and the Hugging Face hub could not resolve it "
            "(no network? download it once, or use a local directory; HF_HUB_OFFLINE=1 skips the hub)"
        )
    return None


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
