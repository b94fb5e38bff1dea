"""End-of-run report: PNG plots and `summary.json` from `metrics.jsonl` (trainer, one row per
step) and `rollout.jsonl` (controller snapshots)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from areal_hex.launch.progress import read_jsonl


def summarize(run_dir: Path, wall_s: float, buffer: dict[str, Any] | None = None) -> dict[str, Any]:
    """Totals of a finished run, with the group accounting that shows nothing was lost:
    produced = trained + dropped_stale + dead_letter + left in the buffer."""
    steps = read_jsonl(run_dir / "metrics.jsonl")
    roll = read_jsonl(run_dir / "rollout.jsonl")
    last_t, last_r = (steps[-1] if steps else {}), (roll[-1] if roll else {})
    hist: Counter[str] = Counter()
    for row in steps:
        hist.update({k: int(v) for k, v in row.get("staleness_hist", {}).items()})
    samples = int(last_r.get("samples_total", 0))
    start = roll[0]["time"] - roll[0].get("elapsed_s", 0.0) if roll else None
    gen_window = (last_r["time"] - start) if roll and start else wall_s
    trained = int(last_t.get("groups_trained_total", 0))
    dropped = int(last_t.get("dropped_stale_total", 0))
    dead = int(last_t.get("dead_letter_total", 0))
    produced = int(last_r.get("groups_produced_total", 0))
    left = None if buffer is None else int(buffer["unconsumed"]) + int(buffer["pending"])
    recent = [r["reward_mean"] for r in steps[-5:] if r.get("reward_mean") is not None]
    return {
        "steps": int(last_t.get("step", 0)),
        "final_version": int(last_t.get("version", 0)),
        "versions_seen": sorted({int(r.get("version", 0)) for r in steps}),
        "final_reward": sum(recent) / len(recent) if recent else None,
        "first_reward": steps[0].get("reward_mean") if steps else None,
        "max_staleness": max((int(k) for k in hist), default=0),
        "staleness_hist": dict(sorted(hist.items(), key=lambda kv: int(kv[0]))),
        "samples_total": samples,
        "samples_per_s": samples / gen_window if gen_window else 0.0,
        "wall_s": wall_s,
        "groups": {
            "produced": produced,
            "trained": trained,
            "dropped_stale": dropped,
            "dead_letter": dead,
            "left_in_buffer": left,
            "in_flight_at_stop": int(last_r.get("groups_in_flight", 0)),
            "abandoned": int(last_r.get("groups_abandoned_total", 0)),
            "lost": None if left is None else produced - (trained + dropped + dead + left),
        },
    }


def write_report(run_dir: Path, summary: dict[str, Any]) -> list[Path]:
    """summary.json and the plots; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = read_jsonl(run_dir / "metrics.jsonl")
    roll = read_jsonl(run_dir / "rollout.jsonl")
    evals = read_jsonl(run_dir / "eval.jsonl")
    out = run_dir / "report"
    out.mkdir(exist_ok=True)
    files = []

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in steps], [r.get("reward_mean") or 0 for r in steps], label="reward")
    if evals:
        ax.plot(
            [e["step"] for e in evals], [e["accuracy"] for e in evals], "o-", label="held-out acc"
        )
    ax.set(xlabel="step", ylabel="reward / accuracy", title="Reward and accuracy")
    ax.legend()
    files.append(_save(fig, out / "reward.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    hist = summary["staleness_hist"]
    ax.bar([int(k) for k in hist], list(hist.values()))
    ax.set(xlabel="staleness (versions behind)", ylabel="groups trained", title="Staleness")
    files.append(_save(fig, out / "staleness.png"))

    fig, ax = plt.subplots(figsize=(7, 4))
    t0 = _t0(steps, roll)
    ax.plot(
        [r["time"] - t0 for r in roll],
        [r.get("samples_per_s", 0) for r in roll],
        label="rollout samples/s",
    )
    ax2 = ax.twinx()
    ax2.plot(
        [r["time"] - t0 for r in steps],
        [r.get("tokens_per_s", 0) for r in steps],
        "r.-",
        label="trainer tokens/s",
    )
    ax.set(xlabel="time (s)", ylabel="samples/s", title="Throughput")
    ax2.set_ylabel("tokens/s")
    fig.legend(loc="upper right")
    files.append(_save(fig, out / "throughput.png"))

    files.append(_timeline(plt, steps, roll, t0, out / "timeline.png"))
    path = run_dir / "summary.json"
    path.write_text(json.dumps(summary, indent=2) + "\n")
    files.append(path)
    return files


def _t0(steps: list[dict[str, Any]], roll: list[dict[str, Any]]) -> float:
    times = [r["time"] for r in steps] + [r["time"] for r in roll]
    return min(times) if times else 0.0


def _timeline(
    plt: Any, steps: list[dict[str, Any]], roll: list[dict[str, Any]], t0: float, path: Path
) -> Path:
    """Busy intervals per process: trainer compute (+publish) per step, and generation
    busy share per controller snapshot interval."""
    fig, ax = plt.subplots(figsize=(9, 2.8))
    train = []
    for r in steps:
        busy = float(r.get("compute_s", 0)) + float(r.get("publish_s", 0))
        train.append((r["time"] - t0 - busy, busy))
    ax.broken_barh(train, (10, 8), facecolors="tab:red", label="training")
    gen = []
    for a, b in zip(roll, roll[1:], strict=False):
        dt = b["time"] - a["time"]
        share = (
            min(1.0, max(0.0, (b.get("gen_busy_s", 0) - a.get("gen_busy_s", 0)) / dt)) if dt else 0
        )
        if share > 0:
            gen.append((a["time"] - t0, dt * share))
    ax.broken_barh(gen, (0, 8), facecolors="tab:blue", label="generation")
    ax.set(
        yticks=[4, 14],
        yticklabels=["rollout", "trainer"],
        xlabel="time (s)",
        title="Busy time: generation vs training",
    )
    ax.legend(loc="upper right")
    return _save(fig, path)


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
