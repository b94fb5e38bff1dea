"""`areal-hex profile --box BOX.yaml`: each emulated kind of a box measured inside one of
its nodes, and the box written as an inventory `areal-hex plan` reads as any cluster.

Per kind, `profile --local`'s measurements (`local_profile.profile_local`) with the
devices replaced by one node of the kind: its server started in the node's namespace and
cgroup and reached at the node's address (over the node's NIC and rack uplink, from the
launcher on the spine), its training timed in a process that joined the node's cgroup,
the engine's batch limit the kind's. Once every kind has been timed, each is timed again
(its continuous load and training step; `second_sitting.py`) and priced at the mean of
both sittings. Each kind's files go to `OUT/kinds/<kind>/`; then

- `cluster.yaml`: one zone; a node group per kind (one device per node, the kind's
  price and NIC), the racks and their uplinks as the box has them, and per kind the
  effective compute and bandwidth the measurements imply and an HBM size at which the
  cost model's KV-cache batch is the kind's `max_running_requests`;
- `profile.yaml`: the rates of every kind (device `box`: the launcher's controller is
  not on a node's CPU share, so no trainer pays for it);
- `workload.yaml`, `model/`: as `profile --local` writes them (the first kind's lengths).
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import statistics
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml

from areal_hex.config import ExperimentConfig
from areal_hex.config.base import load_yaml_text
from hexctl.box.cgroups import receiver_cgroups
from hexctl.box.emulate import BoxState, node_argv
from hexctl.box.second_sitting import combine, sit_again
from hexctl.box.spec import Box
from hexctl.box.speed import node_speed
from hexctl.job.predict import LocalProfileFiles
from hexctl.profile.devices import LocalDevices, Say, quiet
from scheduler.profile import BOX_DEVICE

BOX_ZONE = "box"
# A node's quota throttles it every 10 ms: its continuous load is measured in 5 rounds
# of at least 4 s each, and its reloads 5 times (a machine's own cores: 3, 1 s).
BOX_REPEATS = 5
BOX_MIN_WINDOW_S = 4.0
# Its decode step is timed over pairs of waves whose steps add up to 2 s: one pair's 12
# steps at a fifth of a core (~40-100 ms) came out from half to twice their mean, and the
# median of 3 such pairs at batch 32 from 4.9 to 9.9 ms in four profiles of one kind.
BOX_MIN_DECODE_S = 2.0


def node_devices(state: BoxState, node: str, memory_gb: float) -> LocalDevices:
    n = state.node(node)
    threads = max(1, math.ceil(n.cpu))  # more threads than the quota only contend
    return LocalDevices(
        kind="CPU",  # profiled as a CPU device; `_merge` files it under the node's kind
        device="cpu",
        count=1,
        inference_cores=None,
        trainer_cores=None,
        inference_threads=threads,
        trainer_threads=threads,
        memory_gb=memory_gb,
        node_prefix=node_argv(n, []),
        address=n.address,
        cgroup=n.cgroup,
        netns=n.netns,
        repeats=BOX_REPEATS,
        min_window_s=BOX_MIN_WINDOW_S,
        min_decode_s=BOX_MIN_DECODE_S,
    )


def profile_box(
    cfg: ExperimentConfig,
    box: Box,
    state: BoxState,
    out: Path,
    batches: list[int] | None,
    say: Say | None = None,
) -> LocalProfileFiles:
    """Each kind of `box` profiled inside one of its nodes, merged into one inventory and
    profile in `out`; `say` hears each stage, prefixed with the kind. Then every kind is
    timed again and its rates taken at the mean of both sittings (`second_sitting.py`)."""
    from hexctl.job.prepare import initial_model_dir
    from hexctl.profile.local import profile_local

    out.mkdir(parents=True, exist_ok=True)
    files = LocalProfileFiles(out)
    cfg = cfg.model_copy(deep=True)
    cfg.run.pin_cores = False
    cfg.model.path = str(initial_model_dir(cfg, out))  # one initial model for every kind
    per_kind: dict[str, LocalProfileFiles] = {}
    kinds = {}
    for kind, spec in box.spec.kinds.items():
        node = next(n.name for n in box.nodes if n.kind == kind)
        kcfg = cfg.model_copy(deep=True)
        kcfg.inference.max_running_requests = spec.max_running_requests
        dev = node_devices(state, node, memory_gb=64.0)  # the batch: the engine limit
        told = None if say is None else (lambda text, k=kind: say(f"{k}: {text}"))
        kinds[kind] = (node, kcfg, dev, told)
        before = node_speed([state.node(node)])[node]
        with _receivers(kcfg, dev) as rx:  # the training profile's send to two servers
            rdev = replace(dev, receiver_cgroups=rx)
            per_kind[kind] = profile_local(kcfg, out / "kinds" / kind, batches, rdev, told)
        _record_speed(per_kind[kind], node, [before, node_speed([state.node(node)])[node]])
    for kind, (node, kcfg, dev, told) in kinds.items():  # again, minutes after the first
        before = node_speed([state.node(node)])[node]
        again = sit_again(kcfg, dev, per_kind[kind], told or quiet)
        combine(per_kind[kind], again)
        _record_speed(per_kind[kind], node, [before, node_speed([state.node(node)])[node]])
    first = next(iter(per_kind.values()))
    files.model.mkdir(parents=True, exist_ok=True)
    shutil.copy(first.model / "config.json", files.model / "config.json")
    shutil.copy(first.workload, files.workload)
    _merge(box, per_kind, files)
    return files


def _receivers(
    cfg: ExperimentConfig, dev: LocalDevices
) -> contextlib.AbstractContextManager[tuple[str, ...]]:
    """Two cgroups of the node's quota for the training profile's receivers, where the
    run syncs over the network (none from disk)."""
    if cfg.rollout.weight_sync != "network" or dev.cgroup is None:
        return contextlib.nullcontext(())
    return receiver_cgroups(dev.cgroup, 2)


def _record_speed(files: LocalProfileFiles, node: str, speeds: list[float | None]) -> None:
    """The node's speed (`box_speed.node_speed`) before and after its kind was profiled, kept
    in the kind's `measured.json`: what a later run on the box is held against."""
    measured = json.loads(files.measured.read_text())
    before = (measured.get("node_speed") or {}).get("samples") or []  # a first sitting's
    measured["node_speed"] = {"node": node, "samples": [*before, *speeds]}
    files.measured.write_text(json.dumps(measured, indent=2))


def profiled_speed(files: LocalProfileFiles) -> dict[str, float]:
    """Each kind's node speed while it was profiled (the mean of its samples); kinds of
    a profile made before it was sampled are left out."""
    kinds = json.loads(files.measured.read_text()).get("kinds", {})
    out = {}
    for kind, measured in kinds.items():
        got = (measured.get("node_speed") or {}).get("samples") or []
        samples = [v for v in got if v is not None]  # a sample that failed: None
        if samples:
            out[kind] = sum(samples) / len(samples)
    return out


def _merge(box: Box, per_kind: dict[str, LocalProfileFiles], files: LocalProfileFiles) -> None:
    """One inventory and one profile from the kinds' own files."""
    from scheduler.profile import Profile, load_profile, save_profile

    workload = load_yaml_text(files.workload.read_text(), str(files.workload))
    batches = {k: s.max_running_requests for k, s in box.spec.kinds.items()}
    constants = workload.setdefault("constants", {})
    constants["max_running_requests"] = max(batches.values())
    # disk sync reads the host's own disk, on no link; the rounds' pause holds the read
    constants["storage_on_links"] = False
    workload["max_trainer_nodes"] = 1  # `run.box` launches the trainer on one node
    files.workload.write_text(yaml.safe_dump(workload, sort_keys=False))
    kinds, overrides, reloads = {}, {}, []
    for kind, f in per_kind.items():
        prof = load_profile(f.profile)
        rates = prof.kinds["CPU"].model_copy(update={"device": BOX_DEVICE})
        kinds[kind] = rates
        cpu = load_yaml_text(f.cluster.read_text(), str(f.cluster))["gpu_overrides"]["CPU"]
        cpu["hbm_gb"] = _hbm_gb(files, workload, batches[kind])
        overrides[kind] = cpu
        zone = load_yaml_text(f.cluster.read_text(), str(f.cluster))["zones"][0]
        gen = json.loads(f.measured.read_text())["generation"]
        own = _pause_ms(files, gen)
        reloads.append(own or zone["inter_node_latency_ms"])
        if own is not None:  # the kind's own, in place of the zone's (the slowest kind's)
            rates.update_pause_s = own / 1e3
        idle = _pause_ms(files, gen, "reload_idle_network_s")
        if idle is not None:  # a synchronous run's, nothing in flight
            rates.update_pause_idle_s = idle / 1e3
        params = prof.params
    save_profile(Profile(model=str(files.model), params=params, kinds=kinds), files.profile)
    spec = inventory(box, overrides, max(reloads))
    files.cluster.write_text(yaml.safe_dump(spec, sort_keys=False))
    measured = {k: json.loads(f.measured.read_text()) for k, f in per_kind.items()}
    files.measured.write_text(json.dumps({"kinds": measured}, indent=2))


def _pause_ms(
    files: LocalProfileFiles, gen: dict[str, Any], measured: str = "reload_under_load_s"
) -> float | None:
    """The link latency that prices a kind's weight update as its update rounds measured
    it (`reload_under_load_s`: the run's controller updating the server under the run's
    load, from disk or over the network as the run will, about 20 updates a round; or
    `measured`: `reload_idle_network_s`, the same over the network with nothing in
    flight): the median pause, less the fixed seconds the cost model adds for that mode
    (`sync_cost.sync_terms` at no latency: each bucket's call over the network), so
    that the link's latency plus them is the pause measured; None if not measured."""
    from scheduler.model_shape import load_model_shape
    from scheduler.sync_cost import sync_terms
    from scheduler.workload import load_workload

    pauses = gen.get(measured)
    if not pauses:
        return None
    w = load_workload(files.workload)
    if gen.get("reload_under_load_sync") not in (None, w.weight_sync):
        return None  # measured in the other mode than the workload's
    _, fixed = sync_terms(load_model_shape(str(files.model)), w, 0.0)
    return round(max(0.0, statistics.median(pauses) - fixed) * 1e3, 3)


def _hbm_gb(files: LocalProfileFiles, workload: dict[str, Any], batch: int) -> float:
    """The memory at which the cost model's KV-cache batch (free memory // one request's
    KV) is `batch`: the kind's engine limit, its emulated KV budget."""
    from scheduler.model_shape import load_model_shape
    from scheduler.workload import CostConstants

    m = load_model_shape(str(files.model))
    k = CostConstants()
    per_req = (workload["prompt_tokens"] + workload["max_response_tokens"]) * m.kv_bytes_per_token
    usable = (batch + 0.5) * per_req + 2.0 * m.params + k.runtime_reserve_gb * 1e9
    return round(usable / k.hbm_utilization / 1e9, 9)


def inventory(box: Box, overrides: dict[str, dict[str, Any]], reload_ms: float) -> dict[str, Any]:
    """The box as a cluster spec (`scheduler/cluster.py`): node group KIND holds the
    nodes KIND-0, KIND-1, ..., racks as the box has them; bandwidths in GB/s."""
    counts = {k: sum(1 for n in box.nodes if n.kind == k) for k in box.spec.kinds}
    fastest = max(s.nic_mbit for s in box.spec.kinds.values())
    groups = [
        {
            "name": kind,
            "gpu": kind,
            "gpus_per_node": 1,
            "nodes": counts[kind],
            "zone": BOX_ZONE,
            "usd_per_gpu_hour": s.usd_per_hour,
            "intra_node": {"kind": "pcie", "bandwidth_gbs": 10.0},
            "nic_gbs": s.nic_mbit / 8000,
        }
        for kind, s in box.spec.kinds.items()
        if counts[kind]
    ]
    racks = []
    for r, rack in enumerate(box.spec.racks):
        members = []
        for n in (n for n in box.nodes if n.rack == r):
            index = int(n.name.rsplit("-", 1)[1])
            last = members[-1] if members else None
            if last and last["group"] == n.kind and last["first"] + last["count"] == index:
                last["count"] += 1
            else:
                members.append({"group": n.kind, "first": index, "count": 1})
        racks.append({"name": rack.name, "uplink_gbs": rack.uplink_mbit / 8000, "members": members})
    return {
        "name": f"box-{box.name}",
        "zones": [
            {
                "name": BOX_ZONE,
                "region": BOX_ZONE,
                "inter_node_bandwidth_gbs": fastest / 8000,
                # a weight update's pause with requests in flight, the slowest kind's
                "inter_node_latency_ms": reload_ms,
            }
        ],
        "node_groups": groups,
        "racks": racks,
        "gpu_overrides": overrides,
    }
