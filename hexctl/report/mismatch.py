"""The report's train-inference mismatch plot (`report/mismatch.png`): per optimizer step,
the mean |log pi_train - log pi_infer| and the k3 estimate of KL(pi_infer || pi_train) on
the tokens the trained version generated, one line per inference server and per GPU
kind (`TrainerRow.mismatch`). Written only when some step measured it (decoupled PPO)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from areal_hex.run_files import TrainerRow

# (row key, panel title) and (statistic, axis label), in the order they are drawn
GROUPINGS = (("server", "per inference server"), ("gpu_kind", "per GPU kind"))
STATISTICS = (("abs_dlogp", "mean |log p_train - log p_infer|"), ("k3", "k3 KL(infer || train)"))


def mismatch_series(
    rows: list[TrainerRow], grouping: str, statistic: str
) -> dict[str, tuple[list[int], list[float]]]:
    """name -> (steps, values) of one statistic, over the steps that measured it."""
    out: dict[str, tuple[list[int], list[float]]] = {}
    for r in rows:
        for name, m in r.mismatch.get(grouping, {}).items():
            steps, values = out.setdefault(name, ([], []))
            steps.append(r.step)
            values.append(m[statistic])
    return out


def plot_mismatch(plt: Any, rows: list[TrainerRow], out: Path) -> Path | None:
    """Draw `out/mismatch.png` (a 2 x 2 grid: statistic x grouping); None if no step
    measured a mismatch."""
    if not any(r.mismatch for r in rows):
        return None
    fig, axes = plt.subplots(2, 2, figsize=(10, 6), sharex=True)
    for col, (grouping, title) in enumerate(GROUPINGS):
        for row, (statistic, label) in enumerate(STATISTICS):
            ax = axes[row][col]
            for name, (steps, values) in sorted(mismatch_series(rows, grouping, statistic).items()):
                ax.plot(steps, values, "-o", ms=3, label=name)
            ax.set_ylabel(label)
            if row == 0:
                ax.set_title(f"Train-inference mismatch {title}")
                ax.legend(loc="best", fontsize=7)
            else:
                ax.set_xlabel("optimizer step")
    fig.tight_layout()
    path = out / "mismatch.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
