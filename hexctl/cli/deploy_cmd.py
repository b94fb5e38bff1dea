"""`areal-hex deploy PLAN CONFIG [overrides] --target TARGET --out DIR`.

Before writing anything it checks the plan against the config and runs, for every
service it renders, the checks that service's own command runs at start (`preflight` of
`areal-hex train`, `rollout`, `serve`), on the config the service will load.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from hexctl.deploy import TARGETS

if TYPE_CHECKING:
    from areal_hex.config import ExperimentConfig
    from areal_hex.plan import Plan


def register(sub: argparse._SubParsersAction) -> None:
    from hexctl.cli import add_config_args

    p = sub.add_parser(
        "deploy",
        help="render a plan as docker-compose or Kubernetes manifests",
        description="Check PLAN (from `areal-hex plan`) against CONFIG and render the job "
        "for docker-compose (one host) or Kubernetes. See docs/deploy.md.",
    )
    p.add_argument("plan", help="plan.yaml written by `areal-hex plan`")
    add_config_args(p)
    p.add_argument("--target", choices=sorted(RUNNERS), required=True)
    p.add_argument("--site", type=Path, help="slurm: the site-mapping YAML (docs/slurm.md)")
    p.add_argument("--submit", action="store_true", help="slurm: sbatch the rendered job")
    p.add_argument(
        "--out",
        required=True,
        type=Path,
        help="folder to write into: new, empty, or an earlier render (with --force)",
    )
    p.add_argument(
        "--force", action="store_true", help="replace the files an earlier render wrote in --out"
    )
    p.add_argument("--deploy-config", type=Path, help="deploy options YAML (DeployConfig)")
    p.add_argument("--namespace", help="Kubernetes namespace (default: areal-hex)")
    p.add_argument("--image-tag", help="tag for the three areal-hex images")
    p.add_argument(
        "--gpu-label",
        action="append",
        default=[],
        metavar="KIND=VALUE",
        help="node-label value for a GPU kind, e.g. H20=NVIDIA-H20 (repeatable)",
    )
    p.add_argument(
        "--gpu-label-key", help="node label that tells GPU kinds apart (nvidia.com/gpu.product)"
    )
    p.add_argument(
        "--trainer-gang",
        choices=("jobset", "indexed-job"),
        help="k8s trainer: a JobSet restarting all ranks together (default), or a plain "
        "Indexed Job for clusters without the JobSet controller",
    )
    p.add_argument("--kueue-queue", metavar="NAME", help="k8s: Kueue LocalQueue of the trainer")
    p.add_argument(
        "--create-namespace",
        action="store_true",
        help="k8s: render the Namespace too (off: deploy into one that exists; `kubectl "
        "delete -k` of the folder would delete a rendered namespace with every run in it)",
    )
    p.add_argument("--priority-class", metavar="NAME", help="k8s: PriorityClass of the run's pods")
    p.add_argument(
        "--node",
        action="append",
        default=[],
        metavar="PLAN_NODE=HOSTNAME",
        help="k8s: the Kubernetes node a plan node is (repeatable; labels: deploy config "
        "`placement`)",
    )
    p.add_argument("--storage-class", help="storage class of the shared ReadWriteMany volume")
    p.add_argument(
        "--existing-secret",
        metavar="NAME",
        help="k8s: take redis-password and api-token from this existing Secret (none rendered)",
    )
    p.add_argument("--redis-url", help="use this external Redis (its password goes to the Secret)")
    p.set_defaults(func=_run)


def deploy_config(args: argparse.Namespace):  # -> DeployConfig
    """The deploy YAML (if any) with the CLI flags applied on top."""
    from areal_hex.config.base import build, read_yaml
    from hexctl.cli import UsageError
    from hexctl.deploy.config import DeployConfig

    data = read_yaml(args.deploy_config) if args.deploy_config else {}
    src = str(args.deploy_config or "deploy flags")
    if args.namespace:
        data["namespace"] = args.namespace
    if args.gpu_label_key:
        data["gpu_label_key"] = args.gpu_label_key
    if args.existing_secret:
        data["existing_secret"] = args.existing_secret
    if args.trainer_gang:
        data.setdefault("trainer", {})["gang"] = args.trainer_gang
    if args.kueue_queue:
        data["kueue_queue"] = args.kueue_queue
    if args.create_namespace:
        data["create_namespace"] = True
    if args.priority_class:
        data["priority_class"] = args.priority_class
    for item in args.node:
        node, sep, host = item.partition("=")
        if not sep or not node or not host:
            raise UsageError(f"--node {item!r}: expected PLAN_NODE=HOSTNAME, e.g. h800-0=gpu-17")
        data.setdefault("placement", {}).setdefault(node, {})["hostname"] = host
    if args.storage_class:
        data.setdefault("storage", {})["storage_class"] = args.storage_class
    if args.redis_url:
        data["redis"] = {**data.get("redis", {}), "mode": "external", "url": args.redis_url}
    for item in args.gpu_label:
        kind, sep, value = item.partition("=")
        if not sep or not kind or not value:
            raise UsageError(f"--gpu-label {item!r}: expected KIND=VALUE, e.g. H20=NVIDIA-H20")
        data.setdefault("gpu_labels", {})[kind] = value
    dcfg = build(DeployConfig, data, src)
    if args.image_tag:
        images = dcfg.images
        for role in ("inference", "trainer", "controller"):
            setattr(images, role, with_tag(getattr(images, role), args.image_tag))
    return dcfg


def with_tag(image: str, tag: str) -> str:
    """`registry:5000/areal-hex/cpu:0.1.0` -> `registry:5000/areal-hex/cpu:<tag>`."""
    repo = image.split("@", 1)[0]
    head, sep, last = repo.rpartition(":")
    if sep and "/" not in last:  # a tag, not a registry port
        repo = head
    return f"{repo}:{tag}"


@contextlib.contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    """os.environ with `values` set, restored afterwards."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def check_services(d) -> list[str]:  # d: hexctl.deploy.common.Deployment
    """Each rendered service's own start-up checks on the config it will load: its layout
    command is parsed by the real `areal-hex` parser and its command's `preflight` runs."""
    from areal_hex.config import ConfigError, save_config
    from hexctl.cli import UsageError, build_parser
    from hexctl.deploy.prepare import check_config
    from hexctl.job.layout import CONFIG_PLACEHOLDER

    parser = build_parser()
    errors: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        config = save_config(d.cfg, Path(tmp) / "config.yaml")
        problem = check_config(d.cfg)
        if problem:
            errors.append(f"prepare (initial weights): {problem}")
        for svc in d.layout.services:
            argv = [a.replace(CONFIG_PLACEHOLDER, str(config)) for a in svc.command]
            args = parser.parse_args(argv[1:])  # argv[0] is `areal-hex`
            # the environment the deployment gives it: a trainer's nodes (PET_NNODES)
            env = {"PET_NNODES": str(svc.nodes)} if svc.role == "trainer" else {}
            try:
                with _environ(env):
                    args.preflight(args)
            except (ConfigError, UsageError) as exc:
                shown = shlex.join(svc.command)
                errors.append(f"{svc.name} ({shown}): {exc}")
    return errors


def _run(args: argparse.Namespace) -> int:
    from areal_hex.plan import load_plan
    from hexctl.cli import UsageError, config_from_args

    if not Path(args.plan).is_file():
        raise UsageError(f"plan file not found: {args.plan} (write one with `areal-hex plan`)")
    plan = load_plan(args.plan)
    cfg = config_from_args(args)
    return RUNNERS[args.target](args, cfg, plan)


def _manifests(args: argparse.Namespace, cfg: ExperimentConfig, plan: Plan) -> int:
    """compose and k8s: rendered from the deploy config (--deploy-config and its flags)."""
    from hexctl.deploy import render

    dcfg = deploy_config(args)
    result = render(args.target, cfg, plan, dcfg, args.out, force=args.force, check=check_services)
    print(result.summary())
    print_warnings(result.warnings)
    return 0


def _slurm(args: argparse.Namespace, cfg: ExperimentConfig, plan: Plan) -> int:
    """slurm: rendered from the site mapping (--site), and submitted with --submit."""
    from hexctl.deploy.slurm import run_slurm_target

    return run_slurm_target(
        cfg, plan, args.site, args.out, args.submit, force=args.force, check=check_services
    )


# Every target `--target` takes, each with the inputs it renders from.
RUNNERS: dict[str, Callable[[argparse.Namespace, ExperimentConfig, Plan], int]] = {
    **{name: _manifests for name in TARGETS},
    "slurm": _slurm,
}


def print_warnings(warnings: list[str]) -> None:
    """On stderr, one block each, so that they stand out from the summary."""
    for w in warnings:
        print(f"areal-hex deploy: WARNING: {w}", file=sys.stderr)
