"""Where a ``ServerManager``'s servers come from: the backend class of each config's
``server_type``, the inference servers of a SLURM allocation, and the list of server
configs a manager is built from (one config, a template spread over the discovered or
default local URLs, or a list as given)."""

from __future__ import annotations

import logging
import os
import subprocess
from typing import Mapping, Sequence, Union

from atroposlib.envs.server_handling.openai_server import OpenAIServer
from atroposlib.envs.server_handling.server_baseline import (
    APIServer,
    APIServerConfig,
    ServerBaseline,
)

logger = logging.getLogger(__name__)

DEFAULT_LOCAL_PORTS = range(9004, 9008)
SLURM_BASE_PORT = 9000
GPUS_PER_NODE = 8


def server_class_for(server_type: str) -> type[APIServer]:
    """The backend class for a config's ``server_type``."""
    from atroposlib.envs.server_handling.sglang_server import SGLangServer
    from atroposlib.envs.server_handling.trl_vllm_server import TrlVllmServer
    from atroposlib.envs.server_handling.vllm_server import VLLMServer

    classes: dict[str, type[APIServer]] = {
        "openai": OpenAIServer,
        "trl": TrlVllmServer,
        "sglang": SGLangServer,
        "vllm": VLLMServer,
    }
    if server_type not in classes:
        raise ValueError(f"unknown server_type {server_type!r}; expected one of {sorted(classes)}")
    return classes[server_type]


def _env_int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError as e:
        raise ValueError(f"environment variable {name} must be an integer, got {raw!r}") from e


def slurm_inference_urls(
    env: Mapping[str, str] | None = None, hostnames: Sequence[str] | None = None
) -> list[str] | None:
    """Inference server URLs of a SLURM allocation, or None with fewer than 2 nodes.

    Nodes after the first ``NUM_TRAINING_NODES`` (default 1) each run ``8 // INFER_TP``
    servers on ports 9000, 9001, ... ``hostnames`` overrides ``scontrol show hostnames``.
    """
    env = os.environ if env is None else env
    if hostnames is None:
        nodelist = env.get("SLURM_JOB_NODELIST")
        if not nodelist:
            return None
        try:
            result = subprocess.run(
                ["scontrol", "show", "hostnames", nodelist],
                capture_output=True,
                text=True,
                timeout=30,
                check=True,
            )
        except (OSError, subprocess.SubprocessError) as e:
            raise RuntimeError(
                f"SLURM_JOB_NODELIST is set but `scontrol show hostnames` failed: {e}"
            ) from e
        hostnames = result.stdout.split()
    nodes = list(hostnames)
    if len(nodes) < 2:
        return None
    num_training = _env_int(env, "NUM_TRAINING_NODES", 1)
    tp = _env_int(env, "INFER_TP", 1)
    if tp < 1 or tp > GPUS_PER_NODE:
        raise ValueError(f"INFER_TP must be between 1 and {GPUS_PER_NODE}, got {tp}")
    return [
        f"http://{node}:{SLURM_BASE_PORT + i}/v1"
        for node in nodes[num_training:]
        for i in range(GPUS_PER_NODE // tp)
    ]


def _configs_from_template(template: ServerBaseline, urls: Sequence[str]) -> list[APIServerConfig]:
    base = template.model_dump()
    base.pop("base_url", None)
    base.pop("api_key", None)
    return [APIServerConfig(**{**base, "base_url": url, "api_key": "x"}) for url in urls]


def resolve_server_configs(
    configs: Union[ServerBaseline, Sequence[ServerBaseline]], slurm: bool
) -> list[ServerBaseline]:
    """The server configs a manager is built from: one ``APIServerConfig`` with a
    ``base_url`` as is; another ``ServerBaseline`` as a template over the SLURM allocation's
    servers (else the default local ports); a list as given, or with ``slurm`` its first
    config as a template over the allocation's servers."""
    if isinstance(configs, ServerBaseline):
        if isinstance(configs, APIServerConfig) and configs.base_url:
            return [configs]  # one server at its base_url
        urls = slurm_inference_urls()
        if urls is None:
            urls = [f"http://localhost:{p}/v1" for p in DEFAULT_LOCAL_PORTS]
        return list(_configs_from_template(configs, urls))
    configs = list(configs)
    if not slurm or not configs:
        return configs
    urls = slurm_inference_urls()
    if urls is None:
        logger.warning("slurm=True but fewer than 2 SLURM nodes found; using the configs as given")
        return configs
    return list(_configs_from_template(configs[0], urls))
