"""`areal-hex deploy`: render a plan and a config as docker-compose or Kubernetes files.

    from hexctl.deploy import render
    result = render("k8s", cfg, plan, DeployConfig(), Path("out"))

Every target starts from `hexctl.job.layout.build_layout(cfg, plan)`, the layout
`areal-hex run` starts locally. A target is one function from the checked `Deployment`
to the files it writes (`TARGETS`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from areal_hex.config import ExperimentConfig
from areal_hex.errors import UsageError
from areal_hex.plan import Plan
from hexctl.deploy.checks import image_warnings, placement_warning
from hexctl.deploy.common import Bundle, Deployment, on_trainer_gpus
from hexctl.deploy.common import prepare as prepare_deployment
from hexctl.deploy.config import DeployConfig
from hexctl.deploy.output import IGNORE_FILES, check_out_dir, write_files


def _compose(d: Deployment) -> Bundle:
    from hexctl.deploy.compose import render_compose

    return render_compose(d)


def _k8s(d: Deployment) -> Bundle:
    from hexctl.deploy.k8s import render_k8s_bundle

    return render_k8s_bundle(d)


TARGETS: dict[str, Callable[[Deployment], Bundle]] = {
    "compose": _compose,
    "k8s": _k8s,
}

# Writes files, keeps the marker and drops stale files (the Slurm target uses it too).
_write = write_files


@dataclass
class RenderResult:
    target: str
    out_dir: Path
    files: list[str]
    run_id: str
    gpus_by_kind: dict[str, int] = field(default_factory=dict)
    services: list[str] = field(default_factory=list)
    start: str = ""  # the command that starts the job
    delete: str = ""  # the command that deletes the job and nothing else
    warnings: list[str] = field(default_factory=list)  # rendered, but something is lost

    def summary(self) -> str:
        """What was rendered, for the terminal; never any secret value."""
        gpus = ", ".join(f"{n} x {k}" for k, n in sorted(self.gpus_by_kind.items()))
        lines = [
            f"rendered {self.target} for run {self.run_id} into {self.out_dir}",
            f"  services: {', '.join(self.services)}",
            f"  GPUs: {gpus}",
            f"  files: {', '.join(self.files)}",
        ]
        if self.start:
            lines.append(f"start with: {self.start}")
        if self.delete:
            lines.append(f"delete with: {self.delete}")
        return "\n".join(lines)


def render(
    target: str,
    cfg: ExperimentConfig,
    plan: Plan,
    dcfg: DeployConfig,
    out_dir: Path,
    *,
    force: bool = False,
    check: Callable[[Deployment], list[str]] | None = None,
) -> RenderResult:
    """Check `out_dir`, the plan against the config and (with `check`) every rendered
    service's own start-up checks; only then write the target's files into `out_dir`."""
    if target not in TARGETS:
        raise UsageError(f"unknown target {target!r}: expected one of {', '.join(TARGETS)}")
    check_out_dir(out_dir, force, target)
    d = prepare_deployment(cfg, plan, dcfg, target, out_dir)
    errors = check(d) if check is not None else []
    if errors:
        raise UsageError("a rendered service would refuse to start:\n  " + "\n  ".join(errors))
    bundle = TARGETS[target](d)
    warnings = [w for w in [placement_warning(plan, dcfg, target)] if w is not None]
    if target == "k8s":
        warnings += image_warnings(dcfg)
    files = {**IGNORE_FILES, **bundle.files}
    write_files(out_dir, files, bundle.private)
    gpus: Counter[str] = Counter()
    shared = on_trainer_gpus(d.cfg, d.layout)  # counted with the trainer's
    for s in d.layout.services:
        if s.name in shared:
            continue
        for kind, _, nodes in s.kind_segments():
            if kind is not None:
                gpus[kind] += s.gpus * nodes
    return RenderResult(
        target=target,
        out_dir=out_dir,
        files=sorted(files),
        run_id=d.cfg.run.run_id or "",
        gpus_by_kind=dict(gpus),
        services=[s.name for s in d.layout.services],
        start=bundle.start.format(out=out_dir),
        delete=bundle.delete,
        warnings=warnings,
    )
