"""``atropos-grpo``: the example GRPO trainer's entry point.

Example::

    atropos-grpo --model-name ./my-model --training-steps 20 --batch-size 8 \\
        --gradient-accumulation-steps 2 --weight-bridge-mode http_reload --vllm-port 9001
"""

from __future__ import annotations

import logging
import signal
import sys
from typing import Sequence

from .cli import config_from_args
from .config import TrainingConfig


def _terminate(signum: int, frame: object) -> None:
    # Turn SIGTERM into SystemExit so `finally` blocks stop owned inference servers.
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse flags, train, print where the final model went."""
    config: TrainingConfig = config_from_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)
    signal.signal(signal.SIGTERM, _terminate)
    from .api import AtroposAPIError
    from .trainers import train
    from .weight_sync import WeightSyncError

    try:
        final = train(config)
    except (AtroposAPIError, WeightSyncError) as exc:
        logging.getLogger("atropos-grpo").error("%s", exc)
        return 1
    print(f"final model saved to {final}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
