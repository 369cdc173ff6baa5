"""atropos-grpo-run's ``teacher:`` section: parsing, bad input, the teacher's flags and its cache."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from example_trainer.launch.processes import ProcessGroup
from example_trainer.launch.run_config import TeacherSection
from example_trainer.run import config_from_args
from example_trainer.teacher import MARKER, build_teacher, resolve_teacher, teacher_key

ROOT = Path(__file__).resolve().parents[2]
DISTILL = ROOT / "example_trainer" / "configs" / "distill_cpu.yaml"
DEMO = ROOT / "example_trainer" / "configs" / "demo_cpu.yaml"
TEACHER = ROOT / "example_trainer" / "configs" / "teacher_cpu.yaml"


def _config(tmp_path: Path, teacher: object) -> list[str]:
    path = tmp_path / "run.yaml"
    path.write_text(
        yaml.safe_dump({"run_dir": str(tmp_path / "run"), "teacher": teacher}, sort_keys=False)
    )
    return ["--config", str(path)]


def test_distill_config_serves_the_demo_teacher_to_the_teacher_env_with_distillation_on():
    cfg = config_from_args(["--config", str(DISTILL)])
    assert cfg.teacher is not None
    assert Path(cfg.teacher.from_config).resolve() == TEACHER
    assert cfg.teacher.port == 0 and cfg.teacher.model is None
    assert cfg.envs == ["environments/arithmetic_teacher_distill.py"]
    assert cfg.trainer["distill_enabled"] is True
    # The student starts from the teacher's (and the demo's) warm-up, is scored by the same
    # eval and trains with the teacher's settings plus the teacher's term.
    teacher = config_from_args(["--config", str(TEACHER)])
    demo = config_from_args(["--config", str(DEMO)])
    assert cfg.warmup == teacher.warmup == demo.warmup and cfg.eval == teacher.eval == demo.eval
    assert {k: v for k, v in cfg.trainer.items() if not k.startswith("distill")} == teacher.trainer


@pytest.mark.parametrize(
    "teacher, needle",
    [
        ({"model": "/m", "from_config": str(DEMO)}, "exactly one of teacher.model"),
        ({"port": 0}, "exactly one of teacher.model"),
        ({"from_config": "no/such.yaml"}, "teacher.from_config: no such file"),
        ({"model": "/m", "port": 70000}, "teacher.port"),
        ({"model": "/m", "bogus": 1}, "teacher.bogus"),
        ({"model": " "}, "teacher.model must not be empty"),
        ({"model": "/m", "served_model_name": ""}, "teacher.served_model_name"),
        ("just-a-path", "teacher"),
    ],
)
def test_bad_teacher_section_exits_2_naming_the_field(tmp_path, capsys, teacher, needle):
    with pytest.raises(SystemExit) as exc:
        config_from_args(_config(tmp_path, teacher))
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err


def test_teacher_server_url_reaches_every_environment_and_only_with_a_teacher(tmp_path):
    from example_trainer.launch.launcher import Launcher

    cfg = config_from_args(
        _config(tmp_path, {"model": "/teacher", "port": 9177, "served_model_name": "tch"})
    )
    launcher = Launcher(cfg)
    cmd = launcher.env_cmd("environments/arithmetic_teacher_distill.py", "/student")
    flags = dict(zip(cmd[3::2], cmd[4::2], strict=False))
    assert flags["--teacher.base_url"] == "http://127.0.0.1:9177/v1"
    assert flags["--teacher.model_name"] == "tch"
    assert flags["--teacher.server_type"] == "vllm"
    assert flags["--openai.model_name"] == "/student"
    # A given checkpoint is served as is: nothing is built; the environment compares its
    # tokenizer (the checkpoint's, not the served name's) with the student's.
    assert launcher.prepare_teacher() == "/teacher" and launcher.procs.children == {}
    cmd = launcher.env_cmd("environments/arithmetic_teacher_distill.py", "/student")
    flags = dict(zip(cmd[3::2], cmd[4::2], strict=False))
    assert flags["--teacher.tokenizer_name"] == "/teacher"
    plain = config_from_args(["--run-dir", str(tmp_path / "plain")])
    assert not any(a.startswith("--teacher.") for a in Launcher(plain).env_cmd("e.py", "/s"))


def test_a_cached_teacher_is_served_without_running_its_config_again(tmp_path):
    section = TeacherSection(from_config=str(DEMO), cache_dir=str(tmp_path / "cache"))
    root = tmp_path / "cache" / teacher_key(DEMO)
    final = root / "run" / "checkpoints" / "final_model"
    final.mkdir(parents=True)
    (final / "config.json").write_text("{}")
    (root / MARKER).write_text(json.dumps({"model": str(final), "build_seconds": 200.0}))
    procs = ProcessGroup(tmp_path / "run")
    model, info, built = resolve_teacher(section, procs)
    assert (model, built, info["build_seconds"]) == (str(final), False, 200.0)
    assert procs.children == {}
    # Another content is another teacher.
    other = tmp_path / "other.yaml"
    other.write_text(DEMO.read_text() + "\n# changed\n")
    assert teacher_key(other) != teacher_key(DEMO)


def test_a_failing_teacher_run_is_a_clear_error_with_its_log(tmp_path):
    bad = tmp_path / "teacher.yaml"
    bad.write_text(yaml.safe_dump({"no_such_field": 1}))
    section = TeacherSection(from_config=str(bad), cache_dir=str(tmp_path / "cache"))
    procs = ProcessGroup(tmp_path / "run")
    try:
        with pytest.raises(RuntimeError, match="teacher.from_config's run failed") as exc:
            build_teacher(section, procs, poll=0.05)
    finally:
        procs.stop_all()
    assert "no_such_field" in str(exc.value)
    # The teacher's run has teacher.max_build_time, not its config's demo wall-time limit.
    cmd = procs.children["teacher-build"].cmd
    assert cmd[cmd.index("--max-wall-time") + 1] == "0"
    assert not (tmp_path / "cache" / teacher_key(bad) / MARKER).exists()
