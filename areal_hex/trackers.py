"""Experiment trackers (`run.trackers`): TensorBoard, Weights & Biases, MLflow behind one
small interface, fed the same typed rows that `metrics.jsonl` / `rollout.jsonl` hold.

A row becomes scalars `<source>/<field>` (dict fields flatten to `<field>/<key>`, nested
ones level by level, e.g. `trainer/mismatch/gpu_kind/L40S/k3`; a key's characters other
than letters, digits, `_`, `.` and `-` become `_`, so a server URL is one level and a
valid MLflow name; unset values are skipped), logged at the row's step: the optimizer
step for the trainer, the row's index for the controller. The resolved config is the
run's config; the report's PNGs go up as images at the end. Each backend is imported
only when chosen, and a missing package names the extra to install.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from pydantic import BaseModel

from areal_hex.errors import UsageError
from areal_hex.run_files import TrainerRow

if TYPE_CHECKING:
    from areal_hex.config import ExperimentConfig


class Tracker(Protocol):
    def log_config(self, config: dict[str, Any]) -> None: ...
    def log_scalars(self, scalars: dict[str, float], step: int) -> None: ...
    def log_image(self, name: str, path: Path) -> None: ...
    def close(self) -> None: ...


def scalars(row: BaseModel, source: str) -> dict[str, float]:
    """The numeric fields of a metric row as `<source>/<field>[/<key>...]` scalars."""
    out: dict[str, float] = {}
    _flatten(row.model_dump(), source, out)
    return out


def _flatten(value: Any, tag: str, out: dict[str, float]) -> None:
    if isinstance(value, dict):
        for key, v in value.items():
            _flatten(v, f"{tag}/{_tag_part(str(key))}", out)
    elif isinstance(value, int | float) and not isinstance(value, bool):
        out[tag] = float(value)


def _tag_part(key: str) -> str:
    """One level of a tag: `http://10.0.0.7:30000` -> `http___10.0.0.7_30000`."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", key)


def _require(module: str, extra: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise UsageError(
            f"run.trackers: {extra!r} needs the package {module.split('.')[0]!r}; "
            f"install it with: pip install 'areal-hex[{extra}]'"
        ) from exc


class TensorBoardTracker:
    def __init__(self, log_dir: Path) -> None:
        _require("tensorboard", "tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(log_dir))

    def log_config(self, config: dict[str, Any]) -> None:
        import yaml

        self.writer.add_text("config", "```\n" + yaml.safe_dump(config) + "```")

    def log_scalars(self, scalars: dict[str, float], step: int) -> None:
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()

    def log_image(self, name: str, path: Path) -> None:
        import numpy as np
        from PIL import Image

        self.writer.add_image(
            name, np.asarray(Image.open(path).convert("RGB")), 0, dataformats="HWC"
        )

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    def __init__(self, run_dir: Path, project: str, name: str, group: str, mode: str) -> None:
        wandb = _require("wandb", "wandb")
        self.run = wandb.init(
            project=project,
            name=name,
            group=group,
            dir=str(run_dir),
            mode=mode,
            reinit="create_new",
        )

    def log_config(self, config: dict[str, Any]) -> None:
        self.run.config.update(config, allow_val_change=True)

    def log_scalars(self, scalars: dict[str, float], step: int) -> None:
        self.run.log(scalars, step=step)

    def log_image(self, name: str, path: Path) -> None:
        import wandb

        self.run.log({name: wandb.Image(str(path))})

    def close(self) -> None:
        self.run.finish()


class MlflowTracker:
    def __init__(self, run_dir: Path, experiment: str, name: str) -> None:
        mlflow = _require("mlflow", "mlflow")
        self.client = mlflow.MlflowClient(tracking_uri=(run_dir / "mlruns").resolve().as_uri())
        exp = self.client.get_experiment_by_name(experiment)
        exp_id = exp.experiment_id if exp else self.client.create_experiment(experiment)
        self.run_id = self.client.create_run(exp_id, run_name=name).info.run_id

    def log_config(self, config: dict[str, Any]) -> None:
        self.client.log_dict(self.run_id, config, "config.json")

    def log_scalars(self, scalars: dict[str, float], step: int) -> None:
        for key, value in scalars.items():
            self.client.log_metric(self.run_id, key, value, step=step)

    def log_image(self, name: str, path: Path) -> None:
        self.client.log_artifact(self.run_id, str(path), "report")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class Trackers:
    """The chosen trackers for one process (`source`: "trainer" or "rollout")."""

    def __init__(self, trackers: Sequence[Tracker], source: str) -> None:
        self.trackers = list(trackers)
        self.source = source
        self.rows = 0

    def observe(self, row: BaseModel) -> None:
        """Log one metric row (a row observer of the trainer or the controller)."""
        # the optimizer step for a trainer row; a controller row counts its rows
        step = row.step if isinstance(row, TrainerRow) else self.rows
        self.rows += 1
        values = scalars(row, self.source)
        for t in self.trackers:
            t.log_scalars(values, step)

    def log_config(self, config: dict[str, Any]) -> None:
        for t in self.trackers:
            t.log_config(config)

    def log_images(self, paths: Sequence[Path]) -> None:
        for t in self.trackers:
            for p in paths:
                t.log_image(f"report/{p.stem}", p)

    def close(self) -> None:
        for t in self.trackers:
            t.close()


def open_trackers(
    names: Sequence[str],
    run_dir: Path,
    run_id: str,
    source: str,
    wandb_project: str,
    wandb_mode: str,
) -> Trackers:
    factories = {
        "tensorboard": lambda: TensorBoardTracker(run_dir / "tensorboard" / source),
        "wandb": lambda: WandbTracker(
            run_dir, wandb_project, f"{run_id}-{source}", run_id, wandb_mode
        ),
        "mlflow": lambda: MlflowTracker(run_dir, run_id, source),
    }
    for name in names:
        if name not in factories:
            raise UsageError(
                f"run.trackers: unknown tracker {name!r} (expected one of {sorted(factories)})"
            )
    return Trackers([factories[name]() for name in names], source)


def open_run_trackers(
    cfg: ExperimentConfig, source: str, run_dir: Path | None = None
) -> Trackers | None:
    """The trackers `run.trackers` names for one service of a run (in `run_dir`, default
    the config's), the resolved config logged as the run's config; None when none."""
    r = cfg.run
    if not r.trackers or r.run_id is None:
        return None
    where = run_dir if run_dir is not None else r.run_dir()
    trackers = open_trackers(r.trackers, where, r.run_id, source, r.wandb_project, r.wandb_mode)
    trackers.log_config(cfg.model_dump(mode="json"))
    return trackers
