"""`areal-hex eval CONFIG --weights DIR|VERSION [--split test] [--k K] [--n N]`."""

from __future__ import annotations

import argparse
import json


def register(sub: argparse._SubParsersAction) -> None:
    from areal_hex.cli import add_config_args

    p = sub.add_parser("eval", help="score a weights version on a dataset split (pass@k)")
    add_config_args(p)
    p.add_argument(
        "--weights",
        required=True,
        help="weights directory, or a version N under inference.weights_dir",
    )
    p.add_argument("--split", default=None, help="dataset split (default: data.eval_split)")
    p.add_argument("--limit", type=int, default=None, help="at most this many problems")
    p.add_argument("--k", type=int, default=1, help="pass@k (k=1 without --n: greedy)")
    p.add_argument("--n", type=int, default=None, help="samples per problem (n >= k)")
    p.add_argument(
        "--server",
        default=None,
        help="URL of a running inference server to use (default: start one)",
    )
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from areal_hex.cli import UsageError, config_from_args
    from areal_hex.launch.evaluate import EvalOptions, evaluate

    cfg = config_from_args(args)
    if args.k < 1 or (args.n is not None and args.n < args.k):
        raise UsageError(f"--k must be >= 1 and --n >= --k (got k={args.k}, n={args.n})")
    opts = EvalOptions(
        weights=args.weights,
        split=args.split or cfg.data.eval_split,
        limit=args.limit,
        k=args.k,
        n=args.n,
        server=args.server,
    )
    try:
        result = evaluate(cfg, opts)
    except FileNotFoundError as exc:
        raise UsageError(str(exc)) from None
    print(json.dumps(result, indent=2))
    return 0
