"""One MULTI/EXEC on a redis-py asyncio connection, packed and read by hand.

A put is one transaction per group (the XADD of its payload, then the ledger script), so
the client's cost per transaction is paid per group. redis-py's pipeline does the same
work through its command stack, per-command packing and response callbacks, and retries a
transaction whose reply was lost; here a transaction is packed in one pass (a large
argument, the payload, is written as its own chunks, not copied into the header), its
replies are parsed straight off the connection's stream, and the caller decides about
retries (a put's token makes its retry safe). A `Link` keeps one connection for its
transactions instead of taking one from the pool each time (the pool's checks cost a
put about as much as reading its replies).
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis
import redis.asyncio
from redis.commands.core import AsyncScript

if sys.version_info >= (3, 11, 3):  # the same choice as redis-py's (which needs
    from asyncio import timeout as _deadline  # async-timeout before 3.11.3)
else:
    from async_timeout import timeout as _deadline


@dataclass(frozen=True)
class Parts:
    """A bulk-string argument given as buffers to send one after the other (an encoded
    group's header and arrays), so it is never joined into one bytes object here."""

    nbytes: int
    parts: Sequence[bytes | memoryview]


Arg = bytes | str | int | Parts
_MULTI = b"*1\r\n$5\r\nMULTI\r\n"
_EXEC = b"*1\r\n$4\r\nEXEC\r\n"
_BIG = 16_384  # bulk strings this long or longer travel as their own chunk
# From 3.12 a transport sends a list of buffers with sendmsg and, after a partial send,
# slices each buffer by the bytes sent: every part must then count its length in bytes.
_BYTE_VIEWS = sys.version_info >= (3, 12)


def _bytes(arg: bytes | str | int) -> bytes:
    if isinstance(arg, bytes):
        return arg
    if isinstance(arg, int):
        return b"%d" % arg
    return arg.encode()


def pack(commands: Sequence[Sequence[Arg]], multi: bool = True) -> list[bytes | memoryview]:
    """MULTI, the commands and EXEC in RESP (without `multi`, the commands alone), as
    chunks to write in order."""
    chunks: list[bytes | memoryview] = []
    buf = [_MULTI] if multi else []
    for command in commands:
        buf.append(b"*%d\r\n" % len(command))
        for arg in command:
            if isinstance(arg, Parts):
                buf.append(b"$%d\r\n" % arg.nbytes)
                parts = [memoryview(p).cast("B") for p in arg.parts] if _BYTE_VIEWS else arg.parts
                chunks += [b"".join(buf), *parts]
                buf = [b"\r\n"]
                continue
            x = _bytes(arg)
            buf.append(b"$%d\r\n" % len(x))
            if len(x) >= _BIG:
                chunks += [b"".join(buf), x]
                buf = [b"\r\n"]
            else:
                buf += [x, b"\r\n"]
    if multi:
        buf.append(_EXEC)
    chunks.append(b"".join(buf))
    return chunks


async def _reply(conn: redis.asyncio.Connection) -> object:
    """One RESP2/RESP3 reply from the connection's stream: bytes, int, None, a list, or
    the exception an error reply stands for (returned, not raised)."""
    line = await conn._reader.readline()
    if not line.endswith(b"\r\n"):
        raise redis.ConnectionError("Connection closed by the buffer's server")
    kind, rest = line[:1], line[1:-2]
    if kind == b"+":
        return rest
    if kind == b":":
        return int(rest)
    if kind == b"$":
        n = int(rest)
        return None if n < 0 else (await conn._reader.readexactly(n + 2))[:-2]
    if kind in (b"*", b"~"):
        n = int(rest)
        return None if n < 0 else [await _reply(conn) for _ in range(n)]
    if kind == b"-":
        return conn._parser.parse_error(rest.decode(errors="replace"))
    if kind == b"_":
        return None
    raise redis.exceptions.InvalidResponse(f"unexpected reply from the buffer's server: {line!r}")


async def _exchange(
    conn: redis.asyncio.Connection, commands: Sequence[Sequence[Arg]], multi: bool = True
) -> list:
    try:
        # One deadline (the connection's socket timeout) over the write and all the
        # replies: by default every read arms a timer of its own, which cost more client
        # CPU than the ledger script's whole reply.
        async with _deadline(conn.socket_timeout):
            if not conn.is_connected:
                await conn.connect()
            conn._writer.writelines(pack(commands, multi))
            await conn._writer.drain()
            # in a transaction: +OK for MULTI, +QUEUED (or a refusal) per command, EXEC's
            queued = [await _reply(conn) for _ in range(len(commands) + 1)] if multi else []
            replies = await _reply(conn) if multi else [await _reply(conn) for _ in commands]
    except BaseException as exc:
        # A reply left unread (a lost connection, a timeout, a cancelled call) must not
        # be read by the next user of this connection.
        await conn.disconnect()
        if isinstance(exc, asyncio.TimeoutError):
            raise redis.TimeoutError("Timeout reading from the buffer's server") from None
        if isinstance(exc, OSError | asyncio.IncompleteReadError):
            raise redis.ConnectionError(f"Lost the buffer's server: {exc!r}") from None
        raise
    if not isinstance(replies, list):  # EXECABORT (an error) or a null EXEC
        for x in queued:  # refused when queued: EXEC aborts
            if isinstance(x, BaseException):
                raise x
        if isinstance(replies, BaseException):
            raise replies
        raise redis.exceptions.ExecAbortError("EXEC aborted")
    for x in replies:
        if isinstance(x, BaseException):
            raise x
    return replies


class Link:
    """MULTI/EXEC transactions on one connection of `client`'s pool kept for this link,
    one at a time (callers on the same event loop queue for it). Each is sent in one
    write and returns its commands' raw replies (no response callbacks: bytes, ints,
    lists) or raises the first error. A connection lost mid-way is dropped and opened
    again by the next transaction."""

    def __init__(self, client: redis.asyncio.Redis) -> None:
        self._pool = client.connection_pool
        self._conn: redis.asyncio.Connection | None = None
        self._lock = asyncio.Lock()

    async def transaction(self, commands: Sequence[Sequence[Arg]]) -> list:
        async with self._lock:
            if self._conn is None:
                self._conn = await self._pool.get_connection()
            return await _exchange(self._conn, commands)

    async def call(self, commands: Sequence[Sequence[Arg]]) -> list:
        """`commands` sent in one write, not as a transaction: their raw replies, in
        order, or the first error once all are read."""
        async with self._lock:
            if self._conn is None:
                self._conn = await self._pool.get_connection()
            return await _exchange(self._conn, commands, multi=False)

    async def run_script(
        self, script: AsyncScript, keys: Sequence[Arg], args: Sequence[Arg]
    ) -> Any:
        """`script` by its SHA, sent whole once when the server does not know it (a
        restart lost it): EVAL also caches it for the next EVALSHA. Half the client
        CPU of calling the registered script through redis-py."""
        tail = (len(keys), *keys, *args)
        try:
            return (await self.call([(b"EVALSHA", script.sha, *tail)]))[0]
        except redis.exceptions.NoScriptError:
            return (await self.call([(b"EVAL", script.script, *tail)]))[0]

    async def aclose(self) -> None:
        """Give the connection back to the pool (which closes it with the client)."""
        async with self._lock:
            conn, self._conn = self._conn, None
            if conn is not None:
                await self._pool.release(conn)
