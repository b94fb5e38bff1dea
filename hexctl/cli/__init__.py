"""`areal-hex` command line: one small module per command, each with `register()`.

Command modules import heavy libraries (torch, deepspeed, transformers) inside their
handlers, so `areal-hex --help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from areal_hex.config import ConfigError
from areal_hex.errors import UsageError

__all__ = ["UsageError", "build_parser", "command_modules", "main"]


# Every `hexctl/cli/*_cmd.py` module defines `register(subparsers)`; its parser sets
# `func(args) -> int`. Commands are listed in `areal-hex --help` in module-name order.
def command_modules() -> list[str]:
    import pkgutil

    import hexctl.cli as pkg

    names = [m.name for m in pkgutil.iter_modules(pkg.__path__) if m.name.endswith("_cmd")]
    return [f"hexctl.cli.{n}" for n in sorted(names)]


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The `areal-hex` parser; `only`: just that command's (its module `<only>_cmd`), which
    spares a service's start the import and set-up of every other command."""
    parser = argparse.ArgumentParser(
        prog="areal-hex",
        description="Asynchronous RL for LLMs on heterogeneous GPUs.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    modules = command_modules()
    if only is not None and f"hexctl.cli.{only}_cmd" in modules:
        modules = [f"hexctl.cli.{only}_cmd"]
    for name in modules:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from areal_hex.lifetime import tie_to_launcher

    words = sys.argv[1:] if argv is None else argv
    # a command named first needs its own parser only; anything else (--help, a typo)
    # gets the whole one, with every command listed
    first = words[0] if words and not words[0].startswith("-") else None
    parser = build_parser(only=first)
    args = parser.parse_args(words)
    tie_to_launcher()  # a service of `areal-hex run` ends with it
    try:
        return int(args.func(args) or 0)
    except (ConfigError, UsageError) as exc:
        print(f"areal-hex {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"areal-hex {args.command}: interrupted", file=sys.stderr)
        return 130


def add_config_args(parser: argparse.ArgumentParser, required: bool = True) -> None:
    """The common `CONFIG [key.sub=value ...]` positional arguments."""
    parser.add_argument(
        "config", nargs=None if required else "?", help="experiment YAML (see examples/)"
    )
    parser.add_argument(
        "overrides", nargs="*", metavar="KEY=VALUE", help="overrides, e.g. trainer.lr=1e-5"
    )


def config_from_args(args: argparse.Namespace):  # -> ExperimentConfig
    """Load `args.config` with `args.overrides`; an optional CONFIG that looks like an
    override (`a.b=c`) is treated as one. `run --mode M` is the override `run.mode=M`,
    validated with the others (a colocated placement needs the sync it names)."""
    from areal_hex.config import load_config

    path, overrides = args.config, list(args.overrides)
    if path is not None and "=" in path and not path.endswith((".yaml", ".yml")):
        path, overrides = None, [path, *overrides]
    if getattr(args, "mode", None) is not None:
        overrides.append(f"run.mode={args.mode}")
    return load_config(path, overrides)


def require_run(cfg, command: str, need_redis: bool = True) -> None:  # cfg: ExperimentConfig
    """A service started on its own needs the run id and Redis URL that `areal-hex run` (or
    `areal-hex deploy`) writes into the run's config.yaml."""
    if cfg.run.run_id is None:
        raise UsageError(
            f"run.run_id is not set: {command} needs the run's config.yaml (written by "
            "areal-hex run or deploy) or run.run_id=ID"
        )
    if need_redis and cfg.redis.url is None:
        raise UsageError(
            f"redis.url is not set: {command} needs a running buffer server (areal-hex run "
            "starts one; its config.yaml has the URL), or pass redis.url=redis://HOST:PORT"
        )
