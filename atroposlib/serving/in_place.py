"""Weight updates into the served model's own tensors (``--swap-in-place``).

The default update loads a second model and swaps it in, so the device briefly holds two
copies of the weights. In place, :func:`plan_in_place` reads only the safetensors headers
and checks every name and shape against the served model; :meth:`InPlaceUpdate.apply`
then reads one tensor at a time on the CPU and copies it into the existing parameter
(the engine calls it between decode steps, in its worker thread). The extra memory is
one tensor, never a model.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from atroposlib.http.openai_protocol import InvalidRequest
from atroposlib.serving.loader import checkpoint_misfit

logger = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


@dataclass
class InPlaceUpdate:
    """A validated checkpoint: for each shard, the tensors to read and where they go."""

    path: str
    shards: list[tuple[str, list[tuple[str, torch.Tensor]]]]

    @property
    def tensors(self) -> int:
        """Number of tensors :meth:`apply` copies."""
        return sum(len(names) for _, names in self.shards)

    @torch.no_grad()
    def apply(self, read: Callable[[Any, str], torch.Tensor] | None = None) -> None:
        """Copy the checkpoint into the served tensors, one tensor at a time.

        ``read(handle, name)`` returns one tensor of an open shard (default
        ``handle.get_tensor(name)``); tests pass their own to watch what is held.
        """
        from safetensors import safe_open

        read = read or (lambda handle, name: handle.get_tensor(name))
        for file, targets in self.shards:
            with safe_open(file, framework="pt", device="cpu") as handle:
                for name, target in targets:
                    tensor = read(handle, name)
                    if tensor.shape != target.shape:  # the file changed since the check
                        raise ValueError(
                            f"{name} now has shape {list(tensor.shape)} in {file}, "
                            f"the served model {list(target.shape)}"
                        )
                    target.copy_(tensor)
                    del tensor


def _shard_files(path: str) -> dict[str, list[str]]:
    """Shard file → tensor names, from the index (sharded) or the one file's header."""
    from safetensors import safe_open

    index = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        files: dict[str, list[str]] = {}
        for name, shard in weight_map.items():
            if not isinstance(shard, str) or os.path.basename(shard) != shard:
                raise InvalidRequest(
                    f"checkpoint {path!r}: {INDEX_FILE} names a shard outside the directory",
                    param="path",
                )
            files.setdefault(os.path.join(path, shard), []).append(name)
        return files
    single = os.path.join(path, SINGLE_FILE)
    if not os.path.isfile(single):
        raise InvalidRequest(
            f"checkpoint {path!r} has no {SINGLE_FILE} or {INDEX_FILE}: --swap-in-place "
            "reads safetensors only",
            param="path",
        )
    with safe_open(single, framework="pt", device="cpu") as handle:
        return {single: list(handle.keys())}


def _model_type(path: str) -> str | None:
    try:
        with open(os.path.join(path, "config.json")) as f:
            return json.load(f).get("model_type")
    except FileNotFoundError:
        return None
    except (OSError, ValueError, AttributeError) as exc:
        raise InvalidRequest(f"cannot read {path!r}/config.json: {exc}", param="path") from exc


def plan_in_place(path: str, current: Any) -> InPlaceUpdate:
    """Check the checkpoint at ``path`` against ``current`` without reading any weights.

    Every checkpoint tensor must name a tensor of the served model's ``state_dict`` with the
    same shape, and every parameter must be covered (tied parameters by any of their names).
    Raises :class:`InvalidRequest` (param ``path``) otherwise, before anything is copied.
    """
    from safetensors import safe_open

    if not os.path.isdir(path):
        raise InvalidRequest(f"checkpoint directory {path!r} does not exist", param="path")
    served_type = current.config.model_type
    found_type = _model_type(path)
    if found_type is not None and found_type != served_type:
        raise InvalidRequest(
            f"checkpoint {path!r} is a {found_type} model; the server runs {served_type}",
            param="path",
        )
    targets = current.state_dict(keep_vars=True)
    try:
        files = _shard_files(path)
        shapes: dict[str, tuple[int, ...]] = {}
        for file, names in files.items():
            with safe_open(file, framework="pt", device="cpu") as handle:
                present = set(handle.keys())
                for name in names:
                    if name not in present:
                        raise InvalidRequest(
                            f"checkpoint {path!r}: {name!r} is not in {os.path.basename(file)}",
                            param="path",
                        )
                    shapes[name] = tuple(handle.get_slice(name).get_shape())
    except InvalidRequest:
        raise
    except (OSError, ValueError, KeyError, RuntimeError, AttributeError, TypeError) as exc:
        raise InvalidRequest(f"cannot read checkpoint {path!r}: {exc}", param="path") from exc
    problems = [f"{n} is not in the served model" for n in shapes if n not in targets]
    problems += [
        f"{n} has shape {list(s)}, the served model {list(targets[n].shape)}"
        for n, s in shapes.items()
        if n in targets and tuple(targets[n].shape) != s
    ]
    covered = {id(targets[n]) for n in shapes if n in targets}
    problems += [f"{n} is missing" for n, p in current.named_parameters() if id(p) not in covered]
    if problems:
        raise checkpoint_misfit(path, problems)
    return InPlaceUpdate(
        path, [(file, [(n, targets[n]) for n in names]) for file, names in files.items()]
    )
