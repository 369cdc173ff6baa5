"""A multi-node job on one machine: loopback addresses as nodes, a fake ``scontrol``, torchrun.

Linux routes all of 127.0.0.0/8 to ``lo``, so 127.0.0.1, 127.0.0.2, ... are distinct
addresses a server can bind the same port on: each stands in for a node. The original's
discovery (``ServerManager`` with ``slurm=True``) reads ``SLURM_JOB_NODELIST`` through
``scontrol show hostnames``; :func:`fake_slurm` puts an ``scontrol`` on ``PATH`` that answers
with the loopback "nodes", so that discovery runs unchanged.

Example::

    env = fake_slurm(tmp / "bin", ["127.0.0.1", "127.0.0.2"], training_nodes=1, infer_tp=4)
    # ServerManager(slurm=True) in a process with ``env`` finds 127.0.0.2:9000 and :9001
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import sys
from pathlib import Path
from typing import Any, Dict, List, Sequence

__all__ = [
    "MARK_ENV",
    "fake_slurm",
    "marked_processes",
    "serve_model_node_cmd",
    "signal_processes",
    "torchrun_node_cmd",
]

MARK_ENV = "ATROPOS_TEST_JOB_MARK"
"""A variable put in every process of a rehearsal: what carries it belongs to the job, whoever
its parent is by then (the check for leftovers reads the process table, not a tree)."""


def fake_slurm(
    bin_dir: Path, hosts: Sequence[str], training_nodes: int = 1, infer_tp: int = 1
) -> Dict[str, str]:
    """Write ``bin_dir/scontrol`` (``show hostnames`` prints ``hosts``, one a line) and return
    the variables a process of the job needs: ``PATH`` with it first, ``SLURM_JOB_NODELIST``,
    ``NUM_TRAINING_NODES`` and ``INFER_TP``."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    script = bin_dir / "scontrol"
    lines = "\n".join(hosts)
    script.write_text(
        "#!/bin/sh\n"
        '[ "$1" = show ] && [ "$2" = hostnames ] || { echo "fake scontrol: $*" >&2; exit 2; }\n'
        f"printf '%s\\n' {shlex.quote(lines)}\n"
    )
    script.chmod(0o755)
    return {
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        "SLURM_JOB_NODELIST": f"node[1-{len(hosts)}]",
        "NUM_TRAINING_NODES": str(training_nodes),
        "INFER_TP": str(infer_tp),
    }


def serve_model_node_cmd(model_dir: str | Path, host: str, port: int, *extra: str) -> List[str]:
    """``atropos-serve-model`` bound to ``host:port`` (one "node"'s GPU group)."""
    return [
        sys.executable,
        "-m",
        "atroposlib.cli.serve_model",
        str(model_dir),
        "--host",
        host,
        "--port",
        str(port),
        *extra,
    ]


def torchrun_node_cmd(
    nnodes: int,
    endpoint: str,
    run_id: str,
    local_addr: str,
    module: str,
    *args: str,
    nproc_per_node: int = 1,
) -> List[str]:
    """One node's ``torchrun`` of a ``--nnodes`` job meeting at ``endpoint`` (c10d), running
    ``python -m module args``."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={nnodes}",
        f"--nproc-per-node={nproc_per_node}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={run_id}",
        f"--local-addr={local_addr}",
        "-m",
        module,
        *args,
    ]


def marked_processes(mark: str) -> List[Any]:
    """Every live process (``psutil.Process``) whose environment has :data:`MARK_ENV` = ``mark``."""
    import psutil

    found = []
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if p.status() != psutil.STATUS_ZOMBIE and p.environ().get(MARK_ENV) == mark:
                found.append(p)
    return found


def signal_processes(pids: Sequence[int], sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` to each of ``pids`` that still exists."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)
