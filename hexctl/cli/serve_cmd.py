"""`areal-hex serve CONFIG [overrides] [--index I] [--port P] [--reward-model]`: run
inference server I.

Backend `builtin` serves the HF engine on `inference.base_port + I`; backend `sglang`
launches `python -m sglang.launch_server` with the same settings and waits until it is
healthy (its output goes to this process's stdout). With `--reward-model` it serves
instance I of the workflow's reward-model task instead (on the task's `port + I`): the
sequence classifier of `rollout.reward_model` behind SGLang's /classify, which SGLang
serves with `--is-embedding` (passed on with the sglang backend).
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
        "--reward-model",
        action="store_true",
        help="serve the reward model (the workflow task of role reward_model; port = its "
        "port + I): SGLang's --is-embedding, answering /classify",
    )
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
    if getattr(args, "reward_model", False):
        return cfg, reward_model_port(cfg, args.index, args.port)
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


def reward_model_port(cfg, index: int, port: int | None) -> int:  # cfg: ExperimentConfig
    """The port of reward-model instance `index` (`--port` over the task's port + index)."""
    from hexctl.cli import UsageError

    task = cfg.workflow.task_with_role("reward_model")
    if task is None:
        raise UsageError(
            "--reward-model: workflow.tasks has no task with role reward_model; expected one "
            '(docs/rollout.md, "Reward model")'
        )
    if not 0 <= index < task.instances:
        raise UsageError(
            f"--index {index}: expected 0 <= index < the instances of task {task.name!r} "
            f"({task.instances})"
        )
    if port is None and task.port is None:
        raise UsageError(f"--reward-model: task {task.name!r} has no port; give --port")
    chosen = port if port is not None else task.port + index
    if not 0 < chosen < 65536:
        raise UsageError(f"port {chosen} is outside 1..65535")
    return chosen


def _run_reward_model(args: argparse.Namespace, cfg, port: int) -> int:
    """Serve the reward model: its path, or the tiny one (trained and cached first)."""
    from areal_hex.config import ModelConfig
    from areal_hex.reward_model import reward_model_path
    from hexctl.cli import UsageError

    rm, inf = cfg.rollout.reward_model, cfg.inference
    try:
        path = reward_model_path(cfg)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if inf.backend == "sglang":
        from rollout_service.server.sglang_launcher import launch_command, redacted, run_sglang

        model = ModelConfig(path=path, tokenizer_path=rm.tokenizer_path, dtype=rm.dtype)
        if args.print_command:
            print(redacted(launch_command(model, inf, port, is_embedding=True)))
            return 0
        return run_sglang(model, inf, port, is_embedding=True)
    if args.print_command:
        raise UsageError("--print-command applies to inference.backend=sglang only")
    from rollout_service.server.main import build_reward_app, serve

    serve(cfg.model, inf, port, app=build_reward_app(rm, path, inf))
    return 0


def _run(args: argparse.Namespace) -> int:
    from hexctl.cli import UsageError

    cfg, port = preflight(args)
    if args.reward_model:
        return _run_reward_model(args, cfg, port)
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
    from areal_hex.gc_freeze import defer_collection
    from rollout_service.server.main import serve

    defer_collection()  # until the app's start-up freezes what is loaded (server/app.py)
    try:
        serve(cfg.model, inf, port)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return 0
