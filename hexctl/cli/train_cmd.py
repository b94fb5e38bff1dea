"""`areal-hex train CONFIG [overrides]`: start the trainer ranks through the deepspeed
(or torchrun) launcher, one rank per device; `DS_ACCELERATOR=cpu` on CPU."""

from __future__ import annotations

import argparse
import os
import shlex
import sys

from areal_hex.net import free_port


def register(sub: argparse._SubParsersAction) -> None:
    from hexctl.cli import add_config_args

    p = sub.add_parser("train", help="run the DeepSpeed trainer (one rank per device)")
    add_config_args(p)
    p.add_argument(
        "--print-command", action="store_true", help="print the launcher command, do not run it"
    )
    p.set_defaults(func=_run, preflight=preflight)


def launcher_command(cfg, config: str, overrides: list[str]) -> list[str]:  # cfg: ExperimentConfig
    """The launcher command line that starts `trainer.num_ranks` ranks of
    `trainer_service.main` with the same config and overrides."""
    t = cfg.trainer
    port = str(t.master_port or free_port())
    tail = ["trainer_service.main", config, *overrides]
    if t.launcher == "deepspeed":
        head = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(t.num_ranks)]
        return [*head, "--master_port", port, "--module", *tail]
    head = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(t.num_ranks)]
    return [*head, "--master_port", port, "-m", *tail]


def launcher_env(cfg) -> dict[str, str]:  # cfg: ExperimentConfig
    env = dict(os.environ)
    offset = env.pop("AREAL_HEX_NODE_RANK_OFFSET", "")
    if offset:  # a trainer across GPU kinds: this pod's job starts at node rank `offset`
        for key in ("PET_NODE_RANK", "NODE_RANK"):
            if env.get(key, "").isdigit():
                env[key] = str(int(offset) + int(env[key]))
    if cfg.trainer.device == "cpu":
        from trainer_service.engine import cpu_environment

        env["DS_ACCELERATOR"] = "cpu"
        cpu_environment(env)
        # ranks share the cores: one rank's intra-op threads must not starve the others
        per_rank = max(1, (os.cpu_count() or 1) // cfg.trainer.num_ranks)
        env.setdefault("OMP_NUM_THREADS", str(per_rank))
    return env


def preflight(args: argparse.Namespace):  # -> ExperimentConfig
    """What `areal-hex train` checks before it starts any process; `areal-hex deploy` runs
    it on every trainer it renders."""
    from areal_hex.config.checks import check_run
    from hexctl.cli import UsageError, config_from_args, require_run

    cfg = config_from_args(args)
    # trainer.replay_path trains from a file: no buffer server needed
    require_run(cfg, "areal-hex train", need_redis=cfg.trainer.replay_path is None)
    check_run(cfg)
    speeds = cfg.trainer.rank_speeds
    nodes = _nodes()
    if speeds is not None and len(speeds) != cfg.trainer.num_ranks * nodes:
        across = f" x {nodes} nodes (PET_NNODES)" if nodes > 1 else ""
        raise UsageError(
            f"trainer.rank_speeds has {len(speeds)} values for trainer.num_ranks = "
            f"{cfg.trainer.num_ranks}{across}: expected one speed per rank of the job"
        )
    return cfg


def _nodes() -> int:
    """Nodes the job's ranks span: the launcher's PET_NNODES where a deployment sets it
    (`areal-hex deploy` does on every multi-node trainer), else 1."""
    raw = os.environ.get("PET_NNODES", "1")
    return int(raw) if raw.isdigit() and int(raw) > 0 else 1


def _run(args: argparse.Namespace) -> int:
    cfg = preflight(args)  # validate before any process starts
    cmd = launcher_command(cfg, args.config, list(args.overrides))
    if args.print_command:
        print(shlex.join(cmd))
        return 0
    sys.stdout.flush()
    os.execvpe(cmd[0], cmd, launcher_env(cfg))
    return 0  # not reached
