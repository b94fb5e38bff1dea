"""The consumer link's hand-written reply reader, fed real bytes over a socket pair."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest
import redis
from redis._parsers import _RESP3Parser

from areal_hex.buffer.sync_link import BIG, ReplyReader


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    a.settimeout(5)
    yield a, b
    a.close()
    b.close()


def _reader(sock: socket.socket) -> ReplyReader:
    return ReplyReader(sock, _RESP3Parser(1 << 16).parse_error)


def _send_slowly(sock: socket.socket, data: bytes, step: int) -> threading.Thread:
    """Write `data` in pieces of `step` bytes from another thread (a reply that arrives
    split at arbitrary places)."""

    def go() -> None:
        for lo in range(0, len(data), step):
            sock.sendall(data[lo : lo + step])

    t = threading.Thread(target=go)
    t.start()
    return t


def test_resp2_and_resp3_types(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    b.sendall(
        b"+OK\r\n:42\r\n$5\r\nhello\r\n$-1\r\n*-1\r\n_\r\n,1.5\r\n#t\r\n#f\r\n(12345678901234567890\r\n"
        b"=8\r\ntxt:abcd\r\n*2\r\n:1\r\n*1\r\n$0\r\n\r\n~1\r\n+x\r\n"
        b"%2\r\n$1\r\na\r\n:1\r\n$1\r\nb\r\n*0\r\n"
    )
    r = _reader(a)
    assert [r.reply() for _ in range(14)] == [
        b"OK",
        42,
        b"hello",
        None,
        None,
        None,
        1.5,
        True,
        False,
        12345678901234567890,
        b"abcd",
        [1, [b""]],
        [b"x"],
        [[b"a", 1], [b"b", []]],  # a map: [key, value] pairs, RESP2's shape
    ]


def test_an_error_reply_is_returned_as_its_redis_exception(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    a, b = pair
    b.sendall(b"-NOGROUP No such key 'k'\r\n-NOSCRIPT No matching script\r\n:1\r\n")
    r = _reader(a)
    first, second = r.reply(), r.reply()
    assert isinstance(first, redis.ResponseError) and "NOGROUP" in str(first)
    assert isinstance(second, redis.exceptions.NoScriptError)
    assert r.reply() == 1  # the stream stays in step


@pytest.mark.parametrize("step", [7, 1000, 1 << 20])
def test_a_large_bulk_string_split_anywhere_comes_back_whole_and_read_only(
    pair: tuple[socket.socket, socket.socket], step: int
) -> None:
    a, b = pair
    big = bytes(range(256)) * (3 * BIG // 256 + 1)
    small = b"s" * (BIG - 1)
    data = b"*3\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n:7\r\n" % (len(big), big, len(small), small)
    sender = _send_slowly(b, data + b"+after\r\n", step)
    r = _reader(a)
    reply = r.reply()
    assert r.reply() == b"after"
    sender.join()
    payload = reply[0]
    assert isinstance(payload, memoryview) and payload.readonly and payload == big
    assert isinstance(reply[1], bytes) and reply[1] == small and reply[2] == 7


def test_a_bulk_string_without_its_crlf_is_refused(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    a, b = pair
    b.sendall(b"$%d\r\n%sXY" % (BIG, b"x" * BIG))
    with pytest.raises(redis.exceptions.InvalidResponse, match="CRLF"):
        _reader(a).reply()


def test_an_unknown_reply_type_is_refused(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    b.sendall(b"?what\r\n")
    with pytest.raises(redis.exceptions.InvalidResponse, match="unexpected reply type"):
        _reader(a).reply()


def test_a_closed_connection_mid_reply_is_a_connection_error(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    a, b = pair
    b.sendall(b"$%d\r\n%s" % (2 * BIG, b"x" * BIG))
    b.shutdown(socket.SHUT_WR)
    with pytest.raises(redis.ConnectionError, match="closed"):
        _reader(a).reply()
