"""`areal-hex eval CONFIG --weights DIR_OR_VERSION [--split test] [--k K] [--n N]`: score
a weights version on a dataset split (pass@1 greedy; pass@k sampled) and print the result
as a table, or one JSON object with --json."""

from __future__ import annotations

import argparse
import json


def register(sub: argparse._SubParsersAction) -> None:
    from hexctl.cli import add_config_args

    p = sub.add_parser("eval", help="score published weights on a dataset split (pass@1/@k)")
    add_config_args(p)
    p.add_argument(
        "--weights",
        default=None,
        help="HF weights directory, or a version of the run: latest, vN or N",
    )
    p.add_argument("--split", default=None, help="dataset split (default: data.eval_split)")
    p.add_argument("--k", type=int, default=1, help="samples per problem for pass@k (default 1)")
    p.add_argument("--n", type=int, default=None, help="evaluate at most N problems")
    p.add_argument(
        "--server-url", default=None, help="use this running server as is (no --weights)"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from areal_hex.data import DataError
    from hexctl.cli import UsageError, config_from_args
    from hexctl.report.evaluate import EvalError, EvalOptions, evaluate, format_table

    cfg = config_from_args(args)
    if args.n is not None and args.n < 1:
        raise UsageError(f"--n {args.n}: expected N >= 1")
    opts = EvalOptions(args.weights, args.split, args.k, args.n, args.server_url)
    try:
        result = evaluate(cfg, opts)
    except (EvalError, DataError) as exc:
        raise UsageError(str(exc)) from None
    print(json.dumps(result, sort_keys=False) if args.json else format_table(result))
    return 0
