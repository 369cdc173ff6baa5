"""The trainer's multi-node settings: the rendezvous flags of ``atropos-grpo`` and
``atropos-grpo-run``, the inference fleet (``--inference-urls``, ``--inference-urls-file``),
and the weight sync that reaches every server of it and names the ones it did not."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from atroposlib.testing.ports import free_port
from example_trainer.cli import config_from_args
from example_trainer.config import TrainingConfig
from example_trainer.launch.launcher import Launcher, rendezvous_flags
from example_trainer.launch.run_config import RunConfig
from example_trainer.weight_sync import HttpReloadSync, LoraOnlySync, WeightSyncError
from tests.example_trainer.test_sync_and_api import _Server

# --- atropos-grpo ------------------------------------------------------------------------


def test_rendezvous_flags_parse_and_make_one_process_per_node(tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    cfg = config_from_args(
        ["--model-name", "m", "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "n1:29500"]
    )
    assert (cfg.nnodes, cfg.node_rank, cfg.rdzv_endpoint) == (2, 1, "n1:29500")
    assert cfg.effective_world_size == 2
    monkeypatch.setenv("WORLD_SIZE", "8")  # under torchrun its environment wins
    assert cfg.effective_world_size == 8


@pytest.mark.parametrize(
    "flags, field",
    [
        (["--nnodes", "2"], "rdzv_endpoint"),
        (["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "h:1"], "node_rank"),
        (["--nnodes", "2", "--rdzv-endpoint", "no-port"], "rdzv_endpoint"),
        (["--nnodes", "2", "--rdzv-endpoint", "h:1", "--world-size", "2"], "world_size"),
        (["--inference-urls", "localhost:9000"], "inference_urls"),
    ],
)
def test_bad_rendezvous_or_url_is_refused_naming_the_field(flags, field, monkeypatch, capsys):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit) as exc:
        config_from_args(["--model-name", "m", *flags])
    assert exc.value.code == 2
    assert field.split("_")[0] in capsys.readouterr().err


def test_inference_urls_come_from_flag_list_and_file_in_order(tmp_path):
    listed = tmp_path / "servers.txt"
    listed.write_text(
        "# written by the sbatch script\nhttp://n3:9000/v1\n\nhttp://n3:9001  # second GPU group\n"
        "http://n2:9000/\n"
    )
    cfg = config_from_args(
        [
            "--model-name", "m",
            "--inference-url", "http://n2:9000",
            "--inference-urls", "http://n2:9001/v1", "http://n2:9000",
            "--inference-urls-file", str(listed),
        ]
    )  # fmt: skip
    assert cfg.resolved_inference_urls == [
        "http://n2:9000",
        "http://n2:9001",
        "http://n3:9000",
        "http://n3:9001",
    ]
    # Without a list the one server (default port) is all there is, as before.
    assert TrainingConfig(model_name="m").resolved_inference_urls == ["http://localhost:9001"]
    only_file = TrainingConfig(model_name="m", inference_urls_file=str(listed))
    assert only_file.resolved_inference_urls[0] == "http://n3:9000"


def test_a_missing_or_bad_urls_file_is_refused_naming_the_file(tmp_path, capsys):
    for content, why in [
        (None, "cannot read"),
        ("# none\n", "lists no URL"),
        ("n1:9000\n", "line 1"),
    ]:
        path = tmp_path / "urls.txt"
        path.unlink(missing_ok=True)
        if content is not None:
            path.write_text(content)
        with pytest.raises(SystemExit):
            config_from_args(["--model-name", "m", "--inference-urls-file", str(path)])
        err = capsys.readouterr().err
        assert "inference_urls_file" in err or "inference-urls-file" in err, err
        assert why in err and str(path) in err, err


def test_init_distributed_without_torchrun_meets_at_the_endpoint(monkeypatch):
    import torch.distributed as dist

    from example_trainer import distributed

    seen = {}

    def fake_init(**kw):
        seen.update(kw)

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", fake_init)
    cfg = TrainingConfig(
        model_name="m", device="cpu", nnodes=3, node_rank=2, rdzv_endpoint="127.0.0.1:29411"
    )
    ctx, device = distributed.init_distributed(cfg)
    assert (ctx.rank, ctx.world_size, device) == (2, 3, "cpu")
    assert seen["init_method"] == "tcp://127.0.0.1:29411" and seen["backend"] == "gloo"
    assert (seen["rank"], seen["world_size"]) == (2, 3)


# --- atropos-grpo-run --------------------------------------------------------------------


def _run_config(tmp_path: Path, **kw) -> RunConfig:
    return RunConfig(run_dir=str(tmp_path / "run"), model=str(tmp_path), **kw)


def test_run_config_refuses_an_incomplete_rendezvous():
    with pytest.raises(ValueError, match="rdzv_endpoint"):
        RunConfig(nnodes=2)
    with pytest.raises(ValueError, match="node_rank"):
        RunConfig(nnodes=2, node_rank=2, rdzv_endpoint="h:1")
    with pytest.raises(ValueError, match="inference_urls need"):
        RunConfig(inference_urls=["http://n2:9000"], weight_bridge_mode="none")


def test_node_one_runs_the_trainer_alone_under_a_torchrun_of_the_run(tmp_path):
    cfg = _run_config(
        tmp_path,
        nnodes=2,
        node_rank=1,
        rdzv_endpoint="10.1.0.1:29400",
        trainer_procs=4,
        inference_urls=["http://10.1.0.3:9000/v1", "http://10.1.0.3:9001"],
    )
    assert (
        cfg.only_trainer and not _run_config(tmp_path, nnodes=2, rdzv_endpoint="h:1").only_trainer
    )
    launcher = Launcher(cfg)
    cmd = launcher.trainer_cmd(str(tmp_path))
    i = cmd.index("torch.distributed.run")
    assert cmd[i + 1 : i + 7] == [
        "--nnodes=2",
        "--nproc-per-node=4",
        "--rdzv-backend=static",
        "--rdzv-endpoint=10.1.0.1:29400",
        "--rdzv-id=atropos-grpo",
        "--node-rank=1",
    ]
    assert "--standalone" not in cmd
    # run-api is on node 0 (the rendezvous host); the weights go to every listed server.
    assert cmd[cmd.index("--atropos-url") + 1] == "http://10.1.0.1:8000"
    j = cmd.index("--inference-urls")
    assert cmd[j + 1 : j + 3] == ["http://10.1.0.3:9000", "http://10.1.0.3:9001"]
    assert "--inference-url" not in cmd
    assert not launcher.starts_inference


def test_a_trainer_only_node_reaches_node_zeros_services(tmp_path):
    # Under c10d global rank 0 may be on this node: it must push to node 0's server.
    cfg = _run_config(
        tmp_path, nnodes=2, node_rank=1, rdzv_endpoint="10.1.0.1:29400", rdzv_backend="c10d"
    )
    cmd = Launcher(cfg).trainer_cmd(str(tmp_path))
    assert cmd[cmd.index("--inference-url") + 1] == "http://10.1.0.1:9001"
    assert cmd[cmd.index("--atropos-url") + 1] == "http://10.1.0.1:8000"
    with pytest.raises(ValueError, match="fixed inference_port"):
        RunConfig(nnodes=2, rdzv_endpoint="h:1", inference_port=0)
    with pytest.raises(ValueError, match="fixed api_port"):
        RunConfig(nnodes=2, rdzv_endpoint="h:1", api_port=0)


def test_c10d_rendezvous_leaves_the_node_rank_to_torchrun(tmp_path):
    cfg = _run_config(tmp_path, nnodes=2, rdzv_endpoint="h:1", rdzv_backend="c10d")
    flags = rendezvous_flags(cfg)
    assert "--rdzv-backend=c10d" in flags and not any(f.startswith("--node-rank") for f in flags)


def test_run_flags_reach_the_config(tmp_path):
    from example_trainer.run import config_from_args as run_args

    urls = tmp_path / "urls.txt"
    urls.write_text("http://127.0.0.2:9000\n")
    cfg = run_args(
        ["--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "127.0.0.1:29400",
         "--rdzv-backend", "c10d", "--inference-urls-file", str(urls), "--api-url",
         "http://127.0.0.1:8123"]
    )  # fmt: skip
    assert (cfg.nnodes, cfg.node_rank, cfg.rdzv_backend) == (2, 1, "c10d")
    assert cfg.resolved_api_url(8000) == "http://127.0.0.1:8123"


# --- the weight sync over a fleet ----------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tiny_model_dir, tmp_path_factory):
    from example_trainer.model import setup_model

    cfg = TrainingConfig(
        model_name=str(tiny_model_dir),
        device="cpu",
        progress=False,
        save_path=str(tmp_path_factory.mktemp("ckpt")),
        weight_bridge_mode="http_reload",
    )
    model, tok = setup_model(cfg)
    return cfg, model, tok


class _Versioned:
    """A fake atropos-serve-model: /health names its version, /update_weights sets it."""

    def __init__(self) -> None:
        self.version = 0
        self.server = _Server(self.handle)
        self.url = self.server.url

    def handle(self, method: str, path: str, body: bytes):
        if path == "/update_weights":
            self.version = json.loads(body).get("version", self.version + 1)
            return 200, {"version": self.version}
        return 200, {"status": "ok", "version": self.version}


def test_every_server_gets_each_sync_and_a_dead_one_is_named_not_fatal(tiny, caplog):
    cfg, model, tok = tiny
    servers = [_Versioned() for _ in range(3)]
    dead = f"http://127.0.0.1:{free_port()}"
    try:
        sync = HttpReloadSync(
            cfg.model_copy(
                update={"inference_urls": [s.url for s in servers], "sync_timeout": 5.0}
            ),
            model,
            tok,
        )
        sync.start()
        sync.sync(1)
        assert [s.version for s in servers] == [1, 1, 1] and sync.failed == {}
        servers[1].server.close()  # one inference server goes away mid-run
        sync.sync(2)
        assert [servers[0].version, servers[2].version] == [2, 2]
        assert list(sync.failed) == [servers[1].url] and sync.last_version == 2
        assert servers[1].url in caplog.text and "2 of 3" in caplog.text
        # Only when no server took the weights does the sync fail, naming each.
        everyone_dead = HttpReloadSync(
            cfg.model_copy(update={"inference_urls": [dead, servers[1].url], "sync_timeout": 2.0}),
            model,
            tok,
        )
        with pytest.raises(WeightSyncError, match="all 2 inference servers") as exc:
            everyone_dead.sync(3)
        assert dead in str(exc.value) and servers[1].url in str(exc.value)
    finally:
        for s in servers:
            s.server.close()


def test_lora_only_refuses_a_fleet(tiny):
    cfg, model, tok = tiny
    with pytest.raises(WeightSyncError, match="one inference server"):
        LoraOnlySync(
            cfg.model_copy(update={"inference_urls": ["http://a:1", "http://b:1"]}), model, tok
        )


def test_guide_flags_exist(tmp_path):
    """Every trainer and launcher flag docs/multi-node.md uses is a real flag."""
    import re

    from example_trainer.cli import build_parser
    from example_trainer.run import build_parser as run_parser

    guide = (Path(__file__).resolve().parents[2] / "docs" / "multi-node.md").read_text()
    known = set()
    for parser in (build_parser(), run_parser()):
        for action in parser._actions:
            known.update(action.option_strings)
    used = set(
        re.findall(
            r"--(?:nnodes|node-rank|rdzv-[a-z]+|inference-urls?(?:-file)?|trainer-only|api-url|api-host)\b",
            guide,
        )
    )
    torchrun_only = {"--rdzv-backend", "--rdzv-id"}  # torchrun's own, and atropos-grpo-run's
    assert used, "the guide names no multi-node flag"
    assert used - known - torchrun_only == set(), sys.version
