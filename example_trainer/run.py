"""``atropos-grpo-run``: the whole RL loop with one command.

Starts ``run-api``, the inference server (``atropos-serve-model`` with the offline
tiny model by default, vLLM when asked), one or more environments and the GRPO
trainer as child processes; shows their status in one place; writes each one's
log to ``RUN_DIR/logs/``; and stops everything on exit, Ctrl-C or SIGTERM (and,
through the kernel's parent-death signal, even if the launcher is killed).

Optionally (the CPU demo turns these on) it first gives the model a short cached
supervised warm-up on the task format, evaluates before and after training,
and writes ``curve.png`` and ``summary.json``/``summary.md`` to the run directory.

Examples::

    atropos-grpo-run --config example_trainer/configs/demo_cpu.yaml
    atropos-grpo-run --model ./my-model --env environments/arithmetic_server.py -- --lr 1e-4 --training-steps 50
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import signal
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Dict, List, Literal, Sequence

import httpx
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .processes import ProcessGroup

logger = logging.getLogger("atropos-grpo-run")


class WarmupSection(BaseModel):
    """Supervised warm-up on the task format before RL (cached)."""

    model_config = ConfigDict(extra="forbid")
    examples: str = Field(
        ...,
        description="'path/to/env.py:function' returning (messages, answer) pairs; called as fn(n, seed).",
    )
    n_examples: int = Field(2000, ge=1, description="Number of examples generated.")
    steps: int = Field(100, ge=1, description="Optimizer steps.")
    lr: float = Field(3e-3, gt=0, description="Learning rate.")
    batch_size: int = Field(32, ge=1, description="Examples per step.")
    seed: int = Field(0, description="Seed of the examples and the training order.")
    score_function: str | None = Field(
        None,
        description="'path/to/env.py:function' called as fn(model, tokenizer) → score, to stop early.",
    )
    stop_at_score: float | None = Field(
        None, ge=0, le=1, description="Stop the warm-up once score_function reaches this."
    )
    check_every: int = Field(10, ge=1, description="Steps between score checks.")


class EvalSection(BaseModel):
    """Evaluation through the inference server before, during and after training."""

    model_config = ConfigDict(extra="forbid")
    function: str = Field(
        ...,
        description="'path/to/env.py:function' called as fn(base_url, tokenizer) → score in [0, 1].",
    )
    every_steps: int = Field(
        0,
        ge=0,
        description="Also evaluate whenever the trainer passes a multiple of this step (0 = only before/after).",
    )


class RunConfig(BaseModel):
    """Configuration of ``atropos-grpo-run`` (YAML file and/or flags)."""

    model_config = ConfigDict(extra="forbid")
    run_dir: str | None = Field(
        None,
        description="Directory for logs, checkpoints and the summary (default runs/run-<time>).",
    )
    model: str = Field(
        "tiny", description="Model directory or hub name; 'tiny' = the offline tiny model."
    )
    served_model_name: str | None = Field(
        None, description="Model name the inference server reports (default: model path)."
    )
    api_port: int = Field(8000, ge=0, le=65535, description="run-api port (0 = any free port).")
    inference_port: int = Field(
        9001, ge=0, le=65535, description="Inference server port (0 = any free port)."
    )
    inference_backend: Literal["serve_model", "vllm"] = Field(
        "serve_model", description="Inference server: atropos-serve-model or vLLM."
    )
    inference_args: List[str] = Field(
        default_factory=list, description="Extra flags for the inference server."
    )
    envs: List[str] = Field(
        default_factory=lambda: ["environments/arithmetic_server.py"],
        description="Environment files to run (python FILE serve ...).",
    )
    env_args: List[str] = Field(
        default_factory=list, description="Extra flags for every environment."
    )
    group_size: int = Field(8, ge=1, description="--env.group_size for the environments.")
    weight_bridge_mode: Literal["http_reload", "none", "lora_only", "lora_restart"] = Field(
        "http_reload", description="Trainer weight sync mode."
    )
    trainer: Dict[str, Any] = Field(
        default_factory=dict, description="TrainingConfig fields for the trainer (snake_case keys)."
    )
    trainer_args: List[str] = Field(
        default_factory=list,
        description="Extra atropos-grpo flags (after '--' on the command line).",
    )
    warmup: WarmupSection | None = Field(None, description="Supervised warm-up before RL.")
    eval: EvalSection | None = Field(None, description="Evaluation before/after training.")
    cpu_threads: int = Field(
        0,
        ge=0,
        description="If > 0: OMP/torch CPU threads for every process (1 is fastest on a busy CPU).",
    )
    startup_timeout: float = Field(
        180.0, gt=0, description="Seconds each service may take to become healthy."
    )
    max_wall_time: float = Field(
        0.0, ge=0, description="Stop everything after this many seconds (0 = no limit)."
    )
    status_interval: float = Field(1.0, gt=0, description="Seconds between status refreshes.")


# --- helpers -----------------------------------------------------------------------------


def load_function(spec: str) -> Callable[..., Any]:
    """Import ``'path/to/file.py:name'`` (or ``'package.module:name'``) and return the attribute."""
    target, _, attr = spec.partition(":")
    if not attr:
        raise ValueError(f"expected 'file.py:function', got {spec!r}")
    if target.endswith(".py"):
        path = Path(target)
        if not path.exists():
            raise FileNotFoundError(f"{target} does not exist")
        mod_spec = importlib.util.spec_from_file_location(f"_atropos_run_{path.stem}", path)
        module = importlib.util.module_from_spec(mod_spec)  # type: ignore[arg-type]
        mod_spec.loader.exec_module(module)  # type: ignore[union-attr]
    else:
        module = importlib.import_module(target)
    try:
        return getattr(module, attr)
    except AttributeError as exc:
        raise ValueError(f"{target} has no {attr!r}") from exc


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def resolve_model(model: str) -> str:
    """``tiny`` → the offline tiny model directory (built once); anything else unchanged."""
    if model == "tiny":
        from atroposlib.tiny_model import ensure_tiny_model

        return ensure_tiny_model()
    return model


def _flags(d: Dict[str, Any]) -> List[str]:
    out: List[str] = []
    for k, v in d.items():
        flag = "--" + k.replace("_", "-")
        if isinstance(v, (list, tuple)):
            out += [flag, *map(str, v)]
        elif v is None:
            continue
        else:
            out += [flag, str(v).lower() if isinstance(v, bool) else str(v)]
    return out


def clear_previous_run(run_dir: Path) -> None:
    """Remove a previous run's results from ``run_dir`` so a rerun starts clean."""
    import shutil

    for name in ("metrics.jsonl", "summary.json", "summary.md", "curve.png"):
        (run_dir / name).unlink(missing_ok=True)
    for name in ("logs", "checkpoints"):
        shutil.rmtree(run_dir / name, ignore_errors=True)


def read_metrics(path: Path) -> List[Dict[str, Any]]:
    """Trainer ``metrics.jsonl`` rows (a partial last line is skipped)."""
    rows: List[Dict[str, Any]] = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


# --- the launcher ---------------------------------------------------------------------------


class Launcher:
    """Runs one training job end to end. See the module docstring."""

    def __init__(self, config: RunConfig) -> None:
        self.config = config
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        self.run_dir = Path(config.run_dir or f"runs/run-{stamp}").resolve()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if not config.trainer.get("resume"):
            clear_previous_run(self.run_dir)
        threads = (
            {k: str(config.cpu_threads) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
            if config.cpu_threads
            else {}
        )
        self.procs = ProcessGroup(self.run_dir, env=threads)
        if config.cpu_threads:
            import torch

            torch.set_num_threads(config.cpu_threads)
        self.api_port = config.api_port or _free_port()
        self.inf_port = config.inference_port or _free_port()
        self.api_url = f"http://127.0.0.1:{self.api_port}"
        self.inf_url = f"http://127.0.0.1:{self.inf_port}"
        self.evals: List[Dict[str, float]] = []
        self.inference_version: int | None = None
        self.t0 = time.time()

    # -- phases
    def prepare_model(self) -> str:
        """Resolve the model and run the cached warm-up if configured."""
        model = resolve_model(self.config.model)
        w = self.config.warmup
        if w is not None:
            from .warmup import sft_warmup

            examples = load_function(w.examples)(w.n_examples, w.seed)
            logger.info("supervised warm-up: %d steps on %d examples", w.steps, len(examples))
            cache = Path(".cache") / f"warmup-{Path(model).name}-{w.steps}"
            score_fn = load_function(w.score_function) if w.score_function else None
            model = sft_warmup(
                model,
                examples,
                cache,
                steps=w.steps,
                lr=w.lr,
                batch_size=w.batch_size,
                seed=w.seed,
                score_fn=score_fn,
                stop_at_score=w.stop_at_score,
                check_every=w.check_every,
            )
        return str(Path(model).resolve()) if Path(model).exists() else model

    def start_services(self, model: str) -> None:
        """run-api and (unless the trainer owns it) the inference server."""
        c = self.config
        self.procs.start(
            "api",
            [
                sys.executable,
                "-m",
                "atroposlib.cli.run_api",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.api_port),
            ],
        )
        if c.weight_bridge_mode not in ("none", "lora_restart"):
            name = c.served_model_name or model
            if c.inference_backend == "vllm":
                cmd = [
                    sys.executable,
                    "-m",
                    "vllm.entrypoints.openai.api_server",
                    "--model",
                    model,
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(self.inf_port),
                    "--served-model-name",
                    name,
                ]
            else:
                cmd = [
                    sys.executable,
                    "-m",
                    "atroposlib.cli.serve_model",
                    model,
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(self.inf_port),
                    "--served-model-name",
                    name,
                    # the trainer's http_reload weights land here; other paths get 403
                    "--weights-root",
                    str(self.run_dir / "checkpoints"),
                ]
            self.procs.start("inference", cmd + list(c.inference_args))
            self.procs.wait_healthy("inference", f"{self.inf_url}/health", c.startup_timeout)
        self.procs.wait_healthy("api", f"{self.api_url}/health", c.startup_timeout)

    def trainer_cmd(self, model: str) -> List[str]:
        """The ``atropos-grpo`` command line."""
        c = self.config
        fields = {
            "save_path": str(self.run_dir / "checkpoints"),
            "log_dir": str(self.run_dir),
            "atropos_url": self.api_url,
            "vllm_port": self.inf_port,
            "inference_url": self.inf_url,
            "weight_bridge_mode": c.weight_bridge_mode,
            "progress": False,
            "inference_backend": "vllm" if c.inference_backend == "vllm" else "serve_model",
            "device": "cpu",
        }
        try:
            import torch

            fields["device"] = "cuda" if torch.cuda.is_available() else "cpu"
        except ImportError:
            pass
        fields.update(c.trainer)
        fields["model_name"] = model
        return [sys.executable, "-m", "example_trainer.grpo", *_flags(fields), *c.trainer_args]

    def env_cmd(self, env_file: str, model: str) -> List[str]:
        """``python ENV serve ...`` for one environment."""
        c = self.config
        return [
            sys.executable,
            env_file,
            "serve",
            "--env.rollout_server_url",
            self.api_url,
            "--env.tokenizer_name",
            model,
            "--env.use_wandb",
            "false",
            "--env.group_size",
            str(c.group_size),
            "--openai.base_url",
            f"{self.inf_url}/v1",
            "--openai.model_name",
            c.served_model_name or model,
            "--openai.server_type",
            "vllm",
            "--openai.api_key",
            "x",
            *c.env_args,
        ]

    def evaluate(self, label: str, step: int, model: str) -> float | None:
        """Run the configured eval function against the inference server."""
        if self.config.eval is None:
            return None
        from transformers import AutoTokenizer

        fn = load_function(self.config.eval.function)
        t = time.time()
        score = float(fn(self.inf_url, AutoTokenizer.from_pretrained(model)))
        self.evals.append(
            {"label": label, "step": step, "score": score, "seconds": time.time() - t}
        )
        logger.info("eval %s (step %d): %.3f", label, step, score)
        return score

    # -- main loop
    def run(self) -> int:
        """Do the whole job; returns the exit status."""
        c = self.config
        model = self.prepare_model()
        self.start_services(model)
        own_inference = c.weight_bridge_mode not in ("none", "lora_restart")
        if own_inference:
            self.evaluate("before", 0, model)
        self.procs.start("trainer", self.trainer_cmd(model))
        for i, env_file in enumerate(c.envs):
            self.procs.start(f"env{i}" if len(c.envs) > 1 else "env", self.env_cmd(env_file, model))
        if not own_inference:
            self.procs.wait_healthy("trainer", f"{self.inf_url}/health", c.startup_timeout)
            self.evaluate("before", 0, model)
        status = self.monitor(model)
        if status == 0 and own_inference:
            self.evaluate("after", self._last_step(), model)
            self.inference_version = self._inference_version()
        elif status == 0 and c.eval is not None:
            self.evaluate_served_checkpoint(model)
        self.write_summary(status)
        return status

    def evaluate_served_checkpoint(self, model: str) -> None:
        """Restart modes: the trainer's server is gone, so serve its last weights briefly and evaluate."""
        served = sorted(
            (self.run_dir / "checkpoints" / "served_weights").glob("step_*"),
            key=lambda p: int(p.name.split("_")[1]),
        )
        if not served:
            logger.warning("no served weights found; skipping the final eval")
            return
        self.procs.start(
            "inference-eval",
            [
                sys.executable,
                "-m",
                "atroposlib.cli.serve_model",
                str(served[-1]),
                "--host",
                "127.0.0.1",
                "--port",
                str(self.inf_port),
            ],
        )
        try:
            self.procs.wait_healthy(
                "inference-eval", f"{self.inf_url}/health", self.config.startup_timeout
            )
            self.evaluate("after", self._last_step(), model)
        finally:
            self.procs.stop("inference-eval")

    def _inference_version(self) -> int | None:
        try:
            return httpx.get(f"{self.inf_url}/health", timeout=5.0).json().get("version")
        except (httpx.HTTPError, ValueError, AttributeError):
            return None

    def _last_step(self) -> int:
        rows = read_metrics(self.run_dir / "metrics.jsonl")
        return int(rows[-1]["step"]) if rows else 0

    def monitor(self, model: str) -> int:
        """Show status until the trainer exits; 0 on success."""
        from rich.console import Console
        from rich.live import Live

        console = Console(stderr=True)
        every = self.config.eval.every_steps if self.config.eval else 0
        next_eval = every
        with Live(self._table(), console=console, refresh_per_second=2, transient=False) as live:
            while True:
                rc = self.procs.children["trainer"].returncode()
                step = self._last_step()
                if every and step >= next_eval and rc is None:
                    self.evaluate("during", step, model)
                    next_eval = (step // every + 1) * every
                live.update(self._table())
                if rc is not None:
                    if rc != 0:
                        console.print(
                            f"[red]trainer exited with code {rc}[/red]\n"
                            + self.procs.children["trainer"].log_tail()
                        )
                    return rc
                dead = self.procs.failed(ignore=("trainer",))
                if dead is not None:
                    console.print(
                        f"[red]{dead.name} exited with code {dead.returncode()}[/red]\n{dead.log_tail()}"
                    )
                    return 1
                if self.config.max_wall_time and time.time() - self.t0 > self.config.max_wall_time:
                    console.print("[red]max_wall_time reached[/red]")
                    return 1
                time.sleep(self.config.status_interval)

    def _table(self) -> Any:
        from rich.table import Table

        table = Table(title=f"atropos-grpo-run  {self.run_dir}  ({time.time() - self.t0:.0f}s)")
        for col in ("process", "pid", "state", "log"):
            table.add_column(col)
        for child in self.procs.children.values():
            rc = child.returncode()
            state = (
                "[green]running[/green]"
                if rc is None
                else ("done" if rc == 0 else f"[red]exit {rc}[/red]")
            )
            table.add_row(
                child.name, str(child.pid), state, str(child.log_path.relative_to(self.run_dir))
            )
        rows = read_metrics(self.run_dir / "metrics.jsonl")
        if rows:
            last = rows[-1]
            table.caption = (
                f"step {last['step']}  loss {last.get('train/loss', float('nan')):+.4f}  "
                f"mean score {last.get('train/mean_score', float('nan')):.3f}  "
                f"{last.get('train/tokens_per_second', 0):.0f} tok/s"
            )
        if self.evals:
            table.caption = (
                (table.caption or "")
                + "   evals: "
                + ", ".join(f"{e['label']}@{e['step']}={e['score']:.2f}" for e in self.evals)
            )
        return table

    def write_summary(self, status: int) -> Dict[str, Any]:
        """``summary.json``, ``summary.md`` and ``curve.png`` in the run directory."""
        rows = read_metrics(self.run_dir / "metrics.jsonl")
        before = next((e["score"] for e in self.evals if e["label"] == "before"), None)
        after = next((e["score"] for e in reversed(self.evals) if e["label"] == "after"), None)
        summary = {
            "status": "ok" if status == 0 else f"failed ({status})",
            "wall_time_s": round(time.time() - self.t0, 1),
            "steps": rows[-1]["step"] if rows else 0,
            "eval_before": before,
            "eval_after": after,
            "evals": self.evals,
            "first_mean_score": rows[0].get("train/mean_score") if rows else None,
            "last_mean_score": rows[-1].get("train/mean_score") if rows else None,
            "final_loss": rows[-1].get("train/loss") if rows else None,
            "inference_weights_version": self.inference_version,
            "run_dir": str(self.run_dir),
        }
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        lines = [
            f"# Run summary ({summary['status']})",
            "",
            f"- wall time: {summary['wall_time_s']} s",
            f"- trainer steps: {summary['steps']}",
        ]
        if before is not None and after is not None:
            lines.append(
                f"- eval score: {before:.3f} before → {after:.3f} after ({after - before:+.3f})"
            )
            summary["improvement"] = after - before
            summary["ratio"] = after / before if before > 0 else None
            lines.append(
                f"- learned (after >= 2x before and >= +0.3): {'yes' if after >= 2 * before and after - before >= 0.3 else 'no'}"
            )
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        (self.run_dir / "summary.md").write_text("\n".join(lines) + "\n")
        try:
            plot_curve(rows, self.evals, self.run_dir / "curve.png")
        except Exception as exc:  # plotting must never hide the run's result
            logger.warning("could not plot the curve: %s", exc)
        print("\n".join(lines))
        return summary

    def shutdown(self) -> None:
        """Stop every child process."""
        self.procs.stop_all()


def plot_curve(rows: Sequence[Dict[str, Any]], evals: Sequence[Dict[str, Any]], out: Path) -> None:
    """Reward per step (and its moving average) plus eval points, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [r["step"] for r in rows]
    scores = [r.get("train/mean_score", 0.0) for r in rows]
    if steps:
        ax.plot(steps, scores, alpha=0.35, label="batch mean reward")
        k = max(1, len(scores) // 10)
        avg = [
            sum(scores[max(0, i - k + 1) : i + 1]) / len(scores[max(0, i - k + 1) : i + 1])
            for i in range(len(scores))
        ]
        ax.plot(steps, avg, label=f"reward (moving avg {k})")
    if evals:
        ax.plot(
            [e["step"] for e in evals],
            [e["score"] for e in evals],
            "o-",
            color="black",
            label="eval score",
        )
    ax.set_xlabel("trainer step")
    ax.set_ylabel("score")
    ax.set_ylim(-0.05, 1.05)
    ax.legend(loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


# --- CLI ---------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """Flags of ``atropos-grpo-run``; everything after ``--`` goes to the trainer."""
    p = argparse.ArgumentParser(
        prog="atropos-grpo-run",
        allow_abbrev=False,
        usage="atropos-grpo-run [--config RUN.yaml] [options] [-- TRAINER FLAGS]",
        description="Start run-api, an inference server, environments and the GRPO trainer; stop them all on exit.",
    )
    p.add_argument("--config", help="YAML file with RunConfig fields.")
    p.add_argument("--run-dir", help=RunConfig.model_fields["run_dir"].description)
    p.add_argument("--model", help=RunConfig.model_fields["model"].description)
    p.add_argument("--api-port", type=int, help=RunConfig.model_fields["api_port"].description)
    p.add_argument(
        "--inference-port", type=int, help=RunConfig.model_fields["inference_port"].description
    )
    p.add_argument("--inference-backend", choices=["serve_model", "vllm"])
    p.add_argument(
        "--weight-bridge-mode", choices=["http_reload", "none", "lora_only", "lora_restart"]
    )
    p.add_argument("--env", action="append", dest="envs", help="Environment file (repeatable).")
    p.add_argument("--group-size", type=int)
    p.add_argument(
        "--training-steps", type=int, help="Shortcut for the trainer's --training-steps."
    )
    p.add_argument(
        "--max-wall-time", type=float, help=RunConfig.model_fields["max_wall_time"].description
    )
    p.add_argument(
        "--no-warmup", action="store_true", help="Skip the supervised warm-up of the config."
    )
    p.add_argument("--no-eval", action="store_true", help="Skip evaluation.")
    return p


def config_from_args(argv: Sequence[str] | None = None) -> RunConfig:
    """Merge the YAML file and flags into a :class:`RunConfig` (exit 2 on bad input)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    trainer_args: List[str] = []
    if "--" in argv:
        idx = argv.index("--")
        argv, trainer_args = argv[:idx], argv[idx + 1 :]
    parser = build_parser()
    ns = parser.parse_args(argv)
    data: Dict[str, Any] = {}
    if ns.config:
        try:
            data = yaml.safe_load(Path(ns.config).read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            parser.error(f"--config: {exc}")
        if not isinstance(data, dict):
            parser.error("--config: the YAML file must hold a mapping")
    for key in (
        "run_dir",
        "model",
        "api_port",
        "inference_port",
        "inference_backend",
        "weight_bridge_mode",
        "envs",
        "group_size",
        "max_wall_time",
    ):
        if getattr(ns, key) is not None:
            data[key] = getattr(ns, key)
    if ns.training_steps is not None:
        data.setdefault("trainer", {})["training_steps"] = ns.training_steps
    if ns.no_warmup:
        data["warmup"] = None
    if ns.no_eval:
        data["eval"] = None
    data["trainer_args"] = list(data.get("trainer_args", [])) + trainer_args
    try:
        cfg = RunConfig(**data)
    except ValidationError as exc:
        parser.error("; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()))
    if cfg.trainer or cfg.trainer_args:  # validate the trainer's flags now, not after startup
        from .cli import config_from_args as trainer_config

        trainer_config(
            [*_flags(dict(cfg.trainer)), *cfg.trainer_args, "--model-name", "x"],
            prog="atropos-grpo-run (trainer settings)",
        )
    return cfg


def _on_signal(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``atropos-grpo-run``."""
    cfg = config_from_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGHUP, _on_signal)
    launcher = Launcher(cfg)
    print(f"run directory: {launcher.run_dir}", flush=True)
    try:
        return launcher.run()
    except KeyboardInterrupt:
        logger.warning("interrupted; stopping all processes")
        return 130
    except (RuntimeError, OSError, ValueError, httpx.HTTPError) as exc:
        logger.error("%s", exc)
        return 1
    finally:
        launcher.shutdown()


if __name__ == "__main__":
    sys.exit(main())
