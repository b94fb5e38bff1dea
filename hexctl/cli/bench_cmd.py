"""`areal-hex bench NAME --json`: each benchmark measures its baseline in the same run and
prints one JSON object."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import sys
from collections.abc import Callable
from typing import Any

# name -> module providing `add_arguments(parser)` and `run(args) -> dict`
BENCHMARKS: dict[str, str] = {
    "buffer": "hexctl.bench.micro.buffer",
    "rollout": "hexctl.bench.micro.rollout",
    "controller": "hexctl.bench.micro.controller",
    "trainer": "hexctl.bench.micro.trainer",
    "e2e": "hexctl.bench.system.e2e",
    "chaos": "hexctl.bench.system.chaos",
    "algos": "hexctl.bench.system.algos",
    "plan": "hexctl.bench.micro.plan",
    "fidelity": "hexctl.bench.system.fidelity",
    "gpu": "hexctl.bench.system.gpu",
    "hetero": "hexctl.bench.system.hetero",
    "tasks": "hexctl.bench.system.tasks",
    "weight-sync": "hexctl.bench.micro.weight_sync",
    "trl": "hexctl.bench.system.trl",
    "host": "hexctl.bench.system.host",
    "modes": "hexctl.bench.system.modes_cluster",  # modes.py here, or on a box
    "switching": "hexctl.bench.system.switching",
}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="run a benchmark against a same-run baseline")
    names = p.add_subparsers(dest="bench", metavar="NAME")
    names.required = True
    for name, module in BENCHMARKS.items():
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name is None or not module.startswith(exc.name):
                raise
            continue  # that part is not installed in this tree
        bp = names.add_parser(name, help=(mod.__doc__ or "").strip().splitlines()[0])
        bp.add_argument("--json", action="store_true", help="print only the JSON object")
        mod.add_arguments(bp)
        bp.set_defaults(func=_runner(mod.run))


def _runner(fn: Callable[[argparse.Namespace], dict[str, Any]]) -> Callable[..., int]:
    def run(args: argparse.Namespace) -> int:
        from hexctl.bench import BenchFailed
        from hexctl.profile.controller import ProfileFailed

        out = sys.stdout
        # --json: the object alone on stdout; whatever the bench's own code and the
        # libraries it imports print there meanwhile (DeepSpeed's accelerator notice)
        # goes to stderr with the bench's progress
        quiet = contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext()
        try:
            with quiet:
                result = fn(args)
        except (BenchFailed, ProfileFailed) as exc:  # one JSON object, what failed on stderr
            print(json.dumps({"bench": args.bench, "error": str(exc)}, sort_keys=True), file=out)
            print(f"areal-hex bench {args.bench}: failed: {exc}", file=sys.stderr)
            return 1
        print(json.dumps(result, indent=None if args.json else 2, sort_keys=True), file=out)
        return 0

    return run
