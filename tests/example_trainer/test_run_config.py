"""atropos-grpo-run configuration: YAML + flags, bad input exits 2, helpers."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from example_trainer.run import (
    RunConfig,
    clear_previous_run,
    config_from_args,
    load_function,
    plot_curve,
)

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "example_trainer" / "configs" / "demo_cpu.yaml"


def test_demo_config_is_valid_and_uses_http_reload_on_arithmetic():
    cfg = config_from_args(["--config", str(DEMO)])
    assert cfg.weight_bridge_mode == "http_reload"
    assert cfg.envs == ["environments/arithmetic_server.py"]
    assert cfg.warmup is not None and cfg.eval is not None
    assert callable(load_function(cfg.warmup.examples)) and callable(
        load_function(cfg.eval.function)
    )


def test_flags_override_yaml_and_trainer_args_pass_through(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({"model": "tiny", "trainer": {"lr": 0.01, "training_steps": 5}}))
    cfg = config_from_args(
        ["--config", str(path), "--training-steps", "7", "--no-warmup", "--", "--clip-eps", "0.1"]
    )
    assert cfg.trainer == {"lr": 0.01, "training_steps": 7}
    assert cfg.trainer_args == ["--clip-eps", "0.1"]
    assert cfg.warmup is None


@pytest.mark.parametrize(
    "argv, content, needle",
    [
        (["--bogus"], None, "--bogus"),
        ([], {"not_a_field": 1}, "not_a_field"),
        ([], {"trainer": {"lr": -1}}, "bad.yaml: trainer.lr: "),
        (["--", "--no-such-trainer-flag"], None, "--no-such-trainer-flag"),
        ([], "- just\n- a list\n", "mapping"),
    ],
)
def test_bad_run_config_exits_2_with_reason(tmp_path, capsys, argv, content, needle):
    args = list(argv)
    if content is not None:
        path = tmp_path / "bad.yaml"
        path.write_text(content if isinstance(content, str) else yaml.safe_dump(content))
        args = ["--config", str(path), *args]
    with pytest.raises(SystemExit) as exc:
        config_from_args(args)
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err


def test_load_function_errors_are_clear(tmp_path):
    with pytest.raises(ValueError, match="file.py:function"):
        load_function("environments/arithmetic_server.py")
    with pytest.raises(FileNotFoundError):
        load_function("nope/missing.py:f")
    with pytest.raises(ValueError, match="no 'missing'"):
        load_function("environments/arithmetic_server.py:missing")


def test_plot_curve_and_clear_previous_run(tmp_path):
    rows = [{"step": i, "train/mean_score": i / 10} for i in range(1, 11)]
    plot_curve(rows, [{"step": 0, "score": 0.1, "label": "before"}], tmp_path / "curve.png")
    assert (tmp_path / "curve.png").stat().st_size > 1000
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    (tmp_path / "logs").mkdir()
    clear_previous_run(tmp_path)
    assert not (tmp_path / "curve.png").exists() and not (tmp_path / "logs").exists()


def test_run_config_fields_are_documented():
    assert all(f.description for f in RunConfig.model_fields.values())


def test_device_precision_and_trainer_procs_reach_the_trainer_command(tmp_path):
    from example_trainer.launch.launcher import Launcher

    cfg = config_from_args(
        [
            "--run-dir",
            str(tmp_path / "run"),
            "--device",
            "cpu",
            "--precision",
            "bf16-mixed",
            "--trainer-procs",
            "2",
        ]
    )
    cmd = Launcher(cfg).trainer_cmd("/m")
    assert cmd[1:5] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    assert cmd[5:7] == ["-m", "example_trainer.grpo"]
    flags = dict(zip(cmd[7::2], cmd[8::2], strict=False))
    assert flags["--device"] == "cpu" and flags["--precision"] == "bf16-mixed"
    assert flags["--model-name"] == "/m"


def test_inference_command_is_server_command_with_device_and_dtype(tmp_path, monkeypatch):
    from example_trainer.launch.launcher import Launcher
    from example_trainer.vllm_manager import server_command

    cfg = config_from_args(
        [
            "--run-dir",
            str(tmp_path / "run"),
            "--inference-device",
            "cuda:1",
            "--inference-dtype",
            "bfloat16",
            "--inference-port",
            "9123",
        ]
    )
    cmd, env = Launcher(cfg).inference_cmd("/m")
    base = server_command("serve_model", "/m", 9123, "/m", device="cuda", dtype="bfloat16")
    assert cmd[: len(base)] == base
    assert ["--device", "cuda"] == cmd[cmd.index("--device") : cmd.index("--device") + 2]
    assert env == {"CUDA_VISIBLE_DEVICES": "1"}
    # The vLLM command is built without vLLM installed: only its interpreter is named.
    monkeypatch.setenv("ATROPOS_VLLM_PYTHON", "/opt/vllm/bin/python")
    vllm = server_command("vllm", "/m", 9123, dtype="float16")
    assert vllm[vllm.index("--dtype") + 1] == "float16"


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--device", "cpu", "--precision", "fp16-mixed"], "CUDA"),
        (["--trainer-procs", "2", "--weight-bridge-mode", "lora_only"], "LoRA"),
        (["--precision", "fp8"], "--precision"),
    ],
)
def test_unsupported_trainer_settings_exit_2_before_anything_starts(argv, needle, capsys):
    with pytest.raises(SystemExit) as exc:
        config_from_args(argv)
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err


def test_warmup_runs_on_the_trainer_device(tmp_path, monkeypatch):
    import example_trainer.launch.warmup as warmup
    from example_trainer.launch.launcher import Launcher

    seen = {}

    def fake_warmup(model, examples, cache, **kw):
        seen.update(kw)
        return model

    monkeypatch.setattr(warmup, "sft_warmup", fake_warmup)
    cfg = config_from_args(
        ["--config", str(DEMO), "--run-dir", str(tmp_path / "r"), "--device", "cuda:3"]
    )
    Launcher(cfg).prepare_model()
    assert seen["device"] == "cuda:3"
