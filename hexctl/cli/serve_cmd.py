"""`areal-hex serve CONFIG [overrides] [--index I] [--port P]`: run inference server I.

Backend `builtin` serves the HF engine on `inference.base_port + I`; backend `sglang`
launches `python -m sglang.launch_server` with the same settings and waits until it is
healthy (its output goes to this process's stdout).
"""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    from hexctl.cli import add_config_args

    p = sub.add_parser("serve", help="run one inference server (built-in engine or SGLang)")
    add_config_args(p)
    p.add_argument("--index", type=int, default=0, help="server index (port = base_port + I)")
    p.add_argument("--port", type=int, default=None, help="listen on this port instead")
    p.add_argument(
        "--print-command",
        action="store_true",
        help="sglang backend: print the launch command (API key hidden) and exit",
    )
    p.set_defaults(func=_run, preflight=preflight)


def preflight(args: argparse.Namespace):  # -> tuple[ExperimentConfig, int]
    """What `areal-hex serve` checks before it starts a server: the config, the index and
    port, and (SGLang) that a launch command can be built. Returns (config, port);
    `areal-hex deploy` runs it on every server it renders."""
    from hexctl.cli import UsageError, config_from_args

    cfg = config_from_args(args)
    inf = cfg.inference
    if args.index < 0 or (args.index >= inf.num_servers and args.port is None):
        raise UsageError(
            f"--index {args.index}: expected 0 <= index < inference.num_servers ({inf.num_servers})"
        )
    port = args.port if args.port is not None else inf.base_port + args.index
    if not 0 < port < 65536:
        raise UsageError(f"port {port} is outside 1..65535")
    if inf.backend == "sglang":
        from rollout_service.server.sglang_launcher import launch_command

        try:
            launch_command(cfg.model, inf, port)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    return cfg, port


def _run(args: argparse.Namespace) -> int:
    from hexctl.cli import UsageError

    cfg, port = preflight(args)
    inf = cfg.inference
    if inf.backend == "sglang":
        import sys

        from rollout_service.server.sglang_launcher import (
            SGLangLaunchError,
            launch_command,
            redacted,
            run_sglang,
        )

        if args.print_command:
            print(redacted(launch_command(cfg.model, inf, port)))
            return 0
        try:
            return run_sglang(cfg.model, inf, port)
        except FileNotFoundError as exc:
            raise UsageError(f"cannot start SGLang: {exc}") from None
        except SGLangLaunchError as exc:
            print(f"areal-hex serve: error: {exc}", file=sys.stderr)
            return 1
    if args.print_command:
        raise UsageError("--print-command applies to inference.backend=sglang only")
    from rollout_service.server.main import serve

    try:
        serve(cfg.model, inf, port)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return 0
