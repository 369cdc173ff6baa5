"""``inference-node-wandb-watcher``: report an inference node's server health to W&B.

Waits until the trainer has registered with the rollout API (``GET /wandb_info``
has a project), joins that W&B project and group as ``inf_node_{node_num}``,
then every ``--interval`` seconds probes ``http://{health_host}:{base_port+i}/health_generate``
for each of the node's ``gpus_per_node // tp`` servers and, whenever ``/status``
shows a new trainer step, logs ``server/server_health_{node_num}_{i}`` (1 healthy,
0 not) at that step.

Example::

    inference-node-wandb-watcher --api_addr http://trainer:8000 --tp 2 --node_num 0

Exit codes: 1 the API never answered with a W&B project within ``--wait-timeout``.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import httpx

from atroposlib.frontend.api_client import ApiError, TrainerClient

logger = logging.getLogger(__name__)


def health_urls(
    tp: int, host: str = "localhost", base_port: int = 9000, gpus_per_node: int = 8
) -> list[str]:
    """The health endpoints of a node's servers: one per ``tp`` GPUs."""
    if tp <= 0:
        raise ValueError("--tp must be a positive integer")
    return [
        f"http://{host}:{base_port + i}/health_generate" for i in range(max(gpus_per_node // tp, 0))
    ]


def probe(client: httpx.Client, url: str) -> float:
    """1.0 if ``url`` answers 200, else 0.0 (connection errors and timeouts count as down)."""
    try:
        return 1.0 if client.get(url).status_code == 200 else 0.0
    except httpx.HTTPError as e:
        logger.debug("health probe %s failed: %s", url, e)
        return 0.0


@dataclass
class Watcher:
    """One node's watcher; ``tick()`` probes the servers and logs when the trainer step changed."""

    api: TrainerClient
    node_num: int
    urls: list[str]
    log: Callable[[dict[str, float], int], None]
    http: httpx.Client = field(default_factory=lambda: httpx.Client(timeout=5.0))
    last_step: int = 0
    health: dict[str, float] = field(default_factory=dict)

    def tick(self) -> int | None:
        """Probe every server; log the health at the new step if there is one. Returns that step."""
        self.health = {
            f"server/server_health_{self.node_num}_{i}": probe(self.http, url)
            for i, url in enumerate(self.urls)
        }
        step = int(self.api.status().get("current_step", 0))
        if step > self.last_step:
            self.log(dict(self.health), step)
            self.last_step = step
            return step
        return None


def wait_for_wandb_info(api: TrainerClient, timeout: float, poll: float = 1.0) -> dict[str, Any]:
    """Poll ``/wandb_info`` until it names a project; ApiError after ``timeout`` s (0 = forever)."""
    deadline = None if timeout <= 0 else time.monotonic() + timeout
    last_error: str | None = None
    while True:
        try:
            info = api.wandb_info()
            if isinstance(info, dict) and info.get("project"):
                return info
            last_error = "no trainer registered yet"
        except ApiError as e:
            last_error = str(e)
            logger.warning("waiting for the rollout API: %s", e)
        if deadline is not None and time.monotonic() >= deadline:
            raise ApiError(
                f"no W&B project from {api.api_url}/wandb_info after {timeout:g} s ({last_error})"
            )
        time.sleep(poll)


def build_parser() -> argparse.ArgumentParser:
    """The watcher's flags (the original three are required)."""
    p = argparse.ArgumentParser(
        prog="inference-node-wandb-watcher",
        description="Log an inference node's server health to the trainer's W&B run.",
    )
    p.add_argument(
        "--api_addr", "--api-addr", dest="api_addr", required=True, help="rollout API URL"
    )
    p.add_argument("--tp", type=int, required=True, help="tensor-parallel size of each server")
    p.add_argument(
        "--node_num",
        "--node-num",
        dest="node_num",
        type=int,
        required=True,
        help="this node's number",
    )
    p.add_argument(
        "--interval", type=float, default=60.0, help="seconds between probes (default 60)"
    )
    p.add_argument(
        "--health-host",
        default="localhost",
        help="host of the inference servers (default localhost)",
    )
    p.add_argument("--base-port", type=int, default=9000, help="port of server 0 (default 9000)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs on this node (default 8)")
    p.add_argument(
        "--wait-timeout",
        type=float,
        default=0.0,
        help="give up if the trainer has not registered after this many seconds (0 = wait forever)",
    )
    p.add_argument(
        "--max-iterations",
        type=int,
        default=0,
        help="stop after this many probes (0 = run forever)",
    )
    return p


def update_wandb(health_statuses: dict[str, float], step: int | None = None) -> None:
    """Log ``health_statuses`` (``server/server_health_<node>_<i>``: 1.0 up, 0.0 down) to
    the current W&B run, at ``step`` when given."""
    import wandb

    wandb.log(dict(health_statuses), step=step)


def run(
    api_addr: str,
    tp: int,
    node_num: int,
    interval: float = 60.0,
    health_host: str = "localhost",
    base_port: int = 9000,
    gpus_per_node: int = 8,
    wait_timeout: float = 0.0,
    max_iterations: int = 0,
) -> int:
    """Watch this node's inference servers and log their health to the trainer's W&B run
    at every trainer step (what the command runs); returns the exit code."""
    return main(
        [
            "--api_addr",
            api_addr,
            "--tp",
            str(tp),
            "--node_num",
            str(node_num),
            "--interval",
            str(interval),
            "--health-host",
            health_host,
            "--base-port",
            str(base_port),
            "--gpus-per-node",
            str(gpus_per_node),
            "--wait-timeout",
            str(wait_timeout),
            "--max-iterations",
            str(max_iterations),
        ]
    )


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``inference-node-wandb-watcher``."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        urls = health_urls(args.tp, args.health_host, args.base_port, args.gpus_per_node)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    api = TrainerClient(args.api_addr)
    closers = [api.close]
    try:
        info = wait_for_wandb_info(api, args.wait_timeout)
        import wandb

        wandb.init(
            project=info["project"], group=info.get("group"), name=f"inf_node_{args.node_num}"
        )
        watcher = Watcher(api, args.node_num, urls, log=lambda m, step: update_wandb(m, step))
        closers.append(watcher.http.close)
        iterations = 0
        while True:
            try:
                step = watcher.tick()
                if step is not None:
                    logger.info("step %d: %s", step, watcher.health)
            except ApiError as e:
                logger.warning("status check failed, will retry: %s", e)
            iterations += 1
            if args.max_iterations and iterations >= args.max_iterations:
                return 0
            time.sleep(args.interval)
    except ApiError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        for close in closers:
            close()


if __name__ == "__main__":
    sys.exit(main())
