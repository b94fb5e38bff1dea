"""Slurm rendering: a plan as one heterogeneous batch job.

    areal-hex deploy PLAN CONFIG --target slurm --site SITE.yaml --out DIR [--submit]

One component per pool (docs/slurm.md):

    component 0           control: the batch script, Redis (Valkey) and the controller
    component 1..k        rollout: one per planned GPU kind, its instances as steps
    component k+1         trainer: `srun` one torchrun per node (rendezvous on node 0)

The services are the layout `areal-hex run` starts locally
(`hexctl.job.layout.build_layout`); the checks and the resolved config are those of the
other targets (`hexctl.deploy.common`), with the site file (`slurm_site.py`) in place
of the Kubernetes node labels. Host names exist only once the job runs, so the batch
script resolves them (`scontrol show hostnames`) and writes the run's config through
`hexctl.runtime.slurm` before any service starts.

A site with `hetjob: false` gets one allocation that every service shares (the fallback
for single-node sites, where components cannot share the node). Restart semantics: the
run directory on shared storage is the state; a requeued job starts the same services on
it (v0 kept, Valkey from its append-only file, the trainer from its newest complete
checkpoint, `trainer.resume: auto`).
"""

from __future__ import annotations

import dataclasses
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import yaml

from areal_hex.config import ConfigError, ExperimentConfig, dump_yaml
from areal_hex.errors import UsageError
from areal_hex.plan import Plan
from areal_hex.run_files import RunPaths
from hexctl.deploy import RenderResult
from hexctl.deploy.checks import check_plan, placement_warning, refuse_mixed_trainer
from hexctl.deploy.common import (
    PREDICTION,
    Deployment,
    load_secrets,
    object_prefix,
    on_trainer_gpus,
    prediction_for_plan,
    prediction_text,
    resolve_config,
    run_id,
)
from hexctl.deploy.config import DeployConfig, RedisDeployConfig, StorageConfig
from hexctl.deploy.names import slug
from hexctl.deploy.output import IGNORE_FILES, check_out_dir, write_files
from hexctl.deploy.slurm_script import (
    SCRIPT,
    Component,
    SlurmJob,
    Step,
    batch_script,
)
from hexctl.deploy.slurm_site import (
    KindPlacement,
    Placement,
    SiteConfig,
    load_site,
    megabytes,
)
from hexctl.job.layout import Layout, ServiceSpec, build_layout

# ---------------------------------------------------------------- checks


def site_errors(cfg: ExperimentConfig, plan: Plan, site: SiteConfig, source: str) -> list[str]:
    """What the site mapping cannot place, each with the field that says so."""
    errors: list[str] = []
    # one line per pool and kind: a task's instances, or the trainer's nodes, share one
    slots = dict.fromkeys((f"plan.{where}", k) for where, k, _ in plan.device_slots())
    known = ", ".join(sorted(site.kinds)) or "none"
    for where, kind in slots:
        if kind is not None and site.placement(kind) is None:
            errors.append(
                f"{where}: GPU kind {kind!r} has no entry under `kinds` in the site file "
                f"{source} (mapped: {known}); add kinds.{kind}: {{partition: ..., gres_type: ...}}"
            )
    errors += _device_errors(cfg, plan, site)
    errors += _node_size_errors(plan, site, source)
    if cfg.redis.url is None and site.redis.mode == "external" and site.redis.url is None:
        errors.append(f"{source}: redis.mode is external but redis.url is not set")
    if not site.hetjob:
        parts = {p.partition for p in _placements(plan, site)}
        if len(parts) > 1:
            errors.append(
                f"{source}: hetjob is false (one allocation, one partition) but the plan's "
                f"pools map to partitions {sorted(str(p) for p in parts)}"
            )
    return errors


def _node_size_errors(plan: Plan, site: SiteConfig, source: str) -> list[str]:
    """A plan node of a kind holds at most that kind's `gpus_per_node` GPUs (the shares
    of CPUs and memory are taken from it)."""
    used: dict[tuple[str, str], set[int]] = {}  # a GPU shared by two tasks counts once
    for _, kind, slot in plan.device_slots():
        if kind is None:
            continue
        used.setdefault((kind, slot.node), set()).update(slot.gpu_ids)
    errors = []
    for (kind, node), ids in sorted(used.items()):
        n = len(ids)
        place = site.placement(kind)
        if place is not None and place.gpus_per_node is not None and n > place.gpus_per_node:
            errors.append(
                f"plan node {node} uses {n} {kind} GPUs but kinds.{kind}.gpus_per_node in "
                f"{source} is {place.gpus_per_node}; expected at most that many per node"
            )
    return errors


def _placements(plan: Plan, site: SiteConfig) -> list[Placement]:
    kinds = dict.fromkeys(k for _, k, _ in plan.device_slots() if k is not None)
    found = [site.placement(k) for k in kinds]
    return [site.control, *(p for p in found if p is not None)]


def _device_errors(cfg: ExperimentConfig, plan: Plan, site: SiteConfig) -> list[str]:
    """Kinds on CPU-only nodes (`gpus: false`) need the CPU devices in the config."""
    errors = []
    for kind in plan.trainer.kinds:
        tk = site.placement(kind)
        if tk is not None and not tk.gpus and cfg.trainer.device != "cpu":
            errors.append(
                f"trainer.device is {cfg.trainer.device!r} but the site puts the trainer's "
                f"kind {kind!r} on CPU-only nodes (gpus: false); expected 'cpu'"
            )
    cpu_kinds = {
        r.gpu_kind for r in plan.rollout if (p := site.placement(r.gpu_kind)) and not p.gpus
    }
    gpu_kinds = {r.gpu_kind for r in plan.rollout} - cpu_kinds
    if cpu_kinds and gpu_kinds:
        errors.append(
            f"the site puts rollout kinds {sorted(cpu_kinds)} on CPU-only nodes and "
            f"{sorted(gpu_kinds)} on GPUs, but one inference.device serves them all"
        )
    elif cpu_kinds and (cfg.inference.backend != "builtin" or cfg.inference.device != "cpu"):
        errors.append(
            f"inference runs {cfg.inference.backend!r} on {cfg.inference.device!r} but the "
            f"site puts rollout kinds {sorted(cpu_kinds)} on CPU-only nodes (gpus: false); "
            "expected inference.backend=builtin with inference.device=cpu"
        )
    return errors


def plan_view(cfg: ExperimentConfig, plan: Plan, site: SiteConfig) -> ExperimentConfig:
    """The config as the shared plan checks should see it: the trainer always starts
    through torchrun here, and a pool the site runs on CPU-only nodes counts as placed
    on its planned slots (its devices were checked by `_device_errors`)."""
    view = cfg.model_copy(deep=True)
    view.trainer.launcher = "torchrun"
    if any((p := site.placement(k)) is not None and not p.gpus for k in plan.trainer.kinds):
        view.trainer.device = "cuda"
    if any((p := site.placement(r.gpu_kind)) is not None and not p.gpus for r in plan.rollout):
        view.inference.device = "cuda"
    return view


def deploy_config(cfg: ExperimentConfig, plan: Plan, site: SiteConfig) -> DeployConfig:
    """The DeployConfig the shared resolution reads: storage at the site's shared path,
    Redis as the site says, the plan's kinds known (the site file places them)."""
    kinds = [r.gpu_kind for r in plan.rollout] + [plan.trainer.gpu_kind, *plan.trainer.kinds]
    r = site.redis
    return DeployConfig(
        redis=RedisDeployConfig(mode=r.mode, url=r.url or cfg.redis.url, port=r.port),
        storage=StorageConfig(mount_path=site.shared_dir),
        gpu_labels={k: k for k in kinds},
        master_port=site.master_port,
    )


# ---------------------------------------------------------------- resolution


def prepare_job(
    cfg: ExperimentConfig, plan: Plan, site: SiteConfig, out_dir: Path, site_source: str
) -> SlurmJob:
    """Check (every problem at once), resolve the config, lay out components and steps."""
    refuse_mixed_trainer(plan, "slurm" if site.hetjob else "slurm-one-allocation")
    dcfg = deploy_config(cfg, plan, site)
    errors = site_errors(cfg, plan, site, site_source)
    view = plan_view(cfg, plan, site)
    try:
        check_plan(view, plan, dcfg, "slurm", build_layout(view, plan))
    except ConfigError as exc:
        errors += [line.strip() for line in str(exc).splitlines()[1:]]
    if errors:
        raise ConfigError("plan does not fit the config and site:\n  " + "\n  ".join(errors))
    prefix = object_prefix(run_id(cfg, plan))
    resolved = _resolve(resolve_config(cfg, plan, dcfg, prefix, "slurm", []), site, cfg)
    layout = build_layout(resolved, plan)
    secrets_ = load_secrets(cfg, dcfg, out_dir)
    prediction = prediction_for_plan(plan, resolved)
    d = Deployment(resolved, plan, layout, dcfg, prefix, secrets_, cfg.model, prediction)
    components, steps, slots = lay_out(layout, site)
    return SlurmJob(d, site, components, steps, slots)


def _resolve(cfg: ExperimentConfig, site: SiteConfig, asked: ExperimentConfig) -> ExperimentConfig:
    """Slurm's part of the resolved config: torchrun, Redis as a step of the job (or the
    site's), the Valkey append-only file in the run directory. Host names are written
    by the job (`slurm_runtime`); until then they read as loopback."""
    cfg = cfg.model_copy(deep=True)
    cfg.trainer.launcher = "torchrun"
    # /metrics ports as the experiment sets them: fixed ports are for pods, and nodes
    # here may be shared with other jobs
    cfg.trainer.metrics_port = asked.trainer.metrics_port
    cfg.rollout.metrics_port = asked.rollout.metrics_port
    run = RunPaths.of(cfg)
    if site.redis.mode == "internal":
        cfg.run.embedded_redis = True
        cfg.redis.url = f"redis://127.0.0.1:{site.redis.port}/0"
        cfg.redis.port = site.redis.port
        cfg.redis.bind = "0.0.0.0"
        cfg.redis.data_dir = str(run.valkey)
    return cfg


def lay_out(
    layout: Layout, site: SiteConfig
) -> tuple[list[Component], list[Step], list[tuple[int, int]]]:
    """Components in order (control, one per rollout kind, trainer) and the steps."""
    control = Component("control", site.control)
    components = [control]
    steps: list[Step] = []
    for svc in layout.by_role("redis"):
        steps.append(Step(svc.name, "redis", 0, svc.command, [0]))
    slots = _pool(site, "rollout", layout.by_role("inference"), components, steps)
    # the workflow's other tasks: a GPU task's instances as a pool of their own, a CPU
    # task's beside the controller
    workers = layout.by_role("worker")
    for task in dict.fromkeys(w.task for w in workers if w.gpus):
        _pool(site, str(task), [w for w in workers if w.gpus and w.task == task], components, steps)
    for svc in workers:
        if not svc.gpus:
            steps.append(Step(svc.name, "worker", 0, svc.command, [0]))
    trainer = layout.by_role("trainer")[0]
    # one component per GPU kind of the trainer, in rank order (a trainer across kinds:
    # each gets its kind's partition and GRES, and its first node rank)
    for i, (kind, first, n) in enumerate(trainer.kind_segments()):
        tplace = _kind(site, str(kind))
        name = "trainer" if i == 0 else f"trainer-{i}"
        comp = Component(name, tplace, n, trainer.gpus, [name])
        components.append(comp)
        cpus, mem = comp.share
        steps.append(
            Step(
                name,
                "trainer",
                len(components) - 1,
                trainer.command,
                list(range(n)),
                gpus=trainer.gpus if tplace.gpus else 0,
                cpus=cpus,
                mem=mem,
                devices=trainer.devices,
                rank_offset=first,
            )
        )
    for svc in layout.by_role("controller"):
        steps.append(Step(svc.name, "controller", 0, svc.command, [0]))
    control.services = [s.name for s in steps if s.component == 0]
    return components, steps, slots


def _pool(
    site: SiteConfig,
    prefix: str,
    members: list[ServiceSpec],
    components: list[Component],
    steps: list[Step],
) -> list[tuple[int, int]]:
    """One component per GPU kind of a pool of one-node services (inference servers, a
    task's instances), each a step on its node; their (component, node index) slots."""
    by_kind: dict[str, list[ServiceSpec]] = {}
    for svc in members:
        by_kind.setdefault(str(svc.gpu_kind), []).append(svc)
    slots: list[tuple[int, int]] = []
    for kind, servers in by_kind.items():
        place = _kind(site, kind)
        nodes = list(dict.fromkeys(n for s in servers for n in s.node_names))
        gpus = {n: sum(s.gpus for s in servers if s.node_names == [n]) for n in nodes}
        comp = Component(f"{prefix}-{slug(kind)}", place, len(nodes), max(gpus.values()))
        components.append(comp)
        k = len(components) - 1
        for s in servers:
            r = nodes.index(s.node_names[0])
            share = s.gpus / max(1, gpus[s.node_names[0]])
            steps.append(_server_step(s, k, r, comp, share))
            slots.append((k, r))
            comp.services.append(s.name)
    return slots


def _kind(site: SiteConfig, kind: str) -> KindPlacement:
    place = site.placement(kind)
    assert place is not None  # site_errors() names an unmapped kind first
    return place


def _server_step(s: ServiceSpec, k: int, r: int, comp: Component, share: float) -> Step:
    """An inference server gets its GPUs and its share of what its component asks for
    on the node (itself the share of that node's GPUs)."""
    cpus, mem = comp.share
    place = comp.place
    assert isinstance(place, KindPlacement)
    return Step(
        s.name,
        s.role,
        k,
        s.command,
        [r],
        gpus=s.gpus if place.gpus else 0,
        cpus=max(1, int(cpus * share)),
        mem=f"{max(1, int(megabytes(mem) * share))}M",
        devices=s.devices,
    )


# ---------------------------------------------------------------- rendering


def render_slurm(
    cfg: ExperimentConfig,
    plan: Plan,
    site: SiteConfig,
    out_dir: Path,
    site_source: str,
    *,
    force: bool = False,
    check: Callable[[Deployment], list[str]] | None = None,
) -> RenderResult:
    """Check `out_dir`, the plan against the config and site, and (with `check`) every
    service's own start-up checks; then write `job.sbatch`, `config.yaml`, `plan.yaml`,
    `site.yaml` and `secrets/` into `out_dir` (every node must see it: shared storage)."""
    out_dir = out_dir.resolve()
    check_out_dir(out_dir, force, "slurm")
    job = prepare_job(cfg, plan, site, out_dir, site_source)
    errors = check(_checked_services(job.d)) if check is not None else []
    if errors:
        raise UsageError("a rendered service would refuse to start:\n  " + "\n  ".join(errors))
    files = {
        **IGNORE_FILES,
        SCRIPT: batch_script(job, out_dir),
        "config.yaml": dump_yaml(job.d.cfg),
        "plan.yaml": yaml.safe_dump(plan.model_dump(mode="json"), sort_keys=False),
        "site.yaml": dump_yaml(site),
        PREDICTION: prediction_text(job.d.prediction),
    }
    private = set()
    for key, value in job.d.secrets.as_dict().items():
        if key == "redis-password" and site.redis.password_file:
            continue  # the job reads the operator's file
        files[f"secrets/{key}"] = value + "\n"
        private.add(f"secrets/{key}")
    write_files(out_dir, files, private)
    (out_dir / SCRIPT).chmod(0o755)
    gpus: dict[str, int] = {}
    shared = on_trainer_gpus(job.d.cfg, job.d.layout)  # counted with the trainer's
    for s in job.d.layout.services:
        if s.name in shared:
            continue
        for kind, _, nodes in s.kind_segments():
            place = site.placement(kind) if kind is not None else None
            if kind is not None and place is not None and place.gpus:
                gpus[kind] = gpus.get(kind, 0) + s.gpus * nodes
    return RenderResult(
        target="slurm",
        out_dir=out_dir,
        files=sorted(files),
        run_id=job.d.cfg.run.run_id or "",
        gpus_by_kind=gpus,
        services=[s.name for s in job.d.layout.services],
        start=f"sbatch {out_dir / SCRIPT}",
        warnings=[w for w in [placement_warning(plan, job.d.dcfg, "slurm")] if w],
    )


def _checked_services(d: Deployment) -> Deployment:
    """The deployment as the services' start-up checks see it: Valkey inside the job
    (`areal-hex buffer serve`) has none of its own."""
    services = [s for s in d.layout.services if s.role != "redis"]
    return dataclasses.replace(d, layout=Layout(services))


def submit(out_dir: Path) -> str:
    """`sbatch` the rendered job; returns the job id."""
    r = subprocess.run(
        ["sbatch", "--parsable", str(out_dir / SCRIPT)], capture_output=True, text=True
    )
    if r.returncode != 0:
        raise ConfigError(f"sbatch refused {out_dir / SCRIPT}: {r.stderr.strip()}")
    return r.stdout.strip().split(";")[0]


def watch_commands(job_id: str, run_dir: Path) -> list[str]:
    return [
        f"squeue --job {job_id}",
        f"sacct --jobs {job_id} --format=JobID,JobName,State,Elapsed,NodeList  (with accounting)",
        f"tail -f {shlex.quote(str(RunPaths.at(run_dir).metrics))}",
    ]


def run_slurm_target(
    cfg: ExperimentConfig,
    plan: Plan,
    site_path: Path | None,
    out_dir: Path,
    do_submit: bool,
    *,
    force: bool = False,
    check: Callable[[Deployment], list[str]] | None = None,
) -> int:
    """`areal-hex deploy ... --target slurm`: render, then submit or say how to."""
    if site_path is None:
        raise UsageError(
            "--target slurm needs --site SITE.yaml, the mapping of the plan's GPU kinds to "
            "partitions and GRES (docs/slurm.md; examples/slurm/site_local.yaml for a "
            "local CPU-only Slurm)"
        )
    site = load_site(site_path)
    result = render_slurm(cfg, plan, site, out_dir, str(site_path), force=force, check=check)
    if do_submit:
        result.start = ""  # submitted below
    print(result.summary())
    for w in result.warnings:
        print(f"areal-hex deploy: WARNING: {w}", file=sys.stderr)
    run_dir = Path(site.shared_dir) / "runs" / result.run_id
    if not do_submit:
        return 0
    if shutil.which("sbatch") is None:
        raise UsageError("--submit: sbatch is not on PATH (submit from a Slurm login node)")
    job_id = submit(result.out_dir)
    print(f"submitted job {job_id}")
    print("watch with:")
    for line in watch_commands(job_id, run_dir):
        print(f"  {line}")
    return 0
