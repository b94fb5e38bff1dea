"""The end-of-run report: `summary.json` and PNG plots (matplotlib, Agg backend) from
`metrics.jsonl`, `rollout.jsonl`, `events.json` and the buffer's final counters.

Group accounting: when the launcher read the ledger (hexctl/report/ledger.py: durable
state, every attempt) it replaces the per-process counters below, and times and rates
are over the time the job actually ran. Without it (a report rebuilt from files alone):
    produced (put by the controller) = trained + groups_dropped_stale + dead_letter
                                       + left in the buffer at stop (unconsumed + pending)
and groups still generating at stop are reported as `in_flight_controller`.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from areal_hex.config import ExperimentConfig
from areal_hex.run_files import RolloutRow, RunPaths, TrainerRow, read_rows
from areal_hex.trackers import open_run_trackers
from hexctl.report.fidelity import add_fidelity
from hexctl.report.ledger import summary_fields
from hexctl.report.mismatch import plot_mismatch
from hexctl.report.startup import startup_timeline


def _final_reward(rows: list[TrainerRow], frac: float = 0.2) -> float | None:
    """Mean reward of the last `frac` of steps (at least 1): one step is noisy."""
    vals = [r.reward_mean for r in rows if r.reward_mean is not None]
    if not vals:
        return None
    k = max(1, int(len(vals) * frac))
    return sum(vals[-k:]) / k


def _throughput(
    rows: list[TrainerRow], group_size: int, t_ready: float | None
) -> dict[str, float | None]:
    """Trained samples per second: steady state (first to last step) and wall (services
    ready to last step)."""
    if not rows:
        return {"samples_per_s": None, "samples_per_s_wall": None}
    first, last = rows[0], rows[-1]
    trained = last.groups_trained_total * group_size
    steady = None
    if len(rows) > 1 and last.time > first.time:
        between = trained - first.groups_trained_total * group_size
        steady = between / (last.time - first.time)
    wall = trained / (last.time - t_ready) if t_ready and last.time > t_ready else None
    return {"samples_per_s": steady, "samples_per_s_wall": wall}


def controller_runs(rollout: list[RolloutRow]) -> list[list[RolloutRow]]:
    """rollout.jsonl split into one list per controller process: a new process starts
    its clock (`elapsed_s`) again, and each one that stopped cleanly ends on a final row."""
    runs: list[list[RolloutRow]] = []
    for row in rollout:
        prev = runs[-1][-1] if runs else None
        if prev is None or prev.final or row.elapsed_s < prev.elapsed_s:
            runs.append([])
        runs[-1].append(row)
    return runs


def _end_row(rows: list[RolloutRow]) -> RolloutRow:
    finals = [r for r in rows if r.final]
    return finals[-1] if finals else rows[-1]


def accounting(
    metrics: list[TrainerRow], rollout: list[RolloutRow], buffer: dict[str, Any] | None
) -> dict[str, Any]:
    last_m = metrics[-1] if metrics else TrainerRow()
    ends = [_end_row(rows) for rows in controller_runs(rollout)]
    last_r = ends[-1] if ends else RolloutRow()
    # a restarted controller (a requeued job) counts from zero again: sum its runs
    produced = sum(r.groups_produced_total for r in ends)
    trained = last_m.groups_trained_total
    dropped = last_m.groups_dropped_stale_total
    dead = last_m.dead_letter_total
    filtered = sum(r.groups_filtered_total for r in ends)
    out: dict[str, Any] = {
        "groups_produced": produced,
        "groups_filtered": filtered,
        "groups_trained": trained,
        "groups_dropped_stale": dropped,
        "groups_dead_letter": dead,
        "in_flight_controller": last_r.groups_in_flight,
    }
    if buffer is not None:
        out["groups_dropped_stale"] = dropped = max(dropped, int(buffer["groups_dropped_stale"]))
        out["groups_dead_letter"] = dead = max(dead, int(buffer["dead_letter"]))
        in_buffer = int(buffer["unconsumed"]) + int(buffer["pending"])
        out["in_buffer_at_stop"] = in_buffer
        out["groups_admitted"] = int(buffer["submitted"])
        out["groups_lost"] = produced - filtered - trained - dropped - dead - in_buffer
    return out


def _token_weighted(entries: Iterable[tuple[str, dict[str, float]]]) -> dict[str, dict]:
    """Token-weighted means of {"abs_dlogp", "k3", "tokens"} entries, by name."""
    acc: dict[str, list[float]] = {}
    for name, m in entries:
        a = acc.setdefault(name, [0.0, 0.0, 0.0])
        n = m["tokens"]
        a[0] += m["abs_dlogp"] * n
        a[1] += m["k3"] * n
        a[2] += n
    return {
        name: {"abs_dlogp": a / n, "k3": k / n, "tokens": int(n)}
        for name, (a, k, n) in acc.items()
        if n > 0
    }


def mismatch_totals(rows: list[TrainerRow]) -> dict[str, dict[str, dict[str, float]]]:
    """Token-weighted means over the run of each step's train-inference mismatch, by
    server and by GPU kind (see TrainerRow.mismatch)."""
    kinds = dict.fromkeys(kind for r in rows for kind in r.mismatch)
    return {
        kind: _token_weighted(
            (name, m) for r in rows for name, m in r.mismatch.get(kind, {}).items()
        )
        for kind in kinds
    }


def drift_totals(rows: list[TrainerRow]) -> dict[str, dict[str, float]]:
    """Token-weighted means over the run of each step's drift_by_lag, lags in order."""
    out = _token_weighted((lag, m) for r in rows for lag, m in r.drift_by_lag.items())
    return dict(sorted(out.items(), key=lambda kv: int(kv[0])))


def summarize(
    run_dir: Path,
    cfg: ExperimentConfig,
    buffer: dict[str, Any] | None = None,
    outcome: str = "finished",
    ledger: dict[str, Any] | None = None,
) -> dict[str, Any]:
    paths = RunPaths.at(run_dir, cfg.inference.weights_dir)
    metrics = read_rows(paths.metrics, TrainerRow)
    rollout = read_rows(paths.rollout, RolloutRow)
    events = json.loads(paths.events.read_text()) if paths.events.exists() else {}
    t_ready = events.get("t_services_ready")
    wall = (events["t_end"] - events["t_start"]) if "t_end" in events else None
    hist: Counter[str] = Counter()
    for r in metrics:
        hist.update({str(k): int(v) for k, v in r.version_lag_hist.items()})
    published = paths.versions_on_disk()
    summary = {
        "run_id": cfg.run.run_id,
        "mode": cfg.run.mode,
        "outcome": outcome,
        "max_staleness": cfg.buffer.max_staleness,
        "groups_per_step": cfg.buffer.groups_per_step,
        "group_size": cfg.rollout.group_size,
        "steps": metrics[-1].step if metrics else 0,
        "total_steps": cfg.trainer.total_steps,
        "final_reward": _final_reward(metrics),
        "first_reward": metrics[0].reward_mean if metrics else None,
        "max_version_lag": max((r.max_version_lag for r in metrics), default=0),
        "version_lag_hist": dict(sorted(hist.items(), key=lambda kv: int(kv[0]))),
        "mismatch": mismatch_totals(metrics),
        "drift_by_lag": drift_totals(metrics),
        **_throughput(metrics, cfg.rollout.group_size, t_ready),
        "wall_time_s": wall,
        **accounting(metrics, rollout, buffer),
        "versions": [r.version for r in metrics],
        "final_version": metrics[-1].version if metrics else 0,
        "versions_on_disk": published,
        "restarts": events.get("restarts", {}),
        "buffer": buffer,
        "startup": startup_timeline(
            events, metrics, {n: paths.log(n) for n in ("trainer", "controller")}
        ),
    }
    if paths.placement_choice.is_file():  # workflow.placement auto: what ran, and why
        summary["placement_choice"] = json.loads(paths.placement_choice.read_text())
    if ledger is not None:
        for superseded in ("in_buffer_at_stop", "in_flight_controller"):
            summary.pop(superseded, None)
        summary.update(summary_fields(ledger, events, metrics, cfg.rollout.group_size))
    return summary


# ---------------------------------------------------------------- plots
def _save(
    plt: Any, fig: Any, ax: Any, path: Path, title: str, xlabel: str, ylabel: str | None = None
) -> None:
    """Label and title a plot (a legend where it has labelled lines), write it at 100 dpi
    and free the figure."""
    ax.set_xlabel(xlabel)
    if ylabel is not None:
        ax.set_ylabel(ylabel)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="best")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _plot_reward(plt: Any, metrics: list[TrainerRow], rollout: list[RolloutRow], out: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [r.step for r in metrics]
    rew = [r.reward_mean or 0.0 for r in metrics]
    ax.plot(steps, rew, ".", alpha=0.4, label="batch reward (= accuracy: reward is 0/1)")
    k = max(1, len(rew) // 10)
    smooth = [
        sum(rew[max(0, i - k + 1) : i + 1]) / len(rew[max(0, i - k + 1) : i + 1])
        for i in range(len(rew))
    ]
    ax.plot(steps, smooth, "-", label=f"moving mean ({k} steps)")
    ax.set_ylim(-0.02, 1.02)
    _save(
        plt, fig, ax, out / "reward.png", "Training reward", "optimizer step", "reward / accuracy"
    )


def _plot_version_lag(plt: Any, hist: dict[str, int], eta: int, out: Path) -> None:
    fig, ax = plt.subplots(figsize=(5, 3.5))
    lags = sorted(int(k) for k in hist) or [0]
    ax.bar(lags, [hist.get(str(k), 0) for k in lags], color="tab:blue")
    ax.axvline(eta + 0.5, color="tab:red", ls="--", label=f"bound eta = {eta}")
    title, xlabel = "Version lag of trained groups", "version lag (policy versions behind)"
    _save(plt, fig, ax, out / "version_lag.png", title, xlabel, "groups trained")


def _plot_throughput(
    plt: Any, metrics: list[TrainerRow], rollout: list[RolloutRow], out: Path, t0: float
) -> None:
    fig, ax = plt.subplots(figsize=(7, 4))
    rows = [r for r in rollout if not r.final]
    ax.plot(
        [r.time - t0 for r in rows],
        [r.samples_per_s for r in rows],
        "-o",
        ms=3,
        label="generated samples/s (controller)",
    )
    if len(metrics) > 1:
        g = metrics[0].sequences
        xs, ys = [], []
        for a, b in zip(metrics, metrics[1:], strict=False):
            dt = b.time - a.time
            if dt > 0:
                xs.append(b.time - t0)
                ys.append((b.sequences or g) / dt)
        ax.plot(xs, ys, "-s", ms=3, label="trained samples/s (trainer)")
    _save(plt, fig, ax, out / "throughput.png", "Throughput", "time since start (s)", "samples/s")


def _plot_timeline(
    plt: Any, metrics: list[TrainerRow], rollout: list[RolloutRow], out: Path, t0: float
) -> None:
    """Trainer: one bar per step's compute (+ publish) time; generation: the fraction of
    each metrics interval the servers were busy, as bar opacity."""
    fig, ax = plt.subplots(figsize=(9, 2.8))
    train = [(r.time - t0 - r.compute_s - r.publish_s, r.compute_s + r.publish_s) for r in metrics]
    ax.broken_barh(train, (0.6, 0.8), color="tab:orange")
    prev_t, prev_busy = None, 0.0
    for r in rollout:
        t, busy = r.time - t0, r.gen_busy_s
        if prev_t is not None and t > prev_t:
            frac = min(1.0, max(0.0, (busy - prev_busy) / (t - prev_t)))
            ax.broken_barh(
                [(prev_t, t - prev_t)], (1.6, 0.8), color="tab:blue", alpha=0.15 + 0.85 * frac
            )
        prev_t, prev_busy = t, busy
    ax.set_yticks([1.0, 2.0], ["trainer (compute)", "inference (busy)"])
    title = "Generation vs training busy time"
    _save(plt, fig, ax, out / "timeline.png", title, "time since start (s)")


def write_plots(run_dir: Path, summary: dict[str, Any]) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = RunPaths.at(run_dir)
    out = paths.report
    out.mkdir(parents=True, exist_ok=True)
    metrics = read_rows(paths.metrics, TrainerRow)
    rollout = read_rows(paths.rollout, RolloutRow)
    times = [r.time for r in [*metrics, *rollout] if r.time]
    t0 = min(times) if times else 0.0
    _plot_reward(plt, metrics, rollout, out)
    _plot_version_lag(
        plt, summary.get("version_lag_hist", {}), summary.get("max_staleness", 0), out
    )
    _plot_throughput(plt, metrics, rollout, out, t0)
    _plot_timeline(plt, metrics, rollout, out, t0)
    plot_mismatch(plt, metrics, out)
    return sorted(out.glob("*.png"))


def write_report(
    run_dir: Path,
    cfg: ExperimentConfig,
    buffer: dict[str, Any] | None = None,
    outcome: str = "finished",
    ledger: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Write `summary.json` and `report/*.png`; returns the summary."""
    summary = summarize(run_dir, cfg, buffer, outcome, ledger)
    add_fidelity(run_dir, cfg, summary)  # predicted vs measured, report/fidelity.png
    plots = write_plots(run_dir, summary)
    summary["plots"] = [str(p.relative_to(run_dir)) for p in plots]
    RunPaths.at(run_dir).summary.write_text(json.dumps(summary, indent=2, sort_keys=True))
    trackers = open_run_trackers(cfg, "report", run_dir)
    if trackers is not None:  # the plots as images, in the run's tracker group
        trackers.log_images(plots)
        trackers.close()
    return summary
