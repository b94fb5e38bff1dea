"""`areal-hex deploy`: render a plan and a config as docker-compose or Kubernetes files.

    from areal_hex.deploy import render
    result = render("k8s", cfg, plan, DeployConfig(), Path("out"))

Both targets start from `areal_hex.layout.build_layout(cfg, plan)`, the layout
`areal-hex run` starts locally.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import yaml

from areal_hex.config import ExperimentConfig, dump_yaml
from areal_hex.config.deploy import DeployConfig
from areal_hex.plan import Plan

Target = Literal["compose", "k8s"]
MANIFEST = ".areal-hex-deploy"  # names of the files the last render wrote


@dataclass
class RenderResult:
    target: str
    out_dir: Path
    files: list[str]
    run_id: str
    gpus_by_kind: dict[str, int] = field(default_factory=dict)
    services: list[str] = field(default_factory=list)

    def summary(self) -> str:
        """What was rendered, for the terminal; never any secret value."""
        gpus = ", ".join(f"{n} x {k}" for k, n in sorted(self.gpus_by_kind.items()))
        lines = [
            f"rendered {self.target} for run {self.run_id} into {self.out_dir}",
            f"  services: {', '.join(self.services)}",
            f"  GPUs: {gpus}",
            f"  files: {', '.join(self.files)}",
        ]
        return "\n".join(lines)


def render(
    target: Target, cfg: ExperimentConfig, plan: Plan, dcfg: DeployConfig, out_dir: Path
) -> RenderResult:
    """Check the plan against the config, then write the target's files into `out_dir`."""
    from areal_hex.deploy.common import prepare

    d = prepare(cfg, plan, dcfg, target, out_dir)
    # k8s: `kubectl apply -f DIR` reads every top-level YAML, so the plain copies of the
    # config and plan (also inside the ConfigMap) go to a subdirectory.
    where = "" if target == "compose" else "resolved/"
    files: dict[str, str] = {
        f"{where}config.yaml": dump_yaml(d.cfg),
        f"{where}plan.yaml": yaml.safe_dump(plan.model_dump(mode="json"), sort_keys=False),
    }
    private: set[str] = set()
    if target == "compose":
        from areal_hex.deploy.compose import render_compose

        files["docker-compose.yaml"] = yaml.safe_dump(render_compose(d), sort_keys=False)
    else:
        from areal_hex.deploy.k8s import dump_objects, render_k8s

        for name, objs in render_k8s(d).items():
            files[name] = dump_objects(objs)
        private.add("01-secret.yaml")
    if target == "compose" or dcfg.existing_secret is None:
        for key, value in d.secrets.as_dict().items():
            files[f"secrets/{key}"] = value + "\n"
            if target == "k8s":
                private.add(f"secrets/{key}")
    # secrets/ is 0700 either way; compose bind-mounts the files themselves, so they stay
    # readable (0644) for the containers' non-root users.
    _write(out_dir, files, private)
    gpus: Counter[str] = Counter()
    for s in d.layout.services:
        if s.gpu_kind is not None:
            gpus[s.gpu_kind] += s.gpus * s.nodes
    return RenderResult(
        target=target,
        out_dir=out_dir,
        files=sorted(files),
        run_id=d.cfg.run.run_id or "",
        gpus_by_kind=dict(gpus),
        services=[s.name for s in d.layout.services],
    )


def _write(out_dir: Path, files: dict[str, str], private: set[str]) -> None:
    """Write `files`; secrets 0600 in a 0700 dir; drop files a previous render wrote that
    this one did not (a stale inference manifest would otherwise be applied again)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    old = out_dir / MANIFEST
    if old.is_file():
        for name in old.read_text().split():
            if name not in files and (out_dir / name).is_file():
                (out_dir / name).unlink()
    for name, text in files.items():
        path = out_dir / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if name.startswith("secrets/"):
            path.parent.chmod(0o700)
        mode = 0o600 if name in private else 0o644
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        path.chmod(mode)
    old.write_text("\n".join(sorted(files)) + "\n")
