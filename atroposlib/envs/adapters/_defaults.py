"""The defaults every bundled adapter starts from (``config_init``).

An adapter's ``config_init`` differs from another's only in its config class, its name and
how long a sequence may be; the rest (group size, eval cadence, W&B off, one local
OpenAI-compatible server) is the same for all of them and lives here.
"""

from __future__ import annotations

from typing import List, Tuple, Type, TypeVar

from atroposlib.envs.base import BaseEnvConfig
from atroposlib.envs.server_handling.server_baseline import APIServerConfig

ConfigT = TypeVar("ConfigT", bound=BaseEnvConfig)

__all__ = ["adapter_config_init", "local_server_config"]


def local_server_config() -> APIServerConfig:
    """The policy server an adapter expects by default: vLLM-compatible, on localhost:9001."""
    return APIServerConfig(
        model_name="default",
        base_url="http://localhost:9001/v1",
        api_key="x",
        server_type="vllm",
    )


def adapter_config_init(
    config_cls: Type[ConfigT], name: str, max_token_length: int
) -> Tuple[ConfigT, List[APIServerConfig]]:
    """``(env config, [server config])`` of an adapter called ``name`` (its W&B name):
    no tokenizer of its own, 8 rollouts a group, an eval every 100 of 1000 steps, W&B off,
    and :func:`local_server_config` as the one server."""
    env = config_cls(
        tokenizer_name="none",
        group_size=8,
        batch_size=-1,
        max_token_length=max_token_length,
        steps_per_eval=100,
        total_steps=1000,
        use_wandb=False,
        wandb_name=name,
    )
    return env, [local_server_config()]
