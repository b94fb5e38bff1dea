"""Predicted vs measured: the run's rates next to the cost model's (`summary.json`
"fidelity", `report/fidelity.png`).

The prediction (`prediction.json`, written by the launcher from the plan or the local
profile, see `hexctl/job/predict.py`) and the measurement use the same definitions
over one steady-state window, from trainer step `from_step` (η + 1 by default: the
batches an asynchronous run generates before its first step are a head start, not rate)
to the last step:

- pipeline: trained samples per second of wall time (B·G per step);
- training: trained samples per second of trainer work (each step's compute + publish);
- generation: samples generated per second the servers had work (Δ samples / Δ busy s);
- weight sync: the mean pause per weight update.

Relative error = (predicted − measured) / measured.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from areal_hex.config import ExperimentConfig
from areal_hex.run_files import RolloutRow, RunPaths, TrainerRow, read_rows

QUANTITIES = (
    "pipeline_samples_per_s",
    "generation_samples_per_s",
    "training_samples_per_s",
    "weight_sync_s",
)


@dataclass
class Rates:
    pipeline_samples_per_s: float | None = None
    generation_samples_per_s: float | None = None
    training_samples_per_s: float | None = None
    weight_sync_s: float | None = None


def window(metrics: list[TrainerRow], from_step: int) -> list[TrainerRow]:
    """The rows from step `from_step` (the window's start) to the last; at least the last
    two rows when the run is shorter."""
    rows = [r for r in metrics if r.step >= from_step]
    return rows if len(rows) >= 2 else metrics[-2:]


def _rollout_span(rollout: list[RolloutRow], t0: float, t1: float) -> list[RolloutRow]:
    """The controller's rows covering [t0, t1]: the last at or before t0 through the first
    at or after t1 (rows come every `rollout.metrics_interval_s`)."""
    rows = sorted((r for r in rollout if r.time > 0), key=lambda r: r.time)
    if len(rows) < 2:
        return rows
    lo = max([i for i, r in enumerate(rows) if r.time <= t0], default=0)
    hi = min([i for i, r in enumerate(rows) if r.time >= t1], default=len(rows) - 1)
    return rows[lo : hi + 1] if hi > lo else rows[-2:]


def measured_rates(
    metrics: list[TrainerRow], rollout: list[RolloutRow], group_size: int, from_step: int
) -> Rates:
    rows = window(metrics, from_step)
    out = Rates()
    if len(rows) < 2:
        return out
    first, last = rows[0], rows[-1]
    samples = (last.groups_trained_total - first.groups_trained_total) * group_size
    if last.time > first.time:
        out.pipeline_samples_per_s = samples / (last.time - first.time)
    work = sum(r.compute_s + r.publish_s for r in rows[1:])
    if work > 0:
        out.training_samples_per_s = samples / work
    span = _rollout_span(rollout, first.time, last.time)
    if len(span) >= 2:
        a, b = span[0], span[-1]
        busy = b.gen_busy_s - a.gen_busy_s
        if busy > 0:
            out.generation_samples_per_s = (b.samples_total - a.samples_total) / busy
        updates = b.weight_syncs_total - a.weight_syncs_total
        if updates > 0:
            out.weight_sync_s = (b.weight_sync_s_total - a.weight_sync_s_total) / updates
    return out


def servers_taking_part(
    metrics: list[TrainerRow], rollout: list[RolloutRow], from_step: int, planned: int
) -> dict[str, Any]:
    """Whether the run generated on the servers it planned: `planned` beside the servers
    healthy in the controller's first row (`at_start`) and the fewest healthy in any of
    its rows over the window (`fewest_in_window`). `all_took_part` is False when a
    planned server was out during the window (a late start, a failure): the run's rates
    are then not the plan's; None without rows to tell."""
    rows = window(metrics, from_step)
    made = sorted((r for r in rollout if r.time > 0), key=lambda r: r.time)
    span = _rollout_span(made, rows[0].time, rows[-1].time) if len(rows) >= 2 else []
    fewest = min((r.servers_healthy for r in span), default=None)
    return {
        "planned": planned,
        "at_start": made[0].servers_healthy if made else None,
        "fewest_in_window": fewest,
        "all_took_part": None if fewest is None else fewest >= planned,
    }


def relative_errors(predicted: dict[str, Any], measured: Rates) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for k in QUANTITIES:
        p, m = predicted.get(k), getattr(measured, k)
        out[k] = None if p is None or not m else (p - m) / m
    return out


def fidelity_block(run_dir: Path, cfg: ExperimentConfig, from_step: int | None = None) -> dict:
    """Predicted, measured and relative errors for the mode the run ran in."""
    paths = RunPaths.at(run_dir, cfg.inference.weights_dir)
    start = from_step if from_step is not None else cfg.buffer.max_staleness + 1
    metrics, rollout = read_rows(paths.metrics, TrainerRow), read_rows(paths.rollout, RolloutRow)
    measured = measured_rates(metrics, rollout, cfg.rollout.group_size, start)
    block: dict[str, Any] = {"mode": cfg.run.mode, "window_from_step": start}
    block["measured"] = asdict(measured)
    block["servers"] = servers_taking_part(metrics, rollout, start, len(cfg.inference.urls()))
    pred = json.loads(paths.prediction.read_text()) if paths.prediction.is_file() else None
    if pred is None or "unavailable" in pred:
        block["predicted"] = None
        block["unavailable"] = (pred or {}).get("unavailable", "the launcher wrote no prediction")
        return block
    mine = pred["synchronous" if cfg.run.mode == "sync" else "asynchronous"]
    block["source"] = pred.get("source")
    block["predicted"] = {k: mine.get(k) for k in QUANTITIES}
    block["relative_error"] = relative_errors(mine, measured)
    return block


def plot_fidelity(block: dict, out: Path) -> Path | None:
    """Bars: predicted vs measured rates (left) and weight-sync pause (right)."""
    if not block.get("predicted"):
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pred, meas = block["predicted"], block["measured"]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(9, 3.6), width_ratios=[3, 1])
    names = ["pipeline", "generation", "training"]
    keys = QUANTITIES[:3]
    xs = range(len(keys))
    ax.bar([x - 0.2 for x in xs], [pred[k] or 0 for k in keys], 0.4, label="predicted")
    ax.bar([x + 0.2 for x in xs], [meas[k] or 0 for k in keys], 0.4, label="measured")
    for x, k in zip(xs, keys, strict=True):
        err = block["relative_error"].get(k)
        if err is not None:
            top = max(pred[k] or 0, meas[k] or 0)
            ax.annotate(f"{err:+.0%}", (x, top), ha="center", va="bottom")
    ax.set_xticks(list(xs), names)
    ax.set_ylabel("samples/s")
    ax.legend(loc="lower right")
    ax.set_title(f"Predicted vs measured ({block['mode']}, steps {block['window_from_step']}+)")
    k = QUANTITIES[3]
    bx.bar([0, 1], [pred[k] or 0, meas[k] or 0], color=["tab:blue", "tab:orange"])
    bx.set_xticks([0, 1], ["predicted", "measured"])
    bx.set_ylabel("seconds per update")
    bx.set_title("Weight-sync pause")
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    path = out / "fidelity.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def add_fidelity(run_dir: Path, cfg: ExperimentConfig, summary: dict[str, Any]) -> None:
    """`summary["fidelity"]` and `report/fidelity.png` for a finished run."""
    block = fidelity_block(run_dir, cfg)
    summary["fidelity"] = block
    plot_fidelity(block, RunPaths.at(run_dir).report)
