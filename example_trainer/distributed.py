"""Multi-process training on ``torch.distributed`` with FSDP2 (``fully_shard``).

Why FSDP2 rather than DDP: DDP keeps a full copy of the weights, gradients and
AdamW state (16 bytes per parameter under mixed precision) on every rank, so it
cannot train a model that does not fit one GPU, which is why users leave a single
process. FSDP2 shards all three across the ranks and gathers one decoder layer at a
time; on a model that does fit, its per-layer all-gather costs little next to the
layer's own compute. One strategy also means one code path for checkpoints.

Who does what:

- rank 0 alone talks to ``run-api``: it fetches ``/batch``, turns it into
  sequences, cuts them into the optimizer steps' mini-batches (the same cut as one
  process makes), splits each mini-batch across the ranks (:func:`balance`: balanced
  token budgets) and scatters the shares;
- every rank runs forward/backward on its share; ranks with fewer micro-batches run
  empty ones, with the same forwards (policy, reference) in the same order as a real
  one, so that FSDP's collectives line up; the loss is normalised by the token count
  of the whole mini-batch, so the gradient equals the one-process gradient;
- rank 0 saves checkpoints (full state dicts gathered from the shards, so a
  checkpoint resumes at any world size) and drives the weight sync.

With one process nothing is initialised or wrapped: :class:`DistContext` turns every
collective into a no-op.
"""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass
from typing import Any, Callable, List, Mapping, Sequence, Tuple, TypeVar

import torch

from .launch import supervision

logger = logging.getLogger(__name__)

T = TypeVar("T")


# Every collective (gloo, and NCCL with its default async error handling) fails after this
# long instead of waiting forever for a rank that stopped answering; a rank that exits is
# noticed at once. Long enough for rank 0's slowest solo work (a batch wait, a checkpoint
# of a large model, a weight sync) while the other ranks wait in a collective.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=30)


class DistributedError(RuntimeError):
    """Another rank failed; this rank stops too."""


def split_groups(batch: Sequence[Mapping[str, Any]], world_size: int) -> List[List[int]]:
    """Indices of the groups each rank trains on: whole groups, balanced token budgets.

    Greedy longest-first: each group (largest token count first) goes to the rank
    with the fewest tokens so far. Deterministic, and every group lands on exactly one
    rank.

    Example::

        split_groups(batch, 2)  # -> [[0, 3], [1, 2]]
    """
    return balance([sum(len(t) for t in g.get("tokens", [])) for g in batch], world_size)


def balance(sizes: Sequence[int], world_size: int) -> List[List[int]]:
    """Indices of ``sizes`` per rank, greedy longest-first onto the least-loaded rank;
    deterministic, each index on exactly one rank, each rank's indices sorted."""
    order = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))
    loads = [0] * world_size
    shares: List[List[int]] = [[] for _ in range(world_size)]
    for i in order:
        r = min(range(world_size), key=lambda k: (loads[k], len(shares[k]), k))
        shares[r].append(i)
        loads[r] += sizes[i]
    return [sorted(s) for s in shares]


@dataclass
class DistContext:
    """This process's place in the job, and the few collectives the trainer needs."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        """True when more than one process trains."""
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that talks to the API, logs, saves and syncs weights."""
        return self.rank == 0

    # --- collectives (no-ops on one process) -----------------------------------------------
    def barrier(self) -> None:
        """Wait for every rank."""
        if self.enabled:
            torch.distributed.barrier()

    def scatter(self, per_rank: List[Any] | None) -> Any:
        """Rank 0 gives ``per_rank[r]`` to rank r (any picklable object)."""
        if not self.enabled:
            assert per_rank is not None
            return per_rank[0]
        out: List[Any] = [None]
        torch.distributed.scatter_object_list(out, per_rank if self.is_main else None, src=0)
        return out[0]

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if not self.enabled:
            return obj
        box = [obj if self.is_main else None]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Sum (or max) ``tensor`` over the ranks, in place; returns it."""
        if self.enabled:
            red = torch.distributed.ReduceOp.MAX if op == "max" else torch.distributed.ReduceOp.SUM
            torch.distributed.all_reduce(tensor, op=red)
        return tensor

    def on_main(self, fn: Callable[[], T], what: str) -> T | None:
        """Run ``fn`` on rank 0 only; if it fails there, every rank stops.

        Without this a failure on rank 0 (API down, weight sync refused) would leave
        the other ranks waiting forever in their next collective.
        """
        result: T | None = None
        error: str | None = None
        exc: BaseException | None = None
        if self.is_main:
            try:
                result = fn()
            except Exception as e:  # re-raised below on rank 0, reported on the others
                error, exc = f"{what} failed on rank 0: {e}", e
        if self.enabled:
            error = self.broadcast(error)
        if exc is not None:
            raise exc
        if error is not None:
            raise DistributedError(error)
        return result

    def close(self) -> None:
        """Leave the process group, together.

        A rank that destroys its group while a peer is still using the connection
        makes gloo abort the peer at exit ("terminate called without an active
        exception"), so every rank meets at a barrier first. On CPU (gloo) the barrier is
        bounded, so a rank that died cannot keep the others here.
        """
        if not (self.enabled and torch.distributed.is_initialized()):
            return
        if supervision.stopping():
            # Stopped by a signal: the peers are stopping too (or stuck in a collective that
            # will never complete); waiting for them would only delay the exit.
            torch.distributed.destroy_process_group()
            return
        try:
            if torch.distributed.get_backend() == "gloo":
                torch.distributed.monitored_barrier(timeout=datetime.timedelta(seconds=60))
            else:
                torch.distributed.barrier()
        except RuntimeError as e:  # a peer is gone: leave anyway
            logger.warning("ranks did not meet before leaving the process group: %s", e)
        torch.distributed.destroy_process_group()


def init_distributed(config: Any) -> Tuple[DistContext, str]:
    """Join the process group when more than one trainer process runs.

    Under ``torchrun`` (on one node or several) the rank and world size come from
    ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``; otherwise from ``--nnodes``/``--node-rank``/
    ``--rdzv-endpoint`` (one process per node, meeting at ``tcp://ENDPOINT``) or
    ``--trainer-rank``/``--world-size``/``--init-method``. Returns the context and the
    device this rank trains on (``cuda:LOCAL_RANK`` when the config says ``cuda``).
    """
    env = os.environ
    init_method = config.init_method
    if "WORLD_SIZE" not in env and getattr(config, "nnodes", 1) > 1:
        world, rank, local = config.nnodes, config.node_rank, 0
        init_method = f"tcp://{config.rdzv_endpoint}"
    else:
        world = int(env.get("WORLD_SIZE", config.world_size))
        rank = int(env.get("RANK", config.trainer_rank))
        local = int(env.get("LOCAL_RANK", rank))
    device = config.device
    if world <= 1:
        return DistContext(), device
    dev_type = torch.device(device).type
    if dev_type == "cuda":
        if torch.device(device).index is None:
            device = f"cuda:{local}"
        torch.cuda.set_device(torch.device(device))
    backend = "nccl" if dev_type == "cuda" else "gloo"
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(
            backend=backend,
            init_method=init_method,
            rank=rank,
            world_size=world,
            timeout=COLLECTIVE_TIMEOUT,
        )
    logger.info("rank %d of %d on %s (%s)", rank, world, device, backend)
    return DistContext(rank=rank, world_size=world, local_rank=local), device


def decoder_layers(model: torch.nn.Module) -> List[torch.nn.Module]:
    """The repeated transformer blocks of an HF causal LM (the unit FSDP shards by)."""
    for name in ("model.layers", "transformer.h", "gpt_neox.layers", "model.decoder.layers"):
        obj: Any = model
        for part in name.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if isinstance(obj, torch.nn.ModuleList):
            return list(obj)
    return []


def shard_model(model: torch.nn.Module, device: str, world_size: int) -> torch.nn.Module:
    """Apply ``fully_shard`` to every decoder layer, then to the whole model.

    The model may sit on the host: each layer's shard is moved to ``device`` as it is
    sharded, so the full model is never on one GPU.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(torch.device(device).type, (world_size,))
    layers = decoder_layers(model)
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if not layers:
        logger.warning("no decoder layers found: the model is sharded as one unit")
    return model


def full_model_state_dict(model: torch.nn.Module, ctx: DistContext) -> dict | None:
    """The unsharded weights on rank 0's CPU (None elsewhere); collective."""
    if not ctx.enabled:
        return None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if not ctx.is_main:
        return None
    # Tied weights (lm_head = embed_tokens) come back as two tensors; keep the first
    # name only, as save_pretrained does for an unsharded model.
    seen: set[int] = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            sd.pop(name, None)
        seen.add(id(param))
    return sd


def full_optimizer_state_dict(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, ctx: DistContext
) -> dict:
    """Optimizer state keyed by parameter name, unsharded (rank 0); collective.

    Keyed by name rather than position, so a checkpoint loads at any world size.
    """
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
    )

    return get_optimizer_state_dict(
        model,
        optimizer,
        options=StateDictOptions(full_state_dict=True, cpu_offload=ctx.enabled),
    )


def load_optimizer_state_dict(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict | None, ctx: DistContext
) -> None:
    """Load a name-keyed optimizer state (read by rank 0, broadcast to the shards)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_optimizer_state_dict,
    )

    set_optimizer_state_dict(
        model,
        optimizer,
        optim_state_dict=state if state is not None else {},
        options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=ctx.enabled),
    )
