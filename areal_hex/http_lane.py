"""POST requests to one server over kept-alive HTTP/1.1 connections, written and read by
hand: the transport of the client's POSTs, `/generate` (one per group) first.

aiohttp's client spends Python per request on its session, connector, timers, request
and response objects: a group's `generate_batch` (16 samples, a loopback server answering
a fixed body) took 0.46-0.53 ms of client CPU over it, 0.36-0.37 ms over this. Here a
request is one write (head and body) and the response is its status line, headers and a
body by Content-Length or chunked.

Connections: an idle one is reused unless it has been idle `keepalive_s` or longer (the
server may be closing it: uvicorn and SGLang's server close after 5 s); a request whose
connection ends before any byte of the response comes back is sent once more (the server
did not take it: a keep-alive connection it closed as it was reused, and it aborts a
request whose client went away).
A request that fails, times out or is cancelled closes its connection, so the server
sees the client go (our server and SGLang abort such requests) and no half-read response
is ever read by the next request.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Mapping
from urllib.parse import urlsplit

HEAD_LIMIT = 65_536  # bytes of status line and headers


class LaneError(ConnectionError):
    """The server could not be reached, or ended or garbled a response."""


class _Stale(LaneError):
    """A reused connection ended before the response began (the request was not read)."""


class HttpLane:
    """`post(path, body)` to `base_url` (plain http): (status, reason, body)."""

    def __init__(self, base_url: str, headers: Mapping[str, str], keepalive_s: float) -> None:
        url = urlsplit(base_url)
        if url.scheme != "http" or not url.hostname:
            raise ValueError(f"HttpLane: expected an http://host[:port] URL, got {base_url!r}")
        self.host, self.port = url.hostname, url.port or 80
        self.prefix = url.path.rstrip("/")
        self.keepalive_s = keepalive_s
        host = url.netloc.rsplit("@", 1)[-1]
        fixed = {"Host": host, "Content-Type": "application/json", **headers}
        self._head = "".join(f"{k}: {v}\r\n" for k, v in fixed.items()).encode("latin-1")
        self._idle: deque[tuple[asyncio.StreamReader, asyncio.StreamWriter, float]] = deque()

    async def post(self, path: str, body: bytes, connect_s: float) -> tuple[int, str, bytes]:
        """One request; raises LaneError (or OSError, TimeoutError) when it gets no
        response. The caller bounds the whole call; `connect_s` bounds opening a
        connection."""
        request = b"POST %s HTTP/1.1\r\n%sContent-Length: %d\r\n\r\n%s" % (
            (self.prefix + path).encode("latin-1"),
            self._head,
            len(body),
            body,
        )
        try:
            return await self._exchange(await self._connection(connect_s), request)
        except _Stale:  # once more
            return await self._exchange(await self._connection(connect_s), request)

    async def _connection(
        self, connect_s: float
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """An idle connection still within `keepalive_s`, else a new one."""
        conn = self._take()
        if conn is None:
            opening = asyncio.open_connection(self.host, self.port, limit=HEAD_LIMIT)
            conn = await asyncio.wait_for(opening, connect_s)
        return conn

    def _take(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        """The most recently used idle connection that is still open, after closing those
        idle `keepalive_s` or longer (the oldest come first: the list is in the order
        they came back)."""
        now, idle = time.monotonic(), self._idle
        while idle and (now - idle[0][2] >= self.keepalive_s or idle[0][0].at_eof()):
            idle.popleft()[1].close()
        while idle:
            reader, writer, _ = idle.pop()
            if not reader.at_eof():
                return reader, writer
            writer.close()
        return None

    async def _exchange(
        self, conn: tuple[asyncio.StreamReader, asyncio.StreamWriter], request: bytes
    ) -> tuple[int, str, bytes]:
        reader, writer = conn
        keep = False
        try:
            try:
                writer.write(request)
                await writer.drain()
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError as exc:
                if not exc.partial:
                    raise _Stale("the connection closed before the response") from None
                raise LaneError("the response ended in its headers") from None
            except ConnectionResetError:
                raise _Stale("the connection was reset before the response") from None
            except asyncio.LimitOverrunError:
                raise LaneError(f"response headers over {HEAD_LIMIT} bytes") from None
            status, reason, headers, keep = _parse_head(head)
            body, delimited = await _read_body(reader, status, headers)
            keep = keep and delimited
            return status, reason, body
        finally:
            if keep:
                self._idle.append((reader, writer, time.monotonic()))
            else:
                writer.close()

    def close(self) -> None:
        for _, writer, _ in self._idle:
            writer.close()
        self._idle.clear()


def _parse_head(head: bytes) -> tuple[int, str, dict[str, str], bool]:
    """Status, reason, headers (names in lower case), and whether the server keeps the
    connection open (HTTP/1.1 without `Connection: close`)."""
    lines = head[:-4].decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
        raise LaneError(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep:
            raise LaneError(f"malformed header line: {line[:80]!r}")
        headers[name.strip().lower()] = value.strip()
    keep = parts[0] == "HTTP/1.1" and headers.get("connection", "").lower() != "close"
    return int(parts[1]), parts[2] if len(parts) > 2 else "", headers, keep


async def _read_body(
    reader: asyncio.StreamReader, status: int, headers: dict[str, str]
) -> tuple[bytes, bool]:
    """The body, and whether its end was delimited (else the connection's end was)."""
    if status < 200 or status in (204, 304):
        return b"", True  # no body, whatever the headers say
    try:
        if "chunked" in headers.get("transfer-encoding", "").lower():
            return await _read_chunks(reader), True
        if "content-length" in headers:
            n = int(headers["content-length"])
            if n < 0:
                raise ValueError(n)
            return await reader.readexactly(n), True
    except asyncio.IncompleteReadError:
        raise LaneError("the response ended in its body") from None
    except ValueError:
        raise LaneError("malformed Content-Length or chunk size") from None
    return await reader.read(), False  # delimited by the end of the connection


async def _read_chunks(reader: asyncio.StreamReader) -> bytes:
    parts = []
    while True:
        size = int((await reader.readuntil(b"\r\n"))[:-2].split(b";", 1)[0], 16)
        if size == 0:
            while await reader.readuntil(b"\r\n") != b"\r\n":  # trailers
                pass
            return b"".join(parts)
        parts.append(await reader.readexactly(size))
        if await reader.readexactly(2) != b"\r\n":
            raise LaneError("a chunk not followed by CRLF")
