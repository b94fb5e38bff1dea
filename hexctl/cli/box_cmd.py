"""`areal-hex box up|down|exec|check BOX.yaml`: a heterogeneous cluster emulated on this
machine (network namespaces, shaped links, CPU quotas); see docs/fidelity.md.
`areal-hex box random --seed N --out FILE` writes a feasible box drawn from a seed."""

from __future__ import annotations

import argparse
import json
import sys


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("box", help="bring an emulated cluster (a box) up or down")
    acts = p.add_subparsers(dest="action", metavar="ACTION")
    acts.required = True
    a = acts.add_parser("up", help="build the box (removing any leftover of it first)")
    a.add_argument("box", help="box YAML (see examples/box/)")
    a.set_defaults(func=_up)
    a = acts.add_parser("down", help="remove everything of the box")
    a.add_argument("box", help="box YAML, or the box's name")
    a.set_defaults(func=_down)
    a = acts.add_parser("exec", help="run a command inside a node (namespace and cgroup)")
    a.add_argument("box", help="box YAML, or the box's name")
    a.add_argument("node", help="node name, e.g. fast-0")
    a.add_argument("argv", nargs=argparse.REMAINDER, help="the command (after --)")
    a.set_defaults(func=_exec)
    a = acts.add_parser("check", help="time a transfer between two nodes")
    a.add_argument("box", help="box YAML, or the box's name")
    a.add_argument("src")
    a.add_argument("dst")
    a.add_argument("--mbytes", type=int, default=10, help="MiB to send (default 10)")
    a.set_defaults(func=_check)
    a = acts.add_parser("random", help="write a feasible random box (deterministic per seed)")
    a.add_argument("--seed", type=int, required=True, help="the box's seed")
    a.add_argument("--out", required=True, help="box YAML to write")
    a.add_argument(
        "--cores", type=int, default=2, help="the machine's cores the quotas fit (default 2)"
    )
    a.set_defaults(func=_random)


def _box_name(text: str) -> str:
    import re

    from hexctl.box.spec import NAME_PATTERN, load_box

    if text.endswith((".yaml", ".yml")):
        return load_box(text).name
    if not re.match(NAME_PATTERN, text):
        from areal_hex.errors import UsageError

        raise UsageError(
            f"{text!r} is neither a box YAML (*.yaml) nor a box name (1-6 of [a-z0-9])"
        )
    return text


def _up(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from hexctl.box import emulate as box
    from hexctl.box.spec import load_box

    spec = load_box(args.box)
    try:
        state = box.up(spec)
    except box.BoxError as exc:
        # a command of the build failed; `up` has removed what it made
        print(f"areal-hex box up: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(asdict(state), indent=2))
    return 0


def _down(args: argparse.Namespace) -> int:
    from hexctl.box import emulate as box

    name = _box_name(args.box)
    box.check_host()
    removed = box.down(name)
    left = box.leftovers(name)
    print(json.dumps({"box": name, "removed": removed, "left": left}))
    return 1 if left else 0


def _exec(args: argparse.Namespace) -> int:
    import os

    from areal_hex.errors import UsageError
    from hexctl.box import emulate as box

    argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if not argv:
        raise UsageError("no command given: areal-hex box exec BOX NODE -- COMMAND ...")
    node = box.load_state(_box_name(args.box)).node(args.node)
    full = box.node_argv(node, argv)
    os.execvp(full[0], full)


def _check(args: argparse.Namespace) -> int:
    from hexctl.box import emulate as box

    state = box.load_state(_box_name(args.box))
    seconds = box.transfer_s(state.node(args.src), state.node(args.dst), args.mbytes)
    mbit = args.mbytes * 8 * (1 << 20) / 1e6 / seconds
    print(
        json.dumps(
            {
                "src": args.src,
                "dst": args.dst,
                "mbytes": args.mbytes,
                "seconds": round(seconds, 3),
                "mbit_per_s": round(mbit, 1),
            }
        )
    )
    return 0


def _random(args: argparse.Namespace) -> int:
    from pathlib import Path

    from areal_hex.errors import UsageError
    from hexctl.box.random_box import write_random_box

    if args.cores < 1:
        raise UsageError(f"--cores {args.cores}: expected a whole number of cores, 1 or more")
    print(json.dumps(write_random_box(args.seed, Path(args.out), args.cores)))
    return 0
