"""`areal-hex buffer stats|dead|serve`: inspect a run's trajectory buffer and its dead
letters, or run the embedded Valkey server in the foreground (the `redis` service of a
local or compose layout)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any
from urllib.parse import unquote, urlsplit


def register(sub: argparse._SubParsersAction) -> None:
    from hexctl.cli import add_config_args

    p = sub.add_parser("buffer", help="trajectory buffer: stats, dead letters, embedded Valkey")
    cmds = p.add_subparsers(dest="buffer_command", metavar="SUBCOMMAND")
    cmds.required = True

    st = cmds.add_parser(
        "stats", help="stream length, pending, unconsumed, counters (filtered too), version"
    )
    add_config_args(st)
    st.add_argument("--json", action="store_true", help="print one JSON object")
    st.set_defaults(func=_stats)

    dl = cmds.add_parser("dead", help="newest dead-letter entries: source id, size, reason")
    add_config_args(dl)
    dl.add_argument("--limit", type=int, default=20, help="how many (newest first)")
    dl.add_argument("--json", action="store_true", help="print one JSON array")
    dl.set_defaults(func=_dead)

    sv = cmds.add_parser("serve", help="run an embedded Valkey server until SIGTERM/SIGINT")
    add_config_args(sv)
    sv.add_argument("--port", type=int, default=None, help="port (default redis.port or 6379)")
    sv.add_argument("--dir", default=None, help="data directory (default redis.data_dir)")
    sv.add_argument("--host", default=None, help="address to bind (default redis.bind)")
    sv.set_defaults(func=_serve)


def _query(args: argparse.Namespace, what: str, fn: Callable[[Any, Any], Any]) -> tuple[str, Any]:
    """Load the config, connect to its `redis.url` and run `fn(client, keys)`; returns
    (run_id, result). Missing settings and unreachable servers are usage errors."""
    import redis

    from areal_hex.buffer.embedded import RedisEndpoint, redact
    from areal_hex.buffer.keys import BufferKeys
    from hexctl.cli import UsageError, config_from_args, require_run

    cfg = config_from_args(args)
    require_run(cfg, f"areal-hex buffer {what}")
    ep = RedisEndpoint(cfg.redis.url, cfg.redis.username, cfg.redis.password)
    client = ep.sync_client(socket_connect_timeout=5, socket_timeout=10)
    try:
        return cfg.run.run_id, fn(client, BufferKeys(cfg.run.run_id))
    except redis.AuthenticationError as exc:
        where = redact(cfg.redis.url)
        raise UsageError(f"redis at {where} refused the credentials: {exc}") from None
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        raise UsageError(f"cannot reach redis at {redact(cfg.redis.url)}: {exc}") from None
    finally:
        client.close()


def _stats(args: argparse.Namespace) -> int:
    from areal_hex.buffer.consumer import read_stats

    def read(client: Any, keys: Any) -> dict[str, Any]:
        stats = dataclasses.asdict(read_stats(client, keys))
        # one line per reason: given_back_filtered is dynamic sampling's filtered count
        back = {f"given_back_{r}": n for r, n in stats.pop("given_back").items()}
        return {**stats, **back, "acked": int(client.get(keys.acked) or 0)}

    run_id, stats = _query(args, "stats", read)
    data = {"run_id": run_id, **stats}
    if args.json:
        print(json.dumps(data, sort_keys=True))
    else:
        width = max(len(k) for k in data)
        for key, value in data.items():
            print(f"{key:<{width}}  {value}")
    return 0


def _dead(args: argparse.Namespace) -> int:
    def read(client: Any, keys: Any) -> list[dict[str, Any]]:
        entries = client.xrevrange(keys.dead, count=args.limit)
        return [
            {
                "id": entry_id.decode(),
                "source_id": f.get(b"source_id", b"").decode(),
                "time": float(f.get(b"time", b"0")),
                "reason": f.get(b"reason", b"").decode(errors="replace"),
                "payload_bytes": len(f.get(b"payload", b"")),
            }
            for entry_id, f in entries
        ]

    _, rows = _query(args, "dead", read)
    if args.json:
        print(json.dumps(rows))
    else:
        for row in rows:
            print(f"{row['source_id']}  {row['payload_bytes']:>8} B  {row['reason']}")
    return 0


def _serve(args: argparse.Namespace) -> int:
    from areal_hex.buffer.embedded import EmbeddedServerError, embedded_from_config, redact
    from hexctl.cli import config_from_args

    cfg = config_from_args(args)
    # A run's config.yaml names the server it expects in redis.url: serve exactly there.
    url = urlsplit(cfg.redis.url) if cfg.redis.url else None
    port = args.port or cfg.redis.port or (url.port if url else None) or 6379
    server = embedded_from_config(cfg.redis, port=port, data_dir=args.dir)
    if url is not None and url.password and not server.password:
        server.password = unquote(url.password)
    if args.host is not None:
        server.host = args.host
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        server.start()
    except EmbeddedServerError as exc:
        print(f"areal-hex buffer serve: error: {exc}", file=sys.stderr)
        return 1
    print(f"valkey serving at {redact(server.url)} (data dir {server.dir})", flush=True)
    try:
        while not stop.wait(1.0):
            if not server.running():
                print("areal-hex buffer serve: error: valkey exited", file=sys.stderr)
                return 1
    finally:
        server.stop()
    return 0
