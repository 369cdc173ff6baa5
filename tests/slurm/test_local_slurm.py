"""The local cluster helper without Slurm: the reason it gives and its configuration."""

from __future__ import annotations

import pytest

from atroposlib.testing import slurm
from atroposlib.testing.slurm import LocalSlurm, SlurmUnavailable


def test_missing_slurm_names_the_commands_and_the_install(monkeypatch, tmp_path):
    monkeypatch.setattr(slurm, "_find", lambda name: None if name == "slurmd" else f"/x/{name}")
    problem = slurm.slurm_problem()
    assert problem is not None and "slurmd not found" in problem and "make slurm" in problem
    with pytest.raises(SlurmUnavailable, match="make slurm"):
        LocalSlurm(tmp_path).start()


def test_conf_is_one_loopback_node_without_munge(tmp_path):
    cluster = LocalSlurm(tmp_path, cpus=4)
    cluster.write_conf()
    conf = dict(line.split("=", 1) for line in cluster.conf.read_text().splitlines() if "=" in line)
    assert conf["AuthType"] == "auth/none" and conf["CredType"] == "cred/none"
    assert conf["SlurmctldHost"] == "localhost(127.0.0.1)"
    assert conf["NodeName"] == "localhost NodeAddr=127.0.0.1 CPUs=4 State=UNKNOWN"
    assert cluster.env["SLURM_CONF"] == str(cluster.conf)
