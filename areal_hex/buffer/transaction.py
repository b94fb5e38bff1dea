"""One MULTI/EXEC on a pooled redis-py asyncio connection, packed and read by hand.

A put is one transaction per group (the XADD of its payload, then the ledger script), so
the client's cost per transaction is paid per group. redis-py's pipeline does the same
work through its command stack, per-command packing and response callbacks, and retries a
transaction whose reply was lost; here a transaction is packed in one pass (a large
argument, the payload, is written as its own chunk, not copied into the header) and
the caller decides about retries (a put's token makes its retry safe).
"""

from __future__ import annotations

import asyncio
import math
import sys
from collections.abc import Sequence

import redis
import redis.asyncio

if sys.version_info >= (3, 11, 3):  # the same choice as redis-py's (which needs
    from asyncio import timeout as _deadline  # async-timeout before 3.11.3)
else:
    from async_timeout import timeout as _deadline

Arg = bytes | str | int
_MULTI = b"*1\r\n$5\r\nMULTI\r\n"
_EXEC = b"*1\r\n$4\r\nEXEC\r\n"
_BIG = 16_384  # bulk strings this long or longer travel as their own chunk


def _bytes(arg: Arg) -> bytes:
    if isinstance(arg, bytes):
        return arg
    if isinstance(arg, int):
        return b"%d" % arg
    return arg.encode()


def pack(commands: Sequence[Sequence[Arg]]) -> list[bytes]:
    """MULTI, the commands and EXEC in RESP, as chunks to write in order."""
    chunks: list[bytes] = []
    buf = [_MULTI]
    for command in commands:
        buf.append(b"*%d\r\n" % len(command))
        for arg in command:
            x = _bytes(arg)
            buf.append(b"$%d\r\n" % len(x))
            if len(x) >= _BIG:
                chunks += [b"".join(buf), x]
                buf = [b"\r\n"]
            else:
                buf += [x, b"\r\n"]
    buf.append(_EXEC)
    chunks.append(b"".join(buf))
    return chunks


async def transaction(client: redis.asyncio.Redis, commands: Sequence[Sequence[Arg]]) -> list:
    """Run `commands` in one MULTI/EXEC, sent in one write; returns their raw replies (no
    response callbacks: bytes, ints, lists) or raises the first error."""
    pool = client.connection_pool
    conn = await pool.get_connection()
    queued: list[redis.ResponseError] = []
    replies = None
    try:
        await conn.send_packed_command(pack(commands))
        # One deadline (the connection's socket timeout) over all the replies: by default
        # every read_response arms a timer of its own, which cost more client CPU than
        # the ledger script's whole reply.
        async with _deadline(conn.socket_timeout):
            for _ in range(len(commands) + 1):  # +OK for MULTI, then +QUEUED per command
                try:
                    await conn.read_response(timeout=math.inf)
                except redis.ResponseError as exc:  # refused when queued: EXEC aborts
                    queued.append(exc)
            try:
                replies = await conn.read_response(timeout=math.inf)
            except redis.exceptions.ExecAbortError:
                pass
    except BaseException as exc:
        # A reply left unread (a lost connection, a timeout, a cancelled call) must not
        # be read by the next user of this connection.
        await conn.disconnect()
        if isinstance(exc, asyncio.TimeoutError):
            raise redis.TimeoutError("Timeout reading from the buffer's server") from None
        raise
    finally:
        await pool.release(conn)
    if replies is None:
        raise queued[0] if queued else redis.exceptions.ExecAbortError("EXEC aborted")
    for x in replies:
        if isinstance(x, Exception):
            raise x
    return list(replies)
