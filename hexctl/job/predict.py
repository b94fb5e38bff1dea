"""What the cost model predicts for the layout a local run starts with (`prediction.json`).

With a plan, the layout is the plan's (its instances and trainer) and the cost model's
inputs are those the plan was made from (`plan.sources`); without one, it is the layout
`run` builds from the config (N servers, one trainer) on the devices of a local profile
(`areal-hex profile --local`, passed as `run --profile DIR`). Either way the same function
(`scheduler.predict.predict_layout`) prices it, for the mode the run runs in.
"""

from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from areal_hex.config import ConfigError, ExperimentConfig
from areal_hex.plan import Plan


@dataclass
class LocalProfileFiles:
    """The files `areal-hex profile --local` writes into one directory."""

    root: Path

    @property
    def cluster(self) -> Path:
        return self.root / "cluster.yaml"

    @property
    def profile(self) -> Path:
        return self.root / "profile.yaml"

    @property
    def workload(self) -> Path:
        return self.root / "workload.yaml"

    @property
    def model(self) -> Path:
        return self.root / "model"

    @property
    def measured(self) -> Path:
        return self.root / "measured.json"


def _inputs(
    cfg: ExperimentConfig, plan: Plan | None, profile_dir: Path | None
) -> tuple[Path, Path, Path | None, str] | str:
    """(cluster, workload, profile, model) paths, or why there are none."""
    if plan is not None:
        src = plan.sources
        if src is None or src.workload is None:
            return "the plan does not name the cluster spec and workload it was made from"
        named = (src.cluster, src.workload, src.profile)
        missing = [p for p in named if p and not Path(p).exists()]
        if missing:
            return f"the plan's inputs are gone: {', '.join(missing)}"
        return (
            Path(src.cluster),
            Path(src.workload),
            (Path(src.profile) if src.profile else None),
            plan.model,
        )
    if profile_dir is None:
        return "no plan and no local profile (areal-hex run --profile DIR, from profile --local)"
    f = LocalProfileFiles(profile_dir)
    for p in (f.cluster, f.workload, f.profile):
        if not p.is_file():
            return f"{p} is missing (areal-hex profile --local --out-dir {profile_dir} writes it)"
    return f.cluster, f.workload, f.profile, str(f.model)


def _layout(run: RunInputs, plan: Plan | None, cl: Any) -> tuple[list, Any]:
    from scheduler.predict import TrainerLayout

    group_of = {f"{g.name}-{i}": g.name for g in cl.spec.node_groups for i in range(g.nodes)}
    if plan is not None:
        inst = [(group_of.get(i.placement.node, "?"), i.tp) for i in plan.rollout]
        parts: dict[str, int] = {}
        for p in plan.trainer.placements:
            g = group_of.get(p.node, "?")
            parts[g] = parts.get(g, 0) + len(p.gpu_ids)
        per_node = max(len(p.gpu_ids) for p in plan.trainer.placements)
        return inst, TrainerLayout(tuple(parts.items()), per_node)
    group = cl.spec.node_groups[0].name
    inst = [(group, 1)] * run.num_servers
    ranks = run.num_ranks
    return inst, TrainerLayout(((group, ranks),), ranks)


def _nodes(plan: Plan | None, servers: int | None = None) -> Any:
    """The plan's machines (the trainer's first, each instance's: the first `servers`,
    default all), for pricing the weights' path on racks and NICs; None without a plan
    (a local run: one machine)."""
    from scheduler.predict import LayoutNodes

    if plan is None:
        return None
    return LayoutNodes(
        plan.trainer.placements[0].node,
        tuple(i.placement.node for i in plan.rollout[:servers]),
    )


def _task_groups(plan: Plan | None, cl: Any) -> dict[str, str]:
    """The node group each of the plan's GPU tasks runs on (task -> group)."""
    if plan is None:
        return {}
    group_of = {f"{g.name}-{i}": g.name for g in cl.spec.node_groups for i in range(g.nodes)}
    return {
        t.task: group_of[t.slots[0].node]
        for t in plan.decisions.tasks
        if t.gpu_kind is not None and t.slots[0].node in group_of
    }


def host_side(
    cfg: ExperimentConfig,
    plan: Plan | None = None,
    profile_dir: Path | None = None,
    unavailable: dict[str, Any] | None = None,
) -> tuple[str, dict[str, Any]]:
    """(where Valkey, the controller and its reward workers run: "trainer" or
    "inference", the prediction for the run with them there). `run.host_cores: auto`
    picks the side whose predicted asynchronous pipeline is faster (the trainer's on a
    tie, without a prediction, without pinning, and in sync mode, where the trainer waits
    while they work); the prediction records both candidates. `unavailable`: why the run
    has no profile (its prediction); a side the config names holds all the same."""
    choice = cfg.run.host_cores
    if unavailable:
        return ("trainer" if choice == "auto" else choice), unavailable
    if choice != "auto":
        return choice, predict_run(cfg, plan, profile_dir, choice)
    on_trainer = predict_run(cfg, plan, profile_dir, "trainer")
    if not cfg.run.pin_cores or cfg.run.mode == "sync" or "unavailable" in on_trainer:
        return "trainer", on_trainer
    on_inference = predict_run(cfg, plan, profile_dir, "inference")
    if "unavailable" in on_inference:
        return "trainer", on_trainer
    rates = {
        side: p["asynchronous"]["pipeline_samples_per_s"]
        for side, p in (("trainer", on_trainer), ("inference", on_inference))
    }
    side = "inference" if rates["inference"] > rates["trainer"] * (1 + 1e-6) else "trainer"
    chosen = on_inference if side == "inference" else on_trainer
    return side, {**chosen, "host_cores_candidates": rates}


@dataclass(frozen=True)
class RunInputs:
    """All that a prediction reads of a run's config (so, with its files, its key)."""

    groups_per_step: int
    group_size: int
    max_staleness: int
    publish_every: int
    checkpoint_every: int
    max_new_tokens: int
    weight_sync: str
    placement: str
    lent_servers: int
    max_concurrent_groups: int
    num_servers: int
    num_ranks: int

    @classmethod
    def of(cls, cfg: ExperimentConfig) -> RunInputs:
        b, r, t = cfg.buffer, cfg.rollout, cfg.trainer
        placement = cfg.workflow.placement_in_effect()
        return cls(
            b.groups_per_step, r.group_size, b.max_staleness, t.publish_every,
            t.checkpoint_every, r.max_new_tokens, r.weight_sync, placement,
            cfg.workflow.lent_servers if placement == "hybrid" else 0,
            r.max_concurrent_groups, cfg.inference.num_servers, t.num_ranks,
        )  # fmt: skip


# predictions made in this process, by their inputs: the launcher prices each placement
# `auto` may pick, then predicts the picked one's run again (hexctl/job/placement_choice.py)
_MADE: dict[tuple[Any, ...], dict[str, Any]] = {}


def _stamps(paths: tuple[Path, Path, Path | None, str]) -> tuple[str, ...]:
    """Each input's content: a file's digest (a model directory's: its config's; a copy
    of a profile is the profile), or the name of a model that is no file."""
    out = []
    for p in paths:
        path = Path(p) / "config.json" if p is not None and Path(p).is_dir() else p
        try:
            out.append(hashlib.sha256(Path(path).read_bytes()).hexdigest() if path else "")
        except OSError:
            out.append(f"name:{p}")
    return tuple(out)


def predict_run(
    cfg: ExperimentConfig,
    plan: Plan | None = None,
    profile_dir: Path | None = None,
    host: str = "trainer",
) -> dict[str, Any]:
    """The prediction for the run `cfg` describes, in both modes, with Valkey, the
    controller and its rewards on the `host` side's cores ("trainer" or "inference");
    `{"unavailable": why}` when the cost model lacks an input. Made once per inputs
    (`RunInputs`, the plan, the input files as they are) in a process."""
    found = _inputs(cfg, plan, profile_dir)
    if isinstance(found, str):
        return {"unavailable": found}
    run = RunInputs.of(cfg)
    key = (run, plan.model_dump_json() if plan is not None else None, _stamps(found), host)
    made = _MADE.get(key)
    if made is None:
        made = _predict(run, plan, found, host)
        if "unavailable" in made:  # says where: not kept for inputs elsewhere
            return made
        _MADE[key] = made
    return {**copy.deepcopy(made), "cluster": str(found[0])}


def _predict(
    run: RunInputs, plan: Plan | None, found: tuple[Path, Path, Path | None, str], host: str
) -> dict[str, Any]:
    from scheduler.cluster import load_cluster
    from scheduler.colocated import switch_s
    from scheduler.hybrid import hybrid_rates
    from scheduler.model_shape import load_model_shape
    from scheduler.predict import LayoutError, predict_layout
    from scheduler.profile import load_profile
    from scheduler.workload import load_workload

    cluster, workload, profile, model = found
    try:
        cl = load_cluster(cluster)
        m = load_model_shape(model)
        w = load_workload(workload).model_copy(
            update={
                "groups_per_step": run.groups_per_step,
                "group_size": run.group_size,
                "max_staleness": run.max_staleness,
                "publish_every": run.publish_every,
                "checkpoint_every": run.checkpoint_every,
                "max_response_tokens": run.max_new_tokens,
                "host_work": "rollout" if host == "inference" else "trainer",
                "weight_sync": run.weight_sync,
            }
        )
        prof = load_profile(profile, m.params) if profile else None
        placement = run.placement
        if prof is not None and placement == "colocated":
            prof = prof.on_every_core()  # each phase on every core, where measured
        if prof is not None and placement == "hybrid":
            prof = prof.with_heap_trim()  # its trainer gives its heap back every step
        inst, trainer = _layout(run, plan, cl)
        lent = run.lent_servers

        def price(servers: list, lent: int = 0) -> Any:
            return predict_layout(
                cl,
                m,
                w,
                prof,
                servers,
                trainer,
                max_inflight_groups=run.max_concurrent_groups,
                nodes=_nodes(plan, len(servers)),  # a hybrid's own: the first
                task_groups=_task_groups(plan, cl),
                lent=lent,
            )

        pred = price(inst, lent)
        kind = {g.name: g.gpu for g in cl.spec.node_groups}.get(trainer.parts[0][0], "")
        switch = switch_s(w, prof, kind)
        if lent:  # the servers of their own, and the lent ones (scheduler/lending.py)
            own = price(inst[: len(inst) - lent])
            pred = hybrid_rates(own, pred, w.samples_per_step, switch)
    except (ConfigError, LayoutError) as exc:
        return {"unavailable": str(exc)}
    syn, asyn = pred.synchronous.as_dict(), pred.asynchronous.as_dict()
    if placement == "colocated":  # one context switch a step, in turn
        step = w.samples_per_step / max(syn["pipeline_samples_per_s"], 1e-12)
        syn["pipeline_samples_per_s"] = w.samples_per_step / (step + switch)
    if placement != "disaggregated":
        syn["context_switch_s"] = asyn["context_switch_s"] = switch
    if placement == "hybrid":  # what the lent servers make while they generate
        syn["lent_samples_per_s"] = asyn["lent_samples_per_s"] = pred.lent_samples_per_s
        asyn["lent_first_group_s"] = pred.lent_first_group_s
    return {
        "source": "plan" if plan is not None else "local profile",
        "cluster": str(cluster),
        "host_cores": host,
        "asynchronous": asyn,
        "synchronous": syn,
    }


def write_prediction(path: Path, prediction: dict[str, Any]) -> None:
    path.write_text(json.dumps(prediction, indent=2))
