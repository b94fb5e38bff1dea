"""The checks every deploy target makes before it writes anything: the plan against the
config (model, TP per instance, trainer world size and ZeRO stage, no GPU planned twice,
the placement map), every problem named at once; and the refusal of a trainer across GPU
kinds where the target cannot render one."""

from __future__ import annotations

from areal_hex.config import ConfigError, ExperimentConfig
from areal_hex.plan import Plan
from areal_hex.plan_placement import sharing_sides
from hexctl.deploy.config import DeployConfig
from hexctl.deploy.names import (
    GPU_PRODUCT_LABELS,
    gpu_label_value,
    normalize_model_name,
    slug,
)
from hexctl.job.layout import Layout

MIXED_TRAINER_TARGETS = ("k8s", "slurm")  # render a trainer across GPU kinds


def refuse_mixed_trainer(plan: Plan, target: str, dcfg: DeployConfig | None = None) -> None:
    """A trainer across GPU kinds needs every rank on a machine of the kind its
    `rank_speeds` entry assumes. Kubernetes renders it as one JobSet with a replicated job
    per kind (`k8s_trainer.kind_segments`), Slurm as one heterogeneous-job component per
    kind; compose (one host) and a Slurm site without heterogeneous jobs (one
    allocation) cannot, and refuse it rather than share a step wrongly."""
    t = plan.trainer
    if not t.mixed:
        return
    kinds = " + ".join(t.kinds)
    if target == "slurm-one-allocation":
        raise ConfigError(
            f"plan.trainer.gpu_kinds: the trainer spans GPU kinds {kinds} (heterogeneous "
            "data parallelism), which needs one job component per kind, but the site file "
            "sets `hetjob: false` (one allocation for every service); set `hetjob: true`, "
            "or plan again with `areal-hex plan --one-kind-trainer`"
        )
    if target not in MIXED_TRAINER_TARGETS:
        raise ConfigError(
            f"plan.trainer.gpu_kinds: the trainer spans GPU kinds {kinds} "
            f"(heterogeneous data parallelism), but --target {target} renders a trainer of "
            f"one GPU kind only; deploy it with --target k8s or --target slurm, run it with "
            f"`areal-hex run --plan`, or plan again with `areal-hex plan --one-kind-trainer`"
        )
    if dcfg is not None and dcfg.trainer.gang != "jobset":
        raise ConfigError(
            f"trainer.gang: the plan's trainer spans GPU kinds {' + '.join(t.kinds)}, "
            f"rendered as one JobSet with a replicated job per kind; got "
            f"{dcfg.trainer.gang!r}, expected 'jobset'"
        )


def check_plan(
    cfg: ExperimentConfig, plan: Plan, dcfg: DeployConfig, target: str, layout: Layout
) -> None:
    """Refuse a plan that does not fit the config; every problem is named at once."""
    errors = [
        *_check_model(cfg, plan),
        *_check_inference(cfg, plan, dcfg),
        *_check_trainer(cfg, plan, dcfg),
        *_check_devices(plan),
        *_check_placement(plan, dcfg),
    ]
    if target == "compose":
        nodes = sorted({n for s in layout.services for n in s.node_names})
        if len(nodes) > 1:
            errors.append(
                f"target compose runs every service on one host, but the plan uses "
                f"{len(nodes)} nodes ({', '.join(nodes)}); use --target k8s or a one-node plan"
            )
    redis_url = dcfg.redis.url or cfg.redis.url
    if dcfg.redis.mode == "external" and redis_url is None:
        errors.append("redis.mode is external but no URL is set (deploy redis.url or redis.url)")
    if errors:
        raise ConfigError("plan does not match the config:\n  " + "\n  ".join(errors))


def _check_model(cfg: ExperimentConfig, plan: Plan) -> list[str]:
    have = cfg.model.path or ("tiny" if cfg.model.tiny is not None else None)
    if have is None:
        return ["model.path is not set (the plan was made for model " + repr(plan.model) + ")"]
    if normalize_model_name(have) != normalize_model_name(plan.model):
        return [f"plan.model is {plan.model!r} but the config's model.path is {have!r}"]
    return []


def _check_inference(cfg: ExperimentConfig, plan: Plan, dcfg: DeployConfig) -> list[str]:
    errors: list[str] = []
    inf = cfg.inference
    if not plan.rollout:
        errors.append("plan.rollout is empty: the plan has no inference instances")
    seen: set[str] = set()
    pinned_tp = "tp_size" in inf.sglang.model_fields_set
    for i, inst in enumerate(plan.rollout):
        where = f"plan.rollout[{i}] ({inst.id})"
        if slug(inst.id) in seen:
            errors.append(f"{where}: instance id repeats another one")
        seen.add(slug(inst.id))
        if gpu_label_value(inst.gpu_kind, dcfg) is None:
            errors.append(_unknown_kind(where, inst.gpu_kind, dcfg))
        if len(inst.placement.gpu_ids) != inst.tp:
            errors.append(
                f"{where}: tp={inst.tp} but placement lists {len(inst.placement.gpu_ids)} GPUs"
            )
        # An unset tp_size takes the plan's degree per instance (a serve override, see
        # layout.py); one the config sets explicitly must agree with the plan.
        if inf.backend == "sglang" and pinned_tp and inst.tp != inf.sglang.tp_size:
            errors.append(
                f"{where}: tp={inst.tp} but the config sets inference.sglang.tp_size="
                f"{inf.sglang.tp_size} (remove it to take the plan's TP per instance)"
            )
        if inf.backend == "builtin" and inst.tp != 1:
            errors.append(f"{where}: tp={inst.tp} but the builtin engine serves on one GPU")
    if inf.backend == "builtin" and inf.device == "cpu":
        errors.append(
            "inference.device is 'cpu' but the plan puts inference on GPUs (expected 'cuda')"
        )
    return errors


def _check_trainer(cfg: ExperimentConfig, plan: Plan, dcfg: DeployConfig) -> list[str]:
    t, tc = plan.trainer, cfg.trainer
    errors: list[str] = []
    ngpus = sum(len(p.gpu_ids) for p in t.placements)
    for kind in t.kinds:  # each kind of a trainer across kinds, or its one kind
        if gpu_label_value(kind, dcfg) is None:
            errors.append(_unknown_kind("plan.trainer", kind, dcfg))
    if not t.placements:
        errors.append("plan.trainer.placements is empty")
    if t.dp * t.tp != t.world_size:
        errors.append(f"plan.trainer: dp={t.dp} x tp={t.tp} != world_size={t.world_size}")
    if ngpus != t.world_size:
        errors.append(f"plan.trainer: placements hold {ngpus} GPUs but world_size={t.world_size}")
    if t.tp != 1:
        errors.append(f"plan.trainer.tp={t.tp} but the DeepSpeed trainer runs pure data parallel")
    if t.zero_stage != tc.zero_stage:
        errors.append(
            f"plan.trainer.zero_stage={t.zero_stage} but trainer.zero_stage={tc.zero_stage}"
        )
    if tc.device != "cuda":
        errors.append(
            f"trainer.device is {tc.device!r} but the plan puts the trainer on {ngpus} "
            f"{t.gpu_kind} GPUs (expected 'cuda')"
        )
    counts = {len(p.gpu_ids) for p in t.placements}
    if len(counts) > 1:
        errors.append(
            f"plan.trainer: every node must hold the same number of ranks, got "
            f"{[len(p.gpu_ids) for p in t.placements]}"
        )
    if len(t.placements) > 1 and tc.launcher != "torchrun":
        errors.append(
            f"the plan spreads the trainer over {len(t.placements)} nodes, which needs "
            f"trainer.launcher=torchrun (static rendezvous from the pod environment); got "
            f"{tc.launcher!r}"
        )
    if len({p.node for p in t.placements}) != len(t.placements):
        errors.append("plan.trainer.placements name a node twice")
    if tc.resume != "auto":
        errors.append(
            f"trainer.resume is {tc.resume!r}: a restarted trainer must continue from its "
            "newest checkpoint on the shared volume (expected 'auto')"
        )
    mount = dcfg.storage.mount_path.rstrip("/") + "/"
    if tc.checkpoint_dir is not None and not tc.checkpoint_dir.startswith(mount):
        errors.append(
            f"trainer.checkpoint_dir {tc.checkpoint_dir!r} is not on the shared volume "
            f"({mount}): a restarted rank would not find it (leave it unset)"
        )
    return errors


def _check_placement(plan: Plan, dcfg: DeployConfig) -> list[str]:
    """A placement maps every plan node, and only those."""
    if not dcfg.placement:
        return []
    planned = {i.placement.node for i in plan.rollout} | {p.node for p in plan.trainer.placements}
    errors = []
    missing = sorted(planned - set(dcfg.placement))
    unknown = sorted(set(dcfg.placement) - planned)
    if missing:
        errors.append(
            f"placement maps no Kubernetes node for plan node(s) {', '.join(missing)} "
            f"(expected one entry per plan node: {', '.join(sorted(planned))})"
        )
    if unknown:
        errors.append(
            f"placement names {', '.join(unknown)}, which the plan does not use "
            f"(plan nodes: {', '.join(sorted(planned))})"
        )
    return errors


def _check_devices(plan: Plan) -> list[str]:
    """No GPU may be planned twice (colocated: generation and training take turns on the
    same GPUs, so only twice within one of the two; hybrid: the lent instances share the
    trainer's)."""
    errors: list[str] = []
    gen = [(i.id, i.placement) for i in plan.rollout]
    train = [("trainer", p) for p in plan.trainer.placements]
    sides = sharing_sides(plan, gen + train)  # which may share a GPU (colocated, hybrid)
    for side in sides:
        owner: dict[tuple[str, int], str] = {}
        for who, slot in side:
            for g in slot.gpu_ids:
                key = (slot.node, g)
                if key in owner:
                    errors.append(
                        f"GPU {g} of node {slot.node} is planned for {owner[key]} and {who}"
                    )
                owner[key] = who
    return errors


def _unknown_kind(where: str, kind: str, dcfg: DeployConfig) -> str:
    known = sorted({*GPU_PRODUCT_LABELS, *dcfg.gpu_labels})
    return (
        f"{where}: unknown GPU kind {kind!r} (known: {', '.join(known)}; map it with "
        f"gpu_labels in the deploy config or --gpu-label {kind}=<{dcfg.gpu_label_key} value>)"
    )


# ---------------------------------------------------------------- warnings
# What renders but loses something the operator should know of; printed, not refused.


def placement_warning(plan: Plan, dcfg: DeployConfig, target: str) -> str | None:
    """The plan was mapped onto the cluster's topology (phase 2: racks, NICs), but the
    rendered job lets the scheduler pick machines by GPU kind only, losing that gain."""
    b = plan.baselines
    if b is None or b.placement != "metis" or target == "compose":
        return None
    if target == "k8s" and (dcfg.pin_nodes or dcfg.placement):
        return None  # _check_placement: a placement maps every plan node
    gain = ""
    if b.first_fit_samples_per_s is not None:
        gain = (
            f": {plan.predicted.samples_per_s:.2f} samples/s placed, "
            f"{b.first_fit_samples_per_s:.2f} first-fit"
        )
    how = {
        "k8s": "map every plan node to its machine (`placement` in the deploy config: a "
        "hostname, or labels such as a rack; or --node PLAN_NODE=HOSTNAME); without it "
        "pods land on any node of their GPU kind",
        "slurm": "Slurm picks the nodes inside each partition; pin them with a component's "
        "`constraint` or `extra: [--nodelist=...]` in the site file",
    }[target]
    return (
        f"the plan places its pools on the cluster's topology (METIS{gain}), "
        f"and this render does not keep it: {how}"
    )


def image_warnings(dcfg: DeployConfig) -> list[str]:
    """Images a cluster's nodes will not find: `localhost/...` names what a local
    `docker build` tagged, which exists on that machine only."""
    local = [
        f"images.{role} {ref}"
        for role in ("inference", "trainer", "controller", "redis")
        if (ref := getattr(dcfg.images, role)).startswith("localhost/")
    ]
    if not local:
        return []
    return [
        f"{', '.join(local)}: local builds, which a cluster's nodes cannot pull; push them "
        "and name your registry (`images` in the deploy config, --image-tag, or `kustomize "
        "edit set image` on the base), with a digest (host/repo@sha256:...) to pin what runs"
    ]
