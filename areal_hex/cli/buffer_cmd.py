"""`areal-hex buffer stats|serve`: inspect a run's trajectory buffer, or run the embedded
Valkey server in the foreground (the `redis` service of a local or compose layout)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import sys
import threading
from urllib.parse import unquote, urlsplit


def register(sub: argparse._SubParsersAction) -> None:
    from areal_hex.cli import add_config_args

    p = sub.add_parser("buffer", help="trajectory buffer: stats, or serve an embedded Valkey")
    cmds = p.add_subparsers(dest="buffer_command", metavar="SUBCOMMAND")
    cmds.required = True

    st = cmds.add_parser("stats", help="stream length, pending, unconsumed, counters, version")
    add_config_args(st)
    st.add_argument("--json", action="store_true", help="print one JSON object")
    st.set_defaults(func=_stats)

    sv = cmds.add_parser("serve", help="run an embedded Valkey server until SIGTERM/SIGINT")
    add_config_args(sv)
    sv.add_argument("--port", type=int, default=None, help="port (default redis.port or 6379)")
    sv.add_argument("--dir", default=None, help="data directory (default redis.data_dir)")
    sv.add_argument("--host", default=None, help="address to bind (default redis.bind)")
    sv.set_defaults(func=_serve)


def _stats(args: argparse.Namespace) -> int:
    import redis

    from areal_hex.buffer.consumer import read_stats
    from areal_hex.buffer.embedded import RedisEndpoint, redact
    from areal_hex.buffer.keys import BufferKeys
    from areal_hex.cli import UsageError, config_from_args, require_run

    cfg = config_from_args(args)
    require_run(cfg, "areal-hex buffer stats")
    ep = RedisEndpoint(cfg.redis.url, cfg.redis.username, cfg.redis.password)
    client = ep.sync_client(socket_connect_timeout=5, socket_timeout=10)
    try:
        keys = BufferKeys(cfg.run.run_id)
        stats = read_stats(client, keys)
        acked = int(client.get(keys.acked) or 0)
    except redis.AuthenticationError as exc:
        where = redact(cfg.redis.url)
        raise UsageError(f"redis at {where} refused the credentials: {exc}") from None
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        raise UsageError(f"cannot reach redis at {redact(cfg.redis.url)}: {exc}") from None
    finally:
        client.close()
    data = {"run_id": cfg.run.run_id, **dataclasses.asdict(stats), "acked": acked}
    if args.json:
        print(json.dumps(data, sort_keys=True))
    else:
        width = max(len(k) for k in data)
        for key, value in data.items():
            print(f"{key:<{width}}  {value}")
    return 0


def _serve(args: argparse.Namespace) -> int:
    from areal_hex.buffer.embedded import EmbeddedServerError, embedded_from_config, redact
    from areal_hex.cli import config_from_args

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
