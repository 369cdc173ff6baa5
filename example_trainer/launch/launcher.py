"""The processes of one ``atropos-grpo-run`` job, started in order and watched to the end.

``run-api``, the inference server (unless the trainer owns it in the restart
modes), the GRPO trainer (``torchrun`` when ``trainer_procs > 1``) and the
environments, each a child of :class:`~example_trainer.launch.processes.ProcessGroup`.
The inference command line comes from :func:`~example_trainer.launch.inference_process.server_command`,
the same one the trainer uses when it restarts a server.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Dict, List

import httpx

from atroposlib.utils.ports import busy_port_message, free_port

from ..plugins import load_function
from ..teacher import resolve_teacher, teacher_env_flags
from ..vllm_integration.lora import (
    VLLM_ADAPTER_NAME,
    lora_server_args,
    policy_model_name,
    serves_adapter,
    wait_for_adapter,
)
from ..vllm_integration.weights import VLLMWeightClient, VLLMWeightError
from .evaluation import Evaluator
from .inference_process import VLLM_SERVE_ENV, server_command, split_device
from .processes import ProcessGroup
from .run_config import RunConfig
from .status import PlainProgress, eta_seconds, progress_text, status_table
from .summary import (
    TIME_LIMIT_EXIT,
    new_run_dir,
    read_metrics,
    resumed_run_dir,
    write_summary,
)

logger = logging.getLogger("atropos-grpo-run")

STOP_GRACE = 120.0
"""Seconds the trainer has, once ``max_wall_time`` is reached, to finish its step and save
``final_model`` before it is stopped without one."""
KEY_HYPERPARAMETERS = (
    "training_steps",
    "batch_size",
    "gradient_accumulation_steps",
    "seq_len",
    "lr",
    "lr_scheduler",
    "min_lr_ratio",
    "warmup_steps",
    "optimizer",
    "weight_decay",
    "max_grad_norm",
    "loss_type",
    "clip_eps",
    "kl_coef",
    "entropy_coef",
    "ppo_epochs",
    "seed",
)
"""The trainer settings ``summary.md`` lists (every setting is in ``summary.json``'s config)."""


def _default_training_steps() -> int:
    from ..config import TrainingConfig

    return int(TrainingConfig.model_fields["training_steps"].default)


def resolve_model(model: str, tiny_size: Dict[str, int] | None = None) -> str:
    """``tiny`` → the offline tiny model directory (built once; ``tiny_size`` overrides its
    shape, cached under a name of its own); ``smollm2`` → the real SmolLM2-135M-Instruct
    (``atropos-real-model``, converted once); anything else unchanged."""
    if model == "smollm2":
        from atroposlib.tiny_model.real_model import RealModelUnavailable, ensure_real_model

        try:
            return ensure_real_model()
        except RealModelUnavailable as exc:
            raise SystemExit(f"atropos-grpo-run: error: {exc}") from None
    if model != "tiny":
        return model
    from atroposlib.tiny_model import ensure_tiny_model

    if not tiny_size:
        return ensure_tiny_model()
    import os
    import shutil
    import tempfile

    from atroposlib.tiny_model import build_tiny_model
    from atroposlib.tiny_model.build import default_cache_dir, default_model_name

    suffix = "-".join(f"{k}{v}" for k, v in sorted(tiny_size.items()))
    target = default_cache_dir() / f"{default_model_name()}-{suffix}"
    if not (target / "model.safetensors").exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
        build_tiny_model(tmp, **tiny_size)
        try:
            os.rename(tmp, target)  # atomic: a concurrent build never shows half a model
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


def training_description(config: Any) -> str:
    """What the trainer updates, for the summary: the LoRA adapter (its rank, alpha and
    modules) in the LoRA modes, else every weight."""
    if config.weight_bridge_mode in ("lora_only", "lora_restart"):
        t = config.trainer
        modules = ", ".join(t.get("lora_target_modules") or ["q_proj", "v_proj"])
        return (
            f"LoRA (peft; r {t.get('lora_r', 16)}, alpha {t.get('lora_alpha', 32)}, on {modules}; "
            f"weight_bridge_mode {config.weight_bridge_mode})"
        )
    return f"full fine-tuning (weight_bridge_mode {config.weight_bridge_mode})"


def as_flags(d: Dict[str, Any]) -> List[str]:
    """``{"training_steps": 5, "use_wandb": True}`` → ``["--training-steps", "5", "--use-wandb", "true"]``."""
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


def external_inference_urls(config: RunConfig) -> List[str]:
    """The inference servers that run elsewhere: ``inference_urls`` then the file's lines."""
    from ..config import check_server_url, read_urls_file

    urls = [check_server_url(u) for u in config.inference_urls]
    if config.inference_urls_file:
        urls += read_urls_file(config.inference_urls_file)
    return list(dict.fromkeys(urls))


def rendezvous_flags(config: RunConfig) -> List[str]:
    """torchrun's flags for one node of a ``--nnodes`` run (see ``rdzv_backend``)."""
    flags = [
        f"--nnodes={config.nnodes}",
        f"--nproc-per-node={config.trainer_procs}",
        f"--rdzv-backend={config.rdzv_backend}",
        f"--rdzv-endpoint={config.rdzv_endpoint}",
        f"--rdzv-id={config.rdzv_id}",
    ]
    if config.rdzv_backend == "static":
        flags.append(f"--node-rank={config.node_rank}")
    return flags


def busy_ports(config: RunConfig) -> List[str]:
    """One line per fixed port this node's services need that is taken now, naming the
    setting to change and a free port; checked before the warm-up and the model load."""
    if config.only_trainer:
        return []
    needed = [(config.api_host, config.api_port, "--api-port")]
    if config.owns_inference and not config.external_inference:
        needed.append(("127.0.0.1", config.inference_port, "--inference-port"))
    if config.teacher is not None:
        needed.append(("127.0.0.1", config.teacher.port, "teacher.port:"))
    problems = []
    for host, port, flag in needed:
        problem = busy_port_message(host, port, flag, any_port=True)
        if problem:
            problems.append(problem)
    return problems


class Launcher:
    """Runs one training job end to end. See the module docstring."""

    def __init__(self, config: RunConfig) -> None:
        self.config = config
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        if config.run_dir is None:
            self.run_dir = Path(f"runs/run-{stamp}").resolve()
            self.run_dir.mkdir(parents=True, exist_ok=True)
        elif config.trainer.get("resume"):
            self.run_dir = resumed_run_dir(Path(config.run_dir))
            self.run_dir.mkdir(parents=True, exist_ok=True)
        else:  # never overwrite an earlier run: run_dir becomes a link to this run's own dir
            self.run_dir = new_run_dir(Path(config.run_dir), stamp)
        threads = (
            {k: str(config.cpu_threads) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
            if config.cpu_threads
            else {}
        )
        self.procs = ProcessGroup(self.run_dir, env=threads)
        if config.cpu_threads:
            import torch

            torch.set_num_threads(config.cpu_threads)
        self.device = config.trainer_device()
        self.api_port = config.api_port or free_port()
        self.inf_port = config.inference_port or free_port()
        self.api_url = config.resolved_api_url(self.api_port)
        self.inference_urls = external_inference_urls(config)
        self.inf_url = (
            self.inference_urls[0]
            if self.inference_urls
            else f"http://{config.services_host}:{self.inf_port}"
        )
        self.evaluator = Evaluator(None if config.only_trainer else config.eval, self.inf_url)
        # The distillation teacher's server (teacher: section), started with the services.
        self.teacher_port = (config.teacher.port or free_port()) if config.teacher else 0
        self.teacher_url = f"http://127.0.0.1:{self.teacher_port}"
        self.teacher_info: Dict[str, Any] | None = None
        self.teacher_model: str | None = None
        self.inference_version: int | None = None
        self.t0 = time.time()
        # Seconds per phase, shown while running and written to the summary.
        self.phases: Dict[str, float] = {}
        self.rl_started: float | None = None
        self.pace_origin: tuple[float, int] | None = None  # (time, step) of the first step seen
        self.total_steps = int(config.trainer.get("training_steps") or _default_training_steps())
        # Created at max_wall_time: the trainer ends after its step and saves final_model.
        self.stop_file = Path(config.trainer.get("stop_file") or self.run_dir / "stop-requested")
        if not config.trainer.get("stop_file"):
            self.stop_file.unlink(missing_ok=True)  # a resumed run's earlier stop
        self.stop_reason: str | None = None
        self.stop_deadline: float | None = None

    # -- phases
    def prepare_model(self) -> str:
        """Resolve the model and run the cached warm-up (on the trainer's device) if configured."""
        model = resolve_model(self.config.model, self.config.tiny_model_size)
        w = self.config.warmup
        if w is not None:
            from .warmup import sft_warmup

            examples = load_function(w.examples)(w.n_examples, w.seed)
            logger.info(
                "supervised warm-up: %d steps on %d examples (%s)",
                w.steps,
                len(examples),
                self.device,
            )
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
                device=self.device,
            )
        return str(Path(model).resolve()) if Path(model).exists() else model

    def inference_cmd(
        self, model: str, port: int | None = None
    ) -> tuple[List[str], Dict[str, str]]:
        """The inference server's command line and extra environment."""
        c = self.config
        device, env = split_device(c.inference_device)
        cmd = server_command(
            c.inference_backend,
            model,
            port or self.inf_port,
            c.served_model_name or model,
            device=device,
            dtype=c.inference_dtype,
        )
        if c.inference_backend == "serve_model":
            # The trainer's http_reload weights land under its save_path; other paths get 403.
            cmd += ["--weights-root", self.save_path]
        else:
            env = {**VLLM_SERVE_ENV, **env}
            if serves_adapter(c.inference_backend, c.weight_bridge_mode):
                cmd += lora_server_args(c.trainer.get("lora_r"), c.inference_args)
        return cmd + list(c.inference_args), {**env, **c.inference_env}

    def api_cmd(self) -> List[str]:
        """The ``run-api`` command line."""
        c = self.config
        cmd = [
            sys.executable,
            "-m",
            "atroposlib.cli.run_api",
            "--host",
            c.api_host,
            "--port",
            str(self.api_port),
        ]
        if c.max_staleness is not None:
            cmd += ["--max-staleness", str(c.max_staleness)]
        return cmd + list(c.api_args)

    @property
    def save_path(self) -> str:
        """Where the trainer writes checkpoints and the weights it pushes."""
        return str(self.config.trainer.get("save_path") or self.run_dir / "checkpoints")

    @property
    def starts_inference(self) -> bool:
        """Whether this launcher runs the inference server (not when they run elsewhere)."""
        c = self.config
        return c.owns_inference and not c.external_inference and not c.only_trainer

    def prepare_teacher(self) -> str | None:
        """The teacher checkpoint of the ``teacher:`` section (made first when it comes from
        a run config that has no cached result), or None without one."""
        section = self.config.teacher
        if section is None or self.config.only_trainer:
            return None
        t = time.time()
        model, info, built = resolve_teacher(section, self.procs, resolve_model)
        if built:
            self.phases["teacher"] = time.time() - t
        self.teacher_info = dict(info)
        self.teacher_model = model
        return model

    def start_teacher(self, teacher_model: str) -> None:
        """Serve ``teacher_model`` with ``atropos-serve-model`` (no weight reloads) and score
        it once with the eval function."""
        c = self.config
        assert c.teacher is not None
        device, env = split_device(c.inference_device)
        cmd = server_command(
            "serve_model",
            teacher_model,
            self.teacher_port,
            c.teacher.served_model_name,
            device=device,
            dtype=c.inference_dtype,
        )
        self.procs.start("teacher", cmd + list(c.teacher.args), extra_env=env)
        self.procs.wait_healthy("teacher", f"{self.teacher_url}/health", c.startup_timeout)
        if c.eval is not None and self.teacher_info is not None:
            t = time.time()
            score = Evaluator(c.eval, self.teacher_url).evaluate("teacher", 0, teacher_model)
            self.teacher_info["eval"] = score
            self.phases["eval"] = self.phases.get("eval", 0.0) + time.time() - t

    def start_services(self, model: str) -> None:
        """run-api and (unless the trainer owns it, or it runs elsewhere) the inference server."""
        c = self.config
        self.procs.start("api", self.api_cmd())
        if self.starts_inference:
            cmd, env = self.inference_cmd(model)
            self.procs.start("inference", cmd, extra_env=env)
            self.procs.wait_healthy("inference", f"{self.inf_url}/health", c.startup_timeout)
            if c.inference_backend == "vllm" and not c.trainer.get("resume"):
                self._name_vllm_start_version()
        self.procs.wait_healthy("api", f"{self.api_url}/health", c.startup_timeout)

    def _name_vllm_start_version(self) -> None:
        """vLLM names the weights it starts with ``"default"``, which is no policy version:
        name them step 0, so the rollouts made before the first update carry a version too."""
        try:
            VLLMWeightClient(self.inf_url, timeout=30.0).set_version(0)
        except VLLMWeightError as exc:
            logger.warning("could not set vLLM's weight version to 0 (%s)", exc)

    def trainer_cmd(self, model: str) -> List[str]:
        """The ``atropos-grpo`` command line (under ``torchrun`` for several processes)."""
        c = self.config
        fields: Dict[str, Any] = {
            "save_path": self.save_path,
            "log_dir": str(self.run_dir),
            "atropos_url": self.api_url,
            "vllm_port": self.inf_port,
            **(
                {"inference_urls": self.inference_urls}
                if self.inference_urls
                else {"inference_url": self.inf_url}
            ),
            "weight_bridge_mode": c.weight_bridge_mode,
            "progress": False,
            "inference_backend": "vllm" if c.inference_backend == "vllm" else "serve_model",
            "device": self.device,
            "stop_file": str(self.stop_file),
        }
        if c.precision != "auto":
            fields["precision"] = c.precision
        fields.update(c.trainer)
        fields["model_name"] = model
        launch = [sys.executable]
        if c.nnodes > 1:
            launch += ["-m", "torch.distributed.run", *rendezvous_flags(c)]
        elif c.trainer_procs > 1:
            launch += [
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc-per-node={c.trainer_procs}",
            ]
        return [*launch, "-m", "example_trainer.grpo", *as_flags(fields), *c.trainer_args]

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
            self.policy_model(model),
            "--openai.server_type",
            "vllm",
            "--openai.api_key",
            "x",
            *(
                teacher_env_flags(self.teacher_url, c.teacher.served_model_name, self.teacher_model)
                if c.teacher is not None
                else []
            ),
            *c.env_args,
        ]

    def policy_model(self, model: str) -> str:
        """The model name the environments request: the trained LoRA adapter's when vLLM
        serves it as one (``lora_only``), else the served model's."""
        c = self.config
        return policy_model_name(
            c.inference_backend, c.weight_bridge_mode, c.served_model_name or model
        )

    def wait_for_policy_adapter(self) -> None:
        """With the policy served as a vLLM LoRA adapter, wait until the trainer has loaded
        it (untrained at first: the base model's outputs), so that the environments' first
        rollouts already go through it; from then on the eval requests it too."""
        c = self.config
        if not serves_adapter(c.inference_backend, c.weight_bridge_mode):
            return
        trainer = self.procs.children["trainer"]

        def trainer_failure() -> str | None:
            rc = trainer.returncode()
            return None if rc is None else f"exit code {rc}\n{trainer.log_tail()}"

        waited = wait_for_adapter(self.inf_url, c.startup_timeout, trainer_failure)
        logger.info("vLLM serves the policy's LoRA adapter (after %.1fs)", waited)
        self.evaluator.served_model = VLLM_ADAPTER_NAME

    # -- main loop
    def run(self) -> int:
        """Do the whole job; returns the exit status."""
        c = self.config
        t = time.time()
        model = self.prepare_model()
        self.prepare_seconds = time.time() - t
        if c.warmup is not None:
            self.phases["warm-up"] = self.prepare_seconds
        if c.only_trainer:
            # Another node runs run-api, inference and the environments: the trainer's ranks
            # of this node are all there is to start here.
            self.rl_started = time.time()
            self.procs.start("trainer", self.trainer_cmd(model))
            status = self.monitor(model)
            self.phases["RL"] = time.time() - self.rl_started
            write_summary(
                self.run_dir,
                status,
                [],
                self.t0,
                None,
                phases=self.phases,
                total_steps=self.total_steps,
                record=self.record(model),
            )
            return status
        teacher_model = self.prepare_teacher()
        t = time.time()
        self.start_services(model)
        if teacher_model is not None:
            self.start_teacher(teacher_model)
        self.phases["start-up"] = time.time() - t - self.phases.get("eval", 0.0)
        if c.owns_inference:
            self.evaluate("before", 0, model)
        self.rl_started = time.time()
        self.procs.start("trainer", self.trainer_cmd(model))
        self.wait_for_policy_adapter()
        for i, env_file in enumerate(c.envs):
            self.procs.start(f"env{i}" if len(c.envs) > 1 else "env", self.env_cmd(env_file, model))
        if not c.owns_inference:
            self.procs.wait_healthy("trainer", f"{self.inf_url}/health", c.startup_timeout)
            self.evaluate("before", 0, model)
        status = self.monitor(model)
        self.phases["RL"] = time.time() - self.rl_started
        # A run stopped at max_wall_time trained what it trained: it is evaluated too.
        finished = status in (0, TIME_LIMIT_EXIT)
        if finished and c.owns_inference:
            self.evaluate("after", self._last_step(), model)
            self.inference_version = self._inference_version()
        elif finished and c.eval is not None:
            self.evaluate_served_checkpoint(model)
        write_summary(
            self.run_dir,
            status,
            self.evaluator.evals,
            self.t0,
            self.inference_version,
            eval_set=self.evaluator.eval_set,
            phases=self.phases,
            total_steps=self.total_steps,
            teacher=self.teacher_info,
            record=self.record(model),
            training=training_description(self.config),
        )
        return status

    def counted_seconds(self) -> float:
        """Seconds of this run that count against ``max_wall_time``: all but the one-time work
        (building or finding the model and its cached warm-up; a teacher's ``from_config``
        run), which a first run pays and later ones do not."""
        one_time = getattr(self, "prepare_seconds", 0.0) + self.phases.get("teacher", 0.0)
        return time.time() - self.t0 - one_time

    def record(self, model: str) -> Dict[str, Any]:
        """What ``summary.md`` lists besides the scores: why the run stopped, the final model
        and checkpoints, the key trainer settings and the whole configuration."""
        from ..config import TrainingConfig

        save = Path(self.save_path)
        checkpoints = sorted(
            (str(d) for d in save.glob("step_*") if d.is_dir()),
            key=lambda d: int(d.rsplit("_", 1)[1]) if d.rsplit("_", 1)[1].isdigit() else 0,
        )
        final = next(
            (str(save / n) for n in ("final_model", "final_adapter") if (save / n).is_dir()), None
        )
        trainer = {**self.config.trainer, "model_name": model}
        try:
            settings = TrainingConfig(**trainer).model_dump()
        except ValueError:  # checked at start; a resumed run's odd values are shown as given
            settings = trainer
        return {
            "stop_reason": self.stop_reason,
            "final_model": final,
            "checkpoints": checkpoints,
            "hyperparameters": {
                "model": model,
                "group_size": self.config.group_size,
                **{k: settings.get(k) for k in KEY_HYPERPARAMETERS if k in settings},
            },
            "config": self.config.model_dump(mode="json"),
        }

    def evaluate(self, label: str, step: int, model: str) -> None:
        """One eval, its time added to the ``eval`` phase (evals during RL overlap training)."""
        t = time.time()
        self.evaluator.evaluate(label, step, model)
        if self.evaluator.section is not None:
            self.phases["eval"] = self.phases.get("eval", 0.0) + time.time() - t

    def progress(self, step: int) -> str:
        """The ``step N / total  ETA …`` line for ``step``."""
        rows = read_metrics(self.run_dir / "metrics.jsonl")
        now = time.time()
        phases = dict(self.phases)
        if self.rl_started is not None:
            phases["RL"] = now - self.rl_started
        if self.pace_origin is None and step > 0:
            self.pace_origin = (now, step)
        eta = (
            eta_seconds(step, self.total_steps, now - self.pace_origin[0], self.pace_origin[1])
            if self.pace_origin
            else None
        )
        return progress_text(
            step,
            self.total_steps,
            eta,
            phases,
            rows[-1] if rows else None,
            self.evaluator.evals,
        )

    def evaluate_served_checkpoint(self, model: str) -> None:
        """Restart modes: the trainer's server is gone, so serve its last weights briefly and evaluate."""
        served = sorted(
            (self.run_dir / "checkpoints" / "served_weights").glob("step_*"),
            key=lambda p: int(p.name.split("_")[1]),
        )
        if not served:
            logger.warning("no served weights found; skipping the final eval")
            return
        cmd, env = self.inference_cmd(str(served[-1]))
        self.procs.start("inference-eval", cmd, extra_env=env)
        try:
            self.procs.wait_healthy(
                "inference-eval", f"{self.inf_url}/health", self.config.startup_timeout
            )
            self.evaluate("after", self._last_step(), model)
        finally:
            self.procs.stop("inference-eval")

    def _inference_version(self) -> int | None:
        try:
            if self.config.inference_backend == "vllm":
                version = VLLMWeightClient(self.inf_url, timeout=5.0).weight_version()
                return int(version) if str(version).isdigit() else None
            return httpx.get(f"{self.inf_url}/health", timeout=5.0).json().get("version")
        except (httpx.HTTPError, ValueError, AttributeError):
            return None

    def _last_step(self) -> int:
        rows = read_metrics(self.run_dir / "metrics.jsonl")
        return int(rows[-1]["step"]) if rows else 0

    def monitor(self, model: str, interactive: bool | None = None) -> int:
        """Show status until the trainer exits; 0 on success.

        On a terminal a live table; otherwise (``interactive`` False: CI, a log file)
        plain progress lines on stdout, because a redrawn table turns into pages of
        repeated frames there.
        """
        from rich.console import Console
        from rich.live import Live

        console = Console(stderr=True)
        if interactive is None:
            interactive = console.is_terminal
        every = self.evaluator.every_steps
        next_eval = every
        plain = PlainProgress(self.total_steps)

        def table() -> Any:
            return status_table(
                self.run_dir,
                self.procs,
                self.evaluator.evals,
                self.t0,
                self.progress(self._last_step()),
            )

        live = (
            Live(table(), console=console, refresh_per_second=2, transient=False)
            if interactive
            else contextlib.nullcontext()
        )
        with live:
            while True:
                rc = self.procs.children["trainer"].returncode()
                step = self._last_step()
                # The last step's eval is the "after" one, done once the trainer exits.
                if every and step >= next_eval and step < self.total_steps and rc is None:
                    self.evaluate("during", step, model)
                    next_eval = (step // every + 1) * every
                if interactive:
                    live.update(table())
                elif step > 0 and plain.due(step, time.time()):
                    print(self.progress(step), flush=True)
                if rc is not None:
                    return self._trainer_exited(rc, step, console)
                dead = self.procs.failed(ignore=("trainer",))
                if dead is not None:
                    self.stop_reason = f"{dead.name} exited with code {dead.returncode()}"
                    console.print(f"[red]{self.stop_reason}[/red]\n{dead.log_tail()}")
                    return 1
                limit = self.config.max_wall_time
                if limit and self.stop_deadline is None and self.counted_seconds() > limit:
                    self._request_stop(step, console)
                elif self.stop_deadline is not None and time.time() > self.stop_deadline:
                    self.stop_reason = (
                        f"{self.stop_reason}; the trainer did not end within {STOP_GRACE:.0f}s "
                        "and was stopped: no final model (the checkpoints are listed below)"
                    )
                    console.print(f"[red]{self.stop_reason}[/red]")
                    return TIME_LIMIT_EXIT
                time.sleep(self.config.status_interval)

    def _request_stop(self, step: int, console: Any) -> None:
        """``max_wall_time`` is reached: ask the trainer to end after its step (stop file)."""
        self.stop_file.parent.mkdir(parents=True, exist_ok=True)
        self.stop_file.touch()
        self.stop_deadline = time.time() + STOP_GRACE
        self.stop_reason = (
            f"max_wall_time ({self.config.max_wall_time:.0f}s, one-time work not counted) "
            f"reached at step {step} of {self.total_steps}"
        )
        console.print(
            f"[yellow]{self.stop_reason}: the trainer ends after this step and saves "
            "final_model[/yellow]"
        )

    def _trainer_exited(self, rc: int, step: int, console: Any) -> int:
        """The run's status once the trainer has exited with ``rc``."""
        if rc != 0:
            self.stop_reason = f"the trainer exited with code {rc}"
            console.print(
                f"[red]{self.stop_reason}[/red]\n" + self.procs.children["trainer"].log_tail()
            )
            return rc
        if self.stop_deadline is not None:
            self.stop_reason = f"{self.stop_reason}; the trainer saved final_model at step {step}"
            return TIME_LIMIT_EXIT
        self.stop_reason = f"trained all {step} of {self.total_steps} steps"
        return 0

    def shutdown(self) -> None:
        """Stop every child process and everything they started (bounded; see ProcessGroup.stop_many)."""
        self.procs.stop_all()
