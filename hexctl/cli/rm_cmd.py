"""`areal-hex rm train CONFIG [overrides] [--out DIR] [--force]`: the tiny reward model of
a job (areal_hex/reward_model.py): trained on the job's generated data, right answers
against wrong ones, and kept in the cache the reward-model task loads it from. Prints
one JSON object: where it is, its training steps and time, and its held-out accuracy.
"""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    from hexctl.cli import add_config_args

    p = sub.add_parser("rm", help="reward model: train the tiny one of a job")
    cmds = p.add_subparsers(dest="rm_command", metavar="SUBCOMMAND")
    cmds.required = True
    tr = cmds.add_parser(
        "train",
        help="train the job's tiny reward model (cached: a second call only reads it)",
    )
    add_config_args(tr)
    tr.add_argument("--out", default=None, help="also copy it to this directory")
    tr.add_argument("--force", action="store_true", help="train again even if cached")
    tr.set_defaults(func=_train)


def _train(args: argparse.Namespace) -> int:
    import json
    import shutil
    from pathlib import Path

    from areal_hex.reward_model import read_info, tiny_key, tiny_reward_model
    from hexctl.cli import UsageError, config_from_args

    cfg = config_from_args(args)
    if cfg.rollout.reward_model.path is not None:
        raise UsageError(
            f"rollout.reward_model.path is {cfg.rollout.reward_model.path}: that model is "
            "used as it is; unset it to train the tiny one"
        )
    if args.force:
        from areal_hex.reward_model import cache_root

        shutil.rmtree(cache_root() / tiny_key(cfg)[0], ignore_errors=True)
    try:
        path = tiny_reward_model(cfg)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if args.out is not None:
        out = Path(args.out)
        if out.exists():
            raise UsageError(f"--out {out} exists: expected a new directory")
        shutil.copytree(path, out)
        path = out
    print(json.dumps({"path": str(path), **(read_info(path) or {})}))
    return 0
