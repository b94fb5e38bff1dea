"""The hand-read HTTP/1.1 transport of `/generate`: the request it writes, the response
framings it reads, and when it reuses, retries or drops a connection (loopback servers
that answer as scripted)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from areal_hex.http_lane import HttpLane, LaneError

pytestmark = pytest.mark.timeout(30)

Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]


def _ok(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n%s\r\n%s" % (len(body), extra, body)


async def _request(reader: asyncio.StreamReader) -> bytes:
    """One request as received (head and body), or b"" when the client closed."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return b""
    n = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    return head + await reader.readexactly(n)


class Server:
    """A loopback server running `script(reader, writer, connection number)` per
    connection; `requests` keeps what each connection received."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.connections = 0
        self.requests: list[tuple[int, bytes]] = []
        self.closed: list[int] = []

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        await self.script(reader, writer, self.connections)

    async def take(self, reader: asyncio.StreamReader, conn: int) -> bytes:
        req = await _request(reader)
        if req:
            self.requests.append((conn, req))
        else:
            self.closed.append(conn)
        return req


async def test_a_request_is_one_write_and_its_connection_is_kept() -> None:
    async def script(r: asyncio.StreamReader, w: asyncio.StreamWriter, conn: int) -> None:
        while await srv.take(r, conn):
            w.write(_ok(b'{"n": %d}' % len(srv.requests)))

    srv = Server(script)
    async with srv as url:
        lane = HttpLane(url + "/api/", {"Authorization": "Bearer k"}, keepalive_s=4.0)
        assert await lane.post("/generate", b'{"a": 1}', 5.0) == (200, "OK", b'{"n": 1}')
        assert await lane.post("/generate", b"[]", 5.0) == (200, "OK", b'{"n": 2}')
        lane.close()
    assert [c for c, _ in srv.requests] == [1, 1]  # one connection for both
    host = url.removeprefix("http://").encode()
    assert srv.requests[0][1] == (
        b"POST /api/generate HTTP/1.1\r\nHost: " + host + b"\r\n"
        b"Content-Type: application/json\r\nAuthorization: Bearer k\r\n"
        b'Content-Length: 8\r\n\r\n{"a": 1}'
    )


async def test_chunked_and_close_delimited_bodies() -> None:
    async def script(r: asyncio.StreamReader, w: asyncio.StreamWriter, conn: int) -> None:
        while await srv.take(r, conn):
            if len(srv.requests) != 2:
                w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
                w.write(b"3;x=y\r\nabc\r\n10\r\n" + b"d" * 16 + b"\r\n0\r\nT: 1\r\n\r\n")
            else:  # HTTP/1.0 style: the body ends with the connection
                w.write(b"HTTP/1.0 500 Internal Server Error\r\n\r\nno length")
                w.close()
                return

    srv = Server(script)
    async with srv as url:
        lane = HttpLane(url, {}, keepalive_s=4.0)
        assert await lane.post("/g", b"{}", 5.0) == (200, "OK", b"abc" + b"d" * 16)
        assert await lane.post("/g", b"{}", 5.0) == (500, "Internal Server Error", b"no length")
        assert await lane.post("/g", b"{}", 5.0) == (200, "OK", b"abc" + b"d" * 16)
    assert [c for c, _ in srv.requests] == [1, 1, 2]  # not reused after a close-delimited body


async def test_a_reused_connection_the_server_closed_is_replaced_and_the_request_resent() -> None:
    async def script(r: asyncio.StreamReader, w: asyncio.StreamWriter, conn: int) -> None:
        while await srv.take(r, conn):
            n = len(srv.requests)
            if n in (2, 4):  # closed as the request came: ended before any response
                w.close()
                return
            w.write(_ok(b"%d" % n))
            await w.drain()
            if n == 3:  # closed while idle: seen before the next request
                w.close()
                return

    srv = Server(script)
    async with srv as url:
        lane = HttpLane(url, {}, keepalive_s=4.0)
        assert (await lane.post("/g", b"{}", 5.0))[2] == b"1"
        assert (await lane.post("/g", b"{}", 5.0))[2] == b"3"  # request 2, sent again
        await asyncio.sleep(0.05)
        assert (await lane.post("/g", b"{}", 5.0))[2] == b"5"  # request 4, on a new one
    assert [c for c, _ in srv.requests] == [1, 1, 2, 3, 4]


async def test_a_connection_idle_past_keepalive_is_not_reused() -> None:
    async def script(r: asyncio.StreamReader, w: asyncio.StreamWriter, conn: int) -> None:
        while await srv.take(r, conn):
            w.write(_ok(b"x"))

    srv = Server(script)
    async with srv as url:
        lane = HttpLane(url, {}, keepalive_s=0.05)
        await lane.post("/g", b"{}", 5.0)
        await asyncio.sleep(0.1)
        await lane.post("/g", b"{}", 5.0)
        await asyncio.sleep(0.05)
    assert [c for c, _ in srv.requests] == [1, 2] and srv.closed == [1]


async def test_a_response_cut_short_is_an_error_and_never_resent() -> None:
    async def script(r: asyncio.StreamReader, w: asyncio.StreamWriter, conn: int) -> None:
        await srv.take(r, conn)
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial")
        w.close()

    srv = Server(script)
    async with srv as url:
        lane = HttpLane(url, {}, keepalive_s=4.0)
        with pytest.raises(LaneError, match="ended in its body"):
            await lane.post("/g", b"{}", 5.0)
    assert len(srv.requests) == 1


async def test_a_garbled_response_is_an_error() -> None:
    async def script(r: asyncio.StreamReader, w: asyncio.StreamWriter, conn: int) -> None:
        await srv.take(r, conn)
        w.write(b"SSH-2.0-OpenSSH\r\n\r\n")

    srv = Server(script)
    async with srv as url:
        with pytest.raises(LaneError, match="status line"):
            await HttpLane(url, {}, keepalive_s=4.0).post("/g", b"{}", 5.0)


async def test_a_cancelled_request_closes_its_connection() -> None:
    """The server sees the client go (and aborts the request), and the connection is not
    reused with the response half-read."""
    seen = asyncio.Event()

    async def script(r: asyncio.StreamReader, w: asyncio.StreamWriter, conn: int) -> None:
        await srv.take(r, conn)
        seen.set()
        if conn == 1:
            await srv.take(r, conn)  # b"": the client closed
            return
        w.write(_ok(b"second"))

    srv = Server(script)
    async with srv as url:
        lane = HttpLane(url, {}, keepalive_s=4.0)
        task = asyncio.create_task(lane.post("/g", b"{}", 5.0))
        await seen.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert (await lane.post("/g", b"{}", 5.0))[2] == b"second"
        await asyncio.sleep(0.05)
    assert srv.closed == [1] and [c for c, _ in srv.requests] == [1, 2]


async def test_no_server_is_a_connection_error() -> None:
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()
    with pytest.raises(OSError):
        await HttpLane(f"http://127.0.0.1:{port}", {}, keepalive_s=4.0).post("/g", b"{}", 5.0)
    with pytest.raises(ValueError, match="http://host"):
        HttpLane("https://example.org", {}, keepalive_s=4.0)


async def test_idle_connections_past_keepalive_are_closed_not_left_open() -> None:
    """Connections left idle by a burst are closed once past `keepalive_s`, also those
    no request takes (the most recent is taken first): else they would sit open after
    the server closed its side."""

    async def script(r: asyncio.StreamReader, w: asyncio.StreamWriter, conn: int) -> None:
        while await srv.take(r, conn):
            await asyncio.sleep(0.05)  # the burst's requests overlap
            w.write(_ok(b"x"))

    srv = Server(script)
    async with srv as url:
        lane = HttpLane(url, {}, keepalive_s=0.5)
        await asyncio.gather(*[lane.post("/g", b"{}", 5.0) for _ in range(3)])
        await asyncio.sleep(0.3)
        await lane.post("/g", b"{}", 5.0)  # takes the newest idle one
        await asyncio.sleep(0.35)  # the other two are now past keepalive, the newest not
        await lane.post("/g", b"{}", 5.0)
        await asyncio.sleep(0.05)
        assert srv.connections == 3 and len(srv.closed) == 2
        assert [c for c, _ in srv.requests][3:] == [srv.requests[3][0]] * 2
        lane.close()
