"""`--plot`: the cluster coloured by role, and (with `--sweep-budget`) predicted
throughput against budget. matplotlib with the Agg backend (no display needed)."""

from __future__ import annotations

from pathlib import Path

from scheduler.cluster import Cluster
from scheduler.partition import Placement, node_names

COLOURS = {"trainer": "#d62728", "rollout": "#1f77b4", "idle": "#d9d9d9"}


def plot(
    path: str | Path, cl: Cluster, pl: Placement, sweep: list[dict[str, float]] | None = None
) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    role: dict[tuple[str, int], str] = {}
    for node, ids in pl.trainer:
        role.update({(node, i): "trainer" for i in ids})
    for _, node, ids in pl.rollout:
        role.update({(node, i): "rollout" for i in ids})
    ncols = 2 if sweep else 1
    fig, axes = plt.subplots(1, ncols, figsize=(7 * ncols, 5), squeeze=False)
    ax = axes[0][0]
    rows = [(g, n) for g in cl.spec.node_groups for n in node_names(g)]
    for r, (g, n) in enumerate(rows):
        for i in range(g.gpus_per_node):
            ax.add_patch(Rectangle((i, -r), 0.9, 0.9, color=COLOURS[role.get((n, i), "idle")]))
    ax.set_yticks([-r + 0.45 for r in range(len(rows))])
    ax.set_yticklabels([f"{n} ({cl.kinds[g.name].name}, {g.zone})" for g, n in rows], fontsize=7)
    ax.set_xlim(0, max(g.gpus_per_node for g in cl.spec.node_groups))
    ax.set_ylim(-len(rows) + 0.9, 1)
    ax.set_xlabel("GPU index")
    ax.set_title(f"{cl.name}: role of each GPU")
    ax.legend(
        handles=[Patch(color=c, label=k) for k, c in COLOURS.items()], loc="upper right", fontsize=7
    )
    if sweep:
        ax2 = axes[0][1]
        xs = [s["budget_usd_per_h"] for s in sweep]
        ax2.plot(xs, [s["samples_per_s"] for s in sweep], "o-", label="heterogeneous (MILP)")
        ax2.plot(
            xs, [s["homogeneous_samples_per_s"] for s in sweep], "s--", label="best homogeneous"
        )
        ax2.plot(
            xs, [s["synchronous_samples_per_s"] for s in sweep], "^:", label="best synchronous"
        )
        ax2.set_xlabel("budget ($/h)")
        ax2.set_ylabel("predicted samples/s")
        ax2.set_title("throughput against budget")
        ax2.legend(fontsize=8)
        ax2.grid(alpha=0.3)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
