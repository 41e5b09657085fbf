"""Experiment loggers (`job.loggers`): every train step's metrics to TensorBoard, MLflow and/or Weights
& Biases, as the step lands, from `libra run`. Off by default; `pip install 'libra[loggers]'`
brings all three.

A logger never costs the job: one that fails is logged once and dropped for the rest of the run.
"""

from __future__ import annotations

import math
import threading
import time
from pathlib import Path
from typing import Any, Protocol

from services.common.contracts import ev
from services.common.logging import get_logger
from services.common.runconfig import RunConfig

STEP_FIELDS = (
    "loss",
    "reward_mean",
    "reward_std",
    "sampled_reward_mean",
    "entropy",
    "kl",
    "ref_kl",
    "clip_fraction",
    "dual_clip_fraction",
    "is_weight_mean",
    "is_weight_max",
    "is_truncated_fraction",
    "logprob_mismatch",
    "stale_token_fraction",
    "lr",
    "grad_norm",
    "step_s",
    "tokens",
    "trajectories",
    "groups_filtered",
    "data_parallel",
)
"""TrainMetrics fields logged each step, as `train/<field>`."""


class LoggerUnavailable(RuntimeError):
    """A configured logger whose package is not installed."""


class ExperimentLogger(Protocol):
    name: str

    def log(self, step: int, values: dict[str, float]) -> None: ...

    def close(self, status: str) -> None: ...


def step_values(m: ev.TrainMetrics) -> dict[str, float]:
    """A step's metrics as `train/<field>` → value (NaN ones, e.g. entropy with no token, left out)."""
    out = {f"train/{k}": float(getattr(m, k)) for k in STEP_FIELDS}
    return {k: v for k, v in out.items() if math.isfinite(v)}


def flat_config(cfg: RunConfig) -> dict[str, str]:
    """The run config as dotted keys (task.temperature → "0.7"), for a logger's parameters."""
    out: dict[str, str] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        else:
            out[prefix] = str(value)[:500]

    walk("", cfg.model_dump(mode="json"))
    return out


class TensorBoardLogger:
    name = "tensorboard"

    def __init__(self, cfg: RunConfig, run_id: str, out_dir: Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise LoggerUnavailable(
                "job.loggers: tensorboard needs the tensorboard package (pip install 'libra[loggers]')"
            ) from e
        self.dir = out_dir / "tensorboard"
        self.writer = SummaryWriter(log_dir=str(self.dir))
        params = "\n".join(f"    {k}: {v}" for k, v in sorted(flat_config(cfg).items()))
        self.writer.add_text("config", params)

    def log(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def samples(self, rows: list[dict[str, Any]], path: Path) -> None:
        """One text entry per sample, under `samples/step_<n>` (TensorBoard's Text tab)."""
        from tools.samples import render

        for i, row in enumerate(rows):
            text = "    " + render(row).replace("\n", "\n    ")  # indented: shown as preformatted
            self.writer.add_text(f"samples/step_{row.get('step') or 0}", text, global_step=i)
        self.writer.flush()

    def close(self, status: str) -> None:
        self.writer.add_text("status", status)
        self.writer.close()


class MlflowLogger:
    """One MLflow run per Libra run, in experiment `job.experiment` (default: the config's name), at
    `job.mlflow_tracking_uri` (default: $MLFLOW_TRACKING_URI, else a file store in runs/mlruns)."""

    name = "mlflow"

    def __init__(self, cfg: RunConfig, run_id: str, out_dir: Path):
        try:
            from mlflow.entities import Param
            from mlflow.tracking import MlflowClient
        except ImportError as e:
            raise LoggerUnavailable(
                "job.loggers: mlflow needs the mlflow-skinny package (pip install 'libra[loggers]')"
            ) from e
        import os

        uri = cfg.job.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        if uri is None:  # the local default: a file store (MLflow 3 asks for this opt-in)
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        # a tracking server that is down costs seconds, not MLflow's default minutes of retries
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        self.uri = uri or (out_dir.parent / "mlruns").resolve().as_uri()
        self.client = MlflowClient(tracking_uri=self.uri)
        name = cfg.job.experiment or cfg.name
        exp = self.client.get_experiment_by_name(name)
        exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(name)
        self.run = self.client.create_run(exp_id, run_name=run_id, tags={"libra.run_id": run_id})
        params = [Param(k, v) for k, v in sorted(flat_config(cfg).items())]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run.info.run_id, params=params[i : i + 100])

    def log(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k.replace("/", "."), v, now, step) for k, v in values.items()]
        self.client.log_batch(self.run.info.run_id, metrics=metrics)

    def samples(self, rows: list[dict[str, Any]], path: Path) -> None:
        self.client.log_artifact(self.run.info.run_id, str(path))

    def close(self, status: str) -> None:
        self.client.set_terminated(self.run.info.run_id, "FINISHED" if status == "completed" else "FAILED")


class WandbLogger:
    """One Weights & Biases run per Libra run (named by its run id) in project `job.experiment`
    (default: the config's name), in `job.wandb_mode`: `online` needs WANDB_API_KEY (or a
    `wandb login`); `offline` writes runs/<id>/wandb for a later `wandb sync`."""

    name = "wandb"

    def __init__(self, cfg: RunConfig, run_id: str, out_dir: Path):
        try:
            import wandb
        except ImportError as e:
            raise LoggerUnavailable(
                "job.loggers: wandb needs the wandb package (pip install 'libra[loggers]')"
            ) from e
        out_dir.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=cfg.job.experiment or cfg.name,
            name=run_id,
            dir=str(out_dir),
            mode=cfg.job.wandb_mode,
            config=cfg.model_dump(mode="json"),
            settings=wandb.Settings(console="off", silent=True),  # the job's terminal stays ours
        )

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def samples(self, rows: list[dict[str, Any]], path: Path) -> None:
        """A `samples` table: one row per sample, its transcript as readable text."""
        import wandb

        from tools.samples import render

        columns: list[str | int] = [
            "step",
            "group_id",
            "trajectory_id",
            "reward",
            "advantage",
            "outcome",
            "transcript",
        ]
        table = wandb.Table(columns=columns)
        for row in rows:
            table.add_data(*(row.get(str(c)) for c in columns[:-1]), render(row))
        self.run.log({"samples": table})

    def close(self, status: str) -> None:
        self.run.finish(exit_code=0 if status == "completed" else 1)


LOGGERS: dict[str, type[TensorBoardLogger] | type[MlflowLogger] | type[WandbLogger]] = {
    "tensorboard": TensorBoardLogger,
    "mlflow": MlflowLogger,
    "wandb": WandbLogger,
}


def check_loggers(cfg: RunConfig) -> None:
    """Raises LoggerUnavailable for a configured logger whose package is missing (before the run)."""
    import importlib.util

    needs = {"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb"}
    for name in cfg.job.loggers:
        if importlib.util.find_spec(needs[name]) is None:
            package = {"tensorboard": "tensorboard", "mlflow": "mlflow-skinny", "wandb": "wandb"}[name]
            raise LoggerUnavailable(
                f"job.loggers: {name} needs the {package} package (pip install 'libra[loggers]')"
            )


class StepLoggers:
    """The run's configured loggers; each step is logged once, failures drop only that logger."""

    def __init__(self, cfg: RunConfig, run_id: str, out_dir: Path | None):
        self.log = get_logger(component="loggers")
        self.active: list[ExperimentLogger] = []
        self.logged: set[int] = set()
        self.lock = threading.Lock()
        if out_dir is None:
            return
        for name in cfg.job.loggers:
            try:
                self.active.append(LOGGERS[name](cfg, run_id, out_dir))
            except Exception as err:
                self.log.warning("logger_unavailable", logger=name, error=f"{type(err).__name__}: {err}")

    def step(self, m: ev.TrainMetrics) -> None:
        with self.lock:
            if m.step <= 0 or m.step in self.logged:
                return
            self.logged.add(m.step)
            self._each(lambda lg: lg.log(m.step, step_values(m)))

    def samples(self, rows: list[dict[str, Any]], path: Path) -> None:
        """The job's rollout samples (runs/<id>/samples.jsonl), to each logger that takes them."""
        with self.lock:
            self._each(lambda lg: lg.samples(rows, path) if hasattr(lg, "samples") else None)

    def close(self, status: str) -> None:
        with self.lock:
            self._each(lambda lg: lg.close(status))
            self.active = []

    def _each(self, fn: Any) -> None:
        for lg in list(self.active):
            try:
                fn(lg)
            except Exception as err:
                self.log.warning("logger_failed", logger=lg.name, error=f"{type(err).__name__}: {err}")
                self.active.remove(lg)
