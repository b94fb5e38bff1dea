"""`areal-hex deploy PLAN CONFIG [overrides] --target compose|k8s --out DIR`."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    from areal_hex.cli import add_config_args

    p = sub.add_parser(
        "deploy",
        help="render a plan as docker-compose or Kubernetes manifests",
        description="Check PLAN (from `areal-hex plan`) against CONFIG and render the job "
        "for docker-compose (one host) or Kubernetes. See docs/deploy.md.",
    )
    p.add_argument("plan", help="plan.yaml written by `areal-hex plan`")
    add_config_args(p)
    p.add_argument("--target", choices=("compose", "k8s", "slurm"), required=True)
    p.add_argument("--site", type=Path, help="slurm: the site-mapping YAML (docs/slurm.md)")
    p.add_argument("--submit", action="store_true", help="slurm: sbatch the rendered job")
    p.add_argument("--out", required=True, type=Path, help="directory to write into")
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
    p.add_argument("--storage-class", help="storage class of the shared ReadWriteMany volume")
    p.add_argument("--redis-url", help="use this external Redis (its password goes to the Secret)")
    p.set_defaults(func=_run)


def deploy_config(args: argparse.Namespace):  # -> DeployConfig
    """The deploy YAML (if any) with the CLI flags applied on top."""
    from areal_hex.cli import UsageError
    from areal_hex.config.base import build, read_yaml
    from areal_hex.config.deploy import DeployConfig

    data = read_yaml(args.deploy_config) if args.deploy_config else {}
    src = str(args.deploy_config or "deploy flags")
    if args.namespace:
        data["namespace"] = args.namespace
    if args.gpu_label_key:
        data["gpu_label_key"] = args.gpu_label_key
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


def _run(args: argparse.Namespace) -> int:
    from areal_hex.cli import UsageError, config_from_args
    from areal_hex.deploy import render
    from areal_hex.plan import load_plan

    if not Path(args.plan).is_file():
        raise UsageError(f"plan file not found: {args.plan} (write one with `areal-hex plan`)")
    plan = load_plan(args.plan)
    cfg = config_from_args(args)
    if args.target == "slurm":
        from areal_hex.deploy.slurm import run_slurm_target

        return run_slurm_target(cfg, plan, args.site, args.out, args.submit)
    result = render(args.target, cfg, plan, deploy_config(args), args.out)
    print(result.summary())
    if args.target == "k8s":
        print(f"apply with: kubectl apply -f {args.out}")
    else:
        print(f"start with: docker compose -f {args.out}/docker-compose.yaml up -d")
    return 0
