"""`areal-hex box random --seed N --out FILE`: a feasible box nobody tuned on.

From the seed alone (`random.Random(seed)`), on a machine of `cores` cores (default 2):

- 2-4 kinds with a comparative advantage drawn at random: CPU shares and engine batch
  limits (the KV budget) are drawn apart and paired in opposite orders, so the kind with
  the most CPU has the smallest batch, and the reverse; prices follow the CPU share with
  noise, NICs are drawn from 100-1000 Mbit/s;
- 1-3 racks with uplinks of 2-50 Mbit/s, every rack holding at least one node;
- 1-3 nodes a kind, numbered at random across the racks (a shuffled host file);
- CPU quotas that fit the machine (`checks.check_fits`), and a kind with two nodes, so
  that `bench hetero`'s one-kind baseline exists.

The file it writes loads (`spec.load_box`), fits and states the least budget its plans
need (`checks.min_budget`) in a comment.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import yaml

from hexctl.box.checks import check_fits, min_budget, node_room
from hexctl.box.spec import BoxSpec, make_box

BATCHES = (4, 8, 16, 32, 64, 128)  # the engine batch limits a kind may draw
NICS = (100, 200, 400, 1000)  # Mbit/s
MIN_CPU = 0.1  # the least quota a node is given (the cgroup minimum of emulate.py)


def _kinds(rng: random.Random, count: int) -> dict[str, dict[str, Any]]:
    """`count` kinds whose CPU shares and batch limits rank in opposite orders."""
    cpus = sorted((c / 100 for c in rng.sample(range(15, 61), count)), reverse=True)
    batches = sorted(rng.sample(BATCHES, count))
    names = [f"k{i}" for i in range(count)]
    rng.shuffle(names)  # which kind name gets which advantage
    kinds = {}
    for name, cpu, batch in zip(names, cpus, batches, strict=True):
        kinds[name] = {
            "cpu": cpu,
            "max_running_requests": batch,
            "usd_per_hour": round(0.3 + cpu * rng.uniform(2.0, 6.0), 2),
            "nic_mbit": rng.choice(NICS),
        }
    return dict(sorted(kinds.items()))


def _fit(kinds: dict[str, dict[str, Any]], counts: dict[str, int], room: float) -> None:
    """Scale the CPU shares down, keeping their order strict and none under MIN_CPU, with
    fewer nodes where that is not enough, until the nodes' quotas fit `room` cores."""
    drawn = {k: v["cpu"] for k, v in kinds.items()}
    order = sorted(drawn, key=lambda k: -drawn[k])
    while True:
        total = sum(drawn[k] * c for k, c in counts.items())
        scale = min(1.0, room / total)
        prev = None
        for k in order:
            cpu = int(drawn[k] * scale * 100) / 100
            if prev is not None:
                cpu = min(cpu, round(prev - 0.01, 2))
            kinds[k]["cpu"] = prev = cpu
        if prev >= MIN_CPU and sum(kinds[k]["cpu"] * c for k, c in counts.items()) <= room:
            return
        # keep a kind with two nodes: the one-kind baseline
        pairs = sum(1 for c in counts.values() if c >= 2)
        fewer = [k for k, c in counts.items() if c > 2 or (c == 2 and pairs > 1)]
        counts[max(fewer, key=lambda k: counts[k] * drawn[k])] -= 1


def _racks(rng: random.Random, counts: dict[str, int]) -> list[dict[str, Any]]:
    """The nodes shuffled across 1-3 racks; each rack's members as runs of numbers."""
    nodes = [(k, i) for k, c in counts.items() for i in range(c)]
    rng.shuffle(nodes)
    n_racks = rng.randint(1, min(3, len(nodes)))
    cuts = sorted(rng.sample(range(1, len(nodes)), n_racks - 1))
    racks = []
    for r, (lo, hi) in enumerate(zip([0, *cuts], [*cuts, len(nodes)], strict=True)):
        members: list[dict[str, Any]] = []
        for kind, i in sorted(nodes[lo:hi]):
            last = members[-1] if members else None
            if last and last["kind"] == kind and last["first"] + last["count"] == i:
                last["count"] += 1
            else:
                members.append({"kind": kind, "first": i, "count": 1})
        uplink = round(rng.uniform(2.0, 50.0), 1)
        racks.append({"name": "abc"[r], "uplink_mbit": uplink, "members": members})
    return racks


def random_box(seed: int, cores: int = 2) -> dict[str, Any]:
    """The box of `seed` as the YAML's mapping (see the module's docstring)."""
    rng = random.Random(seed)
    kinds = _kinds(rng, rng.randint(2, 4))
    counts = {k: rng.randint(1, 3) for k in kinds}
    if max(counts.values()) < 2:  # the one-kind baseline: two nodes of the cheapest
        counts[min(kinds, key=lambda k: kinds[k]["usd_per_hour"])] = 2
    _fit(kinds, counts, node_room(cores))
    name = f"r{seed % 100_000}"  # 1-6 of [a-z0-9]: seeds 100000 apart share a name
    return {"name": name, "kinds": kinds, "racks": _racks(rng, counts)}


def write_random_box(seed: int, out: Path, cores: int = 2) -> dict[str, Any]:
    """Write the box of `seed` to `out` after checking it loads and fits; returns what
    `box random` prints: the file, the box's name and the least budgets of its plans."""
    data = random_box(seed, cores)
    box = make_box(BoxSpec.model_validate(data), f"box random --seed {seed}")
    check_fits(box, cores)
    least, one_kind = min_budget(box)
    head = (
        f"# areal-hex box random --seed {seed} --cores {cores}\n"
        f"# a plan needs at least {least:g} $/h; the one-kind baseline {one_kind:g} $/h\n"
    )
    out.write_text(head + yaml.safe_dump(data, sort_keys=False))
    return {
        "out": str(out),
        "box": box.name,
        "seed": seed,
        "nodes": len(box.nodes),
        "min_budget_usd_per_h": least,
        "one_kind_budget_usd_per_h": one_kind,
    }
