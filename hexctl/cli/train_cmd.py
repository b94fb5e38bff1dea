"""`areal-hex train CONFIG [overrides]`: start the trainer ranks through the deepspeed
(or torchrun) launcher, one rank per device (one rank on one node: the rank itself, in
this process); `DS_ACCELERATOR=cpu` on CPU."""

from __future__ import annotations

import argparse
import os
import shlex
import sys

from areal_hex.net import free_port
from hexctl.launch.zygote import PRELOADED_ENV


def register(sub: argparse._SubParsersAction) -> None:
    from hexctl.cli import add_config_args

    p = sub.add_parser("train", help="run the DeepSpeed trainer (one rank per device)")
    add_config_args(p)
    p.add_argument(
        "--print-command", action="store_true", help="print the launcher command, do not run it"
    )
    p.set_defaults(func=_run, preflight=preflight)


def single_rank(cfg) -> bool:  # cfg: ExperimentConfig
    """One rank on one node: the rank is started itself, with the rendezvous variables a
    launcher would set (`rank_env`), since a launcher would only spawn it; that saves the
    launcher's two interpreters and their imports (seconds on a small machine)."""
    return cfg.trainer.num_ranks == 1 and _nodes() == 1


def rank_env(cfg) -> dict[str, str]:  # cfg: ExperimentConfig
    """What the launcher sets for the only rank of a one-rank job."""
    port = str(cfg.trainer.master_port or free_port())
    one = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}
    return {**one, "LOCAL_SIZE": "1", "MASTER_PORT": port}


def launcher_command(cfg, config: str, overrides: list[str]) -> list[str]:  # cfg: ExperimentConfig
    """The command line that starts `trainer.num_ranks` ranks of `trainer_service.main`
    with the same config and overrides: the launcher's, or the rank's own (`single_rank`)."""
    t = cfg.trainer
    tail = ["trainer_service.main", config, *overrides]
    if single_rank(cfg):
        return [sys.executable, "-m", *tail]
    port = str(t.master_port or free_port())
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
    env = launcher_env(cfg)
    if single_rank(cfg):
        env.update(rank_env(cfg))
        env.setdefault("MASTER_ADDR", "127.0.0.1")
        # torch's settings (threads) still to be read, or set again by a service forked
        # with torch loaded (launch/zygote.py)
        if "torch" not in sys.modules or os.environ.get(PRELOADED_ENV):
            return run_rank_here(env, [args.config, *args.overrides])
    sys.stdout.flush()
    os.execvpe(cmd[0], cmd, env)
    return 0  # not reached


def run_rank_here(env: dict[str, str], argv: list[str]) -> int:
    """The only rank, in this process: a new interpreter would import the config and
    the CLI again (~0.3 s of CPU taken from the servers starting beside it). Its
    environment is set before torch and DeepSpeed are imported, as the launcher's is."""
    from hexctl.launch.zygote import apply_threads
    from trainer_service.main import main as rank_main

    os.environ.clear()
    os.environ.update(env)
    apply_threads()
    return rank_main(argv)
