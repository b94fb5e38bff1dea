"""`areal-hex rollout CONFIG [overrides]`: run the rollout controller.

Reads prompts from `data`, sends `rollout.group_size` samples per prompt to the
`inference` servers, scores them and puts one group per prompt into the buffer at
`redis.url`, reloading the servers' weights when the trainer publishes a version. Stops
after the configured number of groups or on SIGTERM/SIGINT (in-flight groups get
`rollout.stop_grace_s`). Metrics: `<run_dir>/rollout.jsonl`.
"""

from __future__ import annotations

import argparse
import json


def register(sub: argparse._SubParsersAction) -> None:
    from hexctl.cli import add_config_args

    p = sub.add_parser("rollout", help="run the rollout controller (prompts -> groups -> buffer)")
    add_config_args(p)
    p.set_defaults(func=_run, preflight=preflight)


def preflight(args: argparse.Namespace):  # -> ExperimentConfig
    """What `areal-hex rollout` checks before it starts; `areal-hex deploy` runs it on
    every controller it renders."""
    from hexctl.cli import config_from_args, require_run

    cfg = config_from_args(args)
    require_run(cfg, "areal-hex rollout")
    return cfg


def _run(args: argparse.Namespace) -> int:
    import asyncio
    import logging

    from areal_hex.data import DataError
    from hexctl.cli import UsageError

    cfg = preflight(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    log = logging.getLogger("areal_hex.rollout")
    from areal_hex.gc_freeze import defer_collection
    from rollout_service.controller.wiring import SamplingExhausted, run_rollout

    defer_collection()  # until run_rollout's freeze_startup, once the controller is built
    try:
        final = asyncio.run(run_rollout(cfg))
    except DataError as exc:
        raise UsageError(str(exc)) from None
    except SamplingExhausted as exc:
        log.error("%s", exc)
        return 1
    except TimeoutError as exc:  # no server came up, or the gate waited too long
        log.error("%s", exc)
        return 1
    except Exception as exc:
        from areal_hex.buffer.errors import is_connection_error

        if not is_connection_error(exc):
            raise
        log.error("lost the buffer at redis.url (retried buffer.retry_s): %s", exc)
        return 1
    print(json.dumps(final))
    return 0
