"""`--plot`: the cluster coloured by role, machines grouped by switch domain (rack, or a
zone's rack-less machines) with each weight publish drawn from the trainer's writer to
the rollout machines (dashed red where it crosses a domain's uplink), and (with
`--sweep-budget`) predicted throughput against budget. matplotlib, Agg backend."""

from __future__ import annotations

from pathlib import Path

from scheduler.cluster import Cluster
from scheduler.partition import Placement
from scheduler.topology import Topology

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
    topo = Topology(cl)
    groups = {g.name: g for g in cl.spec.node_groups}
    machines = sorted(topo.machines.values(), key=lambda m: (m.zone, m.domain))
    rows = [(groups[m.group], m.name) for m in machines]
    width = max(g.gpus_per_node for g in cl.spec.node_groups)
    row_of = {n: r for r, (_, n) in enumerate(rows)}
    for r, (g, n) in enumerate(rows):
        for i in range(g.gpus_per_node):
            ax.add_patch(Rectangle((i, -r), 0.9, 0.9, color=COLOURS[role.get((n, i), "idle")]))
    start = 0
    for r in range(1, len(machines) + 1):
        if r == len(machines) or machines[r].domain != machines[start].domain:
            dom = machines[start].domain
            label = f"{dom} ({topo.uplink[dom]:g} GB/s up)" if dom in topo.uplink else dom
            ax.add_patch(
                Rectangle((-0.2, -r + 0.95), width + 3.4, r - start, fill=False, lw=0.8, ls=":")
            )
            ax.text(width + 3.1, -start + 0.6, label, fontsize=6, ha="right", va="top")
            start = r
    if pl.trainer:
        writer = pl.trainer[0][0]
        for dst in sorted({node for _, node, _ in pl.rollout} - {writer}):
            cross = topo.machines[dst].domain != topo.machines[writer].domain
            xs = width + 0.6 + 0.15 * (row_of[dst] % 8)
            ax.plot(
                [width, xs, xs, width],
                [
                    -row_of[writer] + 0.45,
                    -row_of[writer] + 0.45,
                    -row_of[dst] + 0.45,
                    -row_of[dst] + 0.45,
                ],
                color="#d62728" if cross else "#7f7f7f",
                ls="--" if cross else "-",
                lw=0.8,
            )
    ax.set_yticks([-r + 0.45 for r in range(len(rows))])
    ax.set_yticklabels([f"{n} ({cl.kinds[g.name].name}, {g.zone})" for g, n in rows], fontsize=7)
    ax.set_xlim(-0.3, width + 3.3)
    ax.set_ylim(-len(rows) + 0.9, 1)
    ax.set_xlabel("GPU index")
    ax.set_title(f"{cl.name}: role of each GPU ({pl.method} placement)")
    ax.legend(
        handles=[Patch(color=c, label=k) for k, c in COLOURS.items()],
        loc="lower right",
        fontsize=7,
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
