"""`areal-hex config CONFIG [overrides]`: validate and print the resolved config."""

from __future__ import annotations

import argparse

from areal_hex.config import dump_yaml


def register(sub: argparse._SubParsersAction) -> None:
    from hexctl.cli import add_config_args

    p = sub.add_parser("config", help="validate a config and print it fully resolved")
    add_config_args(p, required=False)
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from hexctl.cli import config_from_args

    cfg = config_from_args(args)
    print(dump_yaml(cfg), end="")
    return 0
