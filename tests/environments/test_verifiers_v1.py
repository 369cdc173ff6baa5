"""``VerifiersEnv`` runs a verifiers 0.4 taskset (``vf_v1_tasks``, offline) through the
OpenAI proxy against the tiny model, as processes: serve-model, the proxy, and the
environment under ``.venv-verifiers/bin/python`` (verifiers 0.4 needs openai<3, so it
has a venv of its own; ``make test`` builds it).

Without that venv the process tests skip, except under CI (``CI`` set), where they
fail and name the command that builds it: CI must never pass without running them.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import subprocess
from pathlib import Path
from typing import Dict, Iterator

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from atroposlib.testing.proxy import running_proxy
from tests.environments.env_helpers import check_groups, process_argv, unmasked_runs

ROOT = Path(__file__).resolve().parents[2]
VENV_PYTHON = ROOT / ".venv-verifiers" / "bin" / "python"
SERVER = ROOT / "environments" / "verifiers_v1_server.py"
BUILD_HINT = "build it with `make .venv-verifiers` (verifiers 0.4 from requirements-verifiers.lock)"
WORDS = ["apple", "river", "stone", "cloud", "green", "tiger", "piano", "lemon"]


@functools.cache
def _verifiers_v1_python() -> str:
    """The venv interpreter with verifiers 0.4; skips (fails under CI) without it. Probed
    once per session (importing verifiers costs seconds of CPU)."""
    problem = None
    if not VENV_PYTHON.exists():
        problem = f"{VENV_PYTHON} does not exist"
    else:
        probe = subprocess.run(
            [str(VENV_PYTHON), "-c", "import verifiers.v1"], capture_output=True, text=True
        )
        if probe.returncode != 0:
            problem = f"{VENV_PYTHON} cannot import verifiers.v1: {probe.stderr[-500:]}"
    if problem is not None:
        message = f"{problem}; {BUILD_HINT}"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return str(VENV_PYTHON)


def _expected_score(reply: str, word: str) -> float:
    """``vf_v1_tasks``'s scorer, restated: the word in the reply is 1.0, else half the
    share of letters (verifiers strips the reply first)."""
    reply = reply.strip()
    if word in reply.lower():
        return 1.0
    return round(0.5 * sum(c.isalpha() for c in reply) / len(reply), 4) if reply else 0.0


@pytest.fixture(scope="module")
def proxy(serve_model: Dict[str, str], tmp_path_factory) -> Iterator[str]:
    """URL of the managed-server proxy over the tiny model's serve-model."""
    server = {
        "base_url": serve_model["base_url"],
        "model_name": serve_model["model"],
        "server_type": "vllm",
        "timeout": 120,
    }
    config = {"servers": [server], "tokenizer": serve_model["model"]}
    with running_proxy(tmp_path_factory.mktemp("vf-proxy"), config) as running:
        yield running.url


# Runs each argv in one interpreter (starting verifiers costs seconds of CPU); an argv
# tagged "setup" only runs setup(), whose error is written to setup_error_<i>.txt.
DRIVER = """
import asyncio, json, os, runpy, sys
from atroposlib.envs.cli import build_env, parse_cli
VerifiersEnv = runpy.run_path(sys.argv[1])["VerifiersEnv"]
for i, (tag, argv) in enumerate(json.loads(sys.argv[2])):
    os.environ.pop("ATROPOS_PROXY_URL", None)  # --proxy_url sets it for the process
    env = build_env(VerifiersEnv, parse_cli(VerifiersEnv, argv))
    if tag == "setup":
        try:
            asyncio.run(env.setup())
        except Exception as err:
            open(f"setup_error_{i}.txt", "w").write(f"{type(err).__name__}: {err}")
    else:
        asyncio.run(env.process_manager() if tag == "process" else env.run_evaluate())
"""


@pytest.fixture(scope="module")
def runs(serve_model, proxy, tmp_path_factory) -> Path:
    """One environment process (the runnable file's ``VerifiersEnv`` under
    ``.venv-verifiers``) that runs ``process`` (2 groups of 2 rollouts), ``evaluate``
    (2 held-out tasks) and ``setup`` without a proxy; returns its output directory."""
    python = _verifiers_v1_python()
    tmp = tmp_path_factory.mktemp("vf-runs")
    common = ["--proxy_url", proxy, "--env.taskset_id", "vf_v1_tasks"]
    process = process_argv(serve_model, tmp / "vf.jsonl", group_size=2, steps=2)
    process += [*common, "--env.max_tokens_per_turn", "12"]
    evaluate = process_argv(serve_model, tmp / "unused.jsonl")
    evaluate[0] = "evaluate"
    evaluate += [*common, "--env.max_tokens_per_turn", "8", "--env.eval_limit", "2"]
    # refuse_event_loop: the eval taskset must be loaded off the event loop.
    evaluate += ["--env.eval_taskset_args", '{"offset": 5, "size": 3, "refuse_event_loop": true}']
    evaluate += ["--env.data_dir_to_save_evals", str(tmp / "evals")]
    no_proxy = process_argv(serve_model, tmp / "never.jsonl") + common[2:]
    dotted = process_argv(serve_model, tmp / "never.jsonl") + common[:2]
    dotted += ["--env.taskset_id", "tests.environments.vf_v1_tasks"]
    runs = [["process", process], ["evaluate", evaluate], ["setup", no_proxy], ["setup", dotted]]
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT / "tests" / "environments"),
        "WANDB_MODE": "disabled",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    env.pop("ATROPOS_PROXY_URL", None)
    done = subprocess.run(
        [python, "-c", DRIVER, str(SERVER), json.dumps(runs)],
        cwd=tmp,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return tmp


def test_process_mode_trains_the_policy_turn_scored_by_the_taskset(serve_model, runs):
    from transformers import AutoTokenizer

    groups = check_groups(runs / "vf.jsonl", group_size=2, n_groups=2, lo=0.0, hi=1.0)
    tokenizer = AutoTokenizer.from_pretrained(serve_model["model"])
    scores = []
    for group in groups:
        for tokens, masks, messages, score in zip(
            group["tokens"], group["masks"], group["messages"], group["scores"], strict=True
        ):
            assert [m["role"] for m in messages] == ["system", "user", "assistant"]
            word = messages[1]["content"].removeprefix("Say the word ").removesuffix(".")
            assert word in WORDS, messages[1]
            # Only the policy's reply is trained, and it is the text the taskset scored.
            assert unmasked_runs(masks) == 1
            trained = [t for t, m in zip(tokens, masks, strict=True) if m != -100]
            assert len(trained) <= 12  # --env.max_tokens_per_turn reached the model
            reply = messages[-1]["content"]
            assert tokenizer.decode(trained, skip_special_tokens=True).strip() == reply.strip()
            assert score == pytest.approx(_expected_score(reply, word))
            scores.append(score)
        # A group is group_size rollouts of one task.
        assert len({m[1]["content"] for m in group["messages"]}) == 1
    assert len(set(scores)) >= 2, scores


def test_evaluate_mode_reports_the_mean_reward_of_held_out_tasks(runs):
    metrics = json.loads((runs / "evals" / "metrics.json").read_text())["results"]["all"]
    assert metrics["eval/failed_rollouts"] == 0.0
    assert 0.0 <= metrics["eval/mean_reward"] <= 1.0
    assert metrics["eval/reward/says_word"] == pytest.approx(metrics["eval/mean_reward"])
    samples = [
        json.loads(line)
        for path in (runs / "evals").glob("samples*.jsonl")
        for line in path.read_text().splitlines()
    ]
    # The eval taskset's first two tasks (offset 5), not the training ones.
    assert sorted(s["task"] for s in samples) == ["echo-piano", "echo-tiger"]
    for sample in samples:
        word = sample["task"].removeprefix("echo-")
        assert sample["score"] == pytest.approx(
            _expected_score(sample["messages"][-1]["content"], word)
        )


def test_the_adapter_names_the_extra_when_verifiers_0_4_is_missing():
    """The adapter module imports without verifiers; asking for verifiers 0.4 where it
    is absent (or the 0.1 line is installed, as in the main venv) names the extra."""
    from importlib.metadata import PackageNotFoundError, version

    from atroposlib.envs.adapters import verifiers_v1

    try:
        installed = version("verifiers")
    except PackageNotFoundError:
        installed = None
    if installed is not None and installed.startswith("0.4"):
        pytest.skip("verifiers 0.4 is installed in this venv")
    with pytest.raises(ImportError, match=r"atroposlib\[verifiers-v1\].*make \.venv-verifiers"):
        verifiers_v1.import_verifiers()


def test_the_verifiers_lock_pins_verifiers_0_4_and_every_core_dependency_in_range():
    """``requirements-verifiers.lock`` (``make lock-verifiers``) matches pyproject: the
    ``verifiers-v1`` extra and every core dependency pinned inside its declared range."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = [*project["dependencies"], *project["optional-dependencies"]["verifiers-v1"]]
    pins = {}
    for line in (ROOT / "requirements-verifiers.lock").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, ver = line.partition("==")
            pins[canonicalize_name(name)] = Version(ver)
    for spec in map(Requirement, wanted):
        name = canonicalize_name(spec.name)
        assert name in pins, f"{name} is not in requirements-verifiers.lock"
        assert spec.specifier.contains(pins[name], prereleases=True), (name, pins[name])
    assert pins["openai"] < Version("3")


def test_without_the_proxy_setup_says_how_to_start_it(runs):
    error = (runs / "setup_error_2.txt").read_text()
    assert error.startswith("RuntimeError: VerifiersEnv talks to the model through"), error
    assert "managed_server_proxy" in error and "--proxy_url" in error


def test_a_dotted_taskset_id_is_refused_with_what_to_do(runs):
    # verifiers itself would fail with "No module named 'verifiers.v1.tasksets.tests'".
    error = (runs / "setup_error_3.txt").read_text()
    assert error.startswith("ValueError: env.taskset_id 'tests.environments.vf_v1_tasks'"), error
    assert "PYTHONPATH" in error


def test_an_infinite_taskset_that_runs_out_says_which_and_when():
    """An unbounded taskset whose tasks end is named in the error, not turned into
    "coroutine raised StopIteration"."""
    from atroposlib.envs.adapters.verifiers_v1 import VerifiersEnv

    config, servers = VerifiersEnv.config_init()
    env = VerifiersEnv(config.model_copy(update={"taskset_id": "endless"}), servers, testing=True)
    env._task_stream = iter(["only"])
    assert asyncio.run(env.get_next_item()) == "only"
    with pytest.raises(RuntimeError, match=r"taskset 'endless' is declared infinite .* after 1"):
        asyncio.run(env.get_next_item())


PROGRAM_DIR_PROBE = """
import os, stat, sys, tempfile
from pathlib import Path
from atroposlib.envs.adapters import _vf_chat
path = Path(_vf_chat._program_path())
info = path.parent.stat()
print(Path(tempfile.gettempdir()) in path.parents, oct(stat.S_IMODE(info.st_mode)), info.st_uid == os.getuid())
path.parent.chmod(0o755)
try:
    _vf_chat._program_path()
except RuntimeError as err:
    print("refused:", err)
"""


def test_the_chat_program_is_written_to_a_private_directory(tmp_path):
    """The program this interpreter runs lives in a 0700 directory of this user's, not in
    the shared temp dir, where another user could have made (and could change) the file;
    a directory that others can read or write is refused."""
    python = _verifiers_v1_python()
    shared = tmp_path / "shared-tmp"
    shared.mkdir()
    shared.chmod(0o1777)
    done = subprocess.run(
        [python, "-c", PROGRAM_DIR_PROBE],
        cwd=ROOT,
        env={**os.environ, "TMPDIR": str(shared)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    placed, refused = done.stdout.splitlines()
    assert placed == "False 0o700 True"
    assert refused.startswith("refused: ") and "mode 0700" in refused, refused


IMPORT_PROBE = """
import importlib.metadata
from atroposlib.envs.adapters.verifiers_v1 import import_verifiers
first = import_verifiers()
lookups = []
real = importlib.metadata.version
importlib.metadata.version = lambda name: lookups.append(name) or real(name)
print(all(import_verifiers() is first for _ in range(3)), lookups)
"""


def test_import_verifiers_reads_the_metadata_once():
    """Every rollout calls ``import_verifiers``; after the first success it hands back the
    module without scanning the installed distributions again."""
    done = subprocess.run(
        [_verifiers_v1_python(), "-c", IMPORT_PROBE],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "True []"
