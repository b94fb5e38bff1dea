"""Commands on one kept connection of a synchronous redis-py client, their replies read by
hand: the consumer's hot path (reading groups, acknowledging them).

redis-py reads every reply through a buffer of its own: an encoded group (~100 kB) is
received into that buffer, copied out of it, sliced again, and passes its response
callbacks, which cost the consumer more CPU than decoding the group. Here a bulk string
of `BIG` bytes or more is received straight into a buffer of its own (its only copy, out
of the kernel) and returned as a read-only memoryview of it, and everything else is
parsed off one small receive buffer. Commands are packed and sent by redis-py itself.

Replies come back raw (no response callbacks): bytes, int, float, bool, None, lists, and
a RESP3 map as a list of [key, value] pairs, which is the shape RESP2 gives XREADGROUP.
A connection that fails mid-way (lost, timed out, a reply it cannot parse) is dropped and
opened again by the next call, so no half-read reply is ever read by the next command.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Sequence
from typing import Any

import redis
from redis.commands.core import Script

BIG = 16_384  # bulk strings this long or longer are received into their own buffer
_CHUNK = 16_384  # receive size for everything else (headers, ids, small replies)


class ReplyReader:
    """RESP2/RESP3 replies off a socket (`recv` and `recv_into` are all it calls)."""

    def __init__(self, sock: Any, parse_error: Any) -> None:
        self.sock = sock
        self._parse_error = parse_error  # error line -> the redis-py exception it means
        self._buf = b""
        self._pos = 0

    def _more(self) -> None:
        chunk = self.sock.recv(_CHUNK)
        if not chunk:
            raise redis.ConnectionError("Connection closed by the buffer's server")
        self._buf = self._buf[self._pos :] + chunk
        self._pos = 0

    def _line(self) -> bytes:
        while (end := self._buf.find(b"\r\n", self._pos)) < 0:
            self._more()
        line = self._buf[self._pos : end]
        self._pos = end + 2
        return line

    def _bulk(self, n: int) -> bytes | memoryview:
        if n < BIG:
            while len(self._buf) - self._pos < n + 2:
                self._more()
            out = self._buf[self._pos : self._pos + n]
            self._pos += n + 2
            return out
        buf = bytearray(n + 2)
        view = memoryview(buf)
        have = min(len(self._buf) - self._pos, n + 2)
        view[:have] = memoryview(self._buf)[self._pos : self._pos + have]
        self._pos += have
        while have < n + 2:
            got = self.sock.recv_into(view[have:])
            if not got:
                raise redis.ConnectionError("Connection closed by the buffer's server")
            have += got
        if buf[n:] != b"\r\n":
            raise redis.exceptions.InvalidResponse("bulk string not followed by CRLF")
        return view[:n].toreadonly()

    def reply(self) -> Any:
        """One reply; an error reply is returned as its exception, not raised."""
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"$" or kind == b"=":  # '=': verbatim string, a 4-byte format first
            n = int(rest)
            if n < 0:
                return None
            out = self._bulk(n)
            return out[4:] if kind == b"=" else out
        if kind in (b"*", b"~", b"%", b">"):
            n = int(rest)
            if n < 0:
                return None
            if kind == b"%":
                return [[self.reply(), self.reply()] for _ in range(n)]
            return [self.reply() for _ in range(n)]
        if kind == b":" or kind == b"(":
            return int(rest)
        if kind == b"+":
            return rest
        if kind == b"-":
            return self._parse_error(rest.decode(errors="replace"))
        if kind == b"_":
            return None
        if kind == b",":
            return float(rest)
        if kind == b"#":
            return rest == b"t"
        raise redis.exceptions.InvalidResponse(f"unexpected reply type from the server: {line!r}")


class SyncLink:
    """Commands on one connection of `client`'s pool kept for this link, one call at a time
    (callers on other threads wait for it). Each call's commands go out in one write and
    their raw replies come back in order; the first error reply is raised once all are
    read."""

    def __init__(self, client: redis.Redis) -> None:
        self._pool = client.connection_pool
        self._conn: Any = None
        self._reader: ReplyReader | None = None
        self._lock = threading.Lock()

    def call(self, commands: Sequence[Sequence[Any]]) -> list[Any]:
        with self._lock:
            if self._conn is None:
                self._conn = self._pool.get_connection()
            conn = self._conn
            try:
                if self._reader is None or self._reader.sock is not conn._sock:
                    conn.connect()  # no-op when connected; again after a disconnect
                    self._reader = ReplyReader(conn._sock, conn._parser.parse_error)
                conn.send_packed_command(conn.pack_commands(commands), check_health=False)
                replies = [self._reader.reply() for _ in commands]
            except BaseException as exc:
                conn.disconnect()
                self._reader = None
                if isinstance(exc, socket.timeout):
                    raise redis.TimeoutError("Timeout reading from the buffer's server") from None
                if isinstance(exc, OSError):
                    raise redis.ConnectionError(f"Lost the buffer's server: {exc!r}") from None
                raise
        for x in replies:
            if isinstance(x, BaseException):
                raise x
        return replies

    def run_script(self, script: Script, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        """`script` by its SHA, sent whole once when the server does not know it (a
        restart lost it): EVAL also caches it for the next EVALSHA."""
        tail = (len(keys), *keys, *args)
        try:
            return self.call([(b"EVALSHA", script.sha, *tail)])[0]
        except redis.exceptions.NoScriptError:
            return self.call([(b"EVAL", script.script, *tail)])[0]

    def close(self) -> None:
        """Give the connection back to the pool (a later call takes one again)."""
        with self._lock:
            conn, self._conn, self._reader = self._conn, None, None
            if conn is not None:
                self._pool.release(conn)
