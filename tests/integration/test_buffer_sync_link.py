"""The consumer's link to Valkey: one kept connection, raw replies read by hand, scripts
by SHA, and a connection dropped (then opened again) after a loss or a timeout."""

from __future__ import annotations

import socket
import threading
import uuid
from collections.abc import Iterator

import pytest
import redis

from areal_hex.buffer import EmbeddedValkey, RedisEndpoint
from areal_hex.buffer.sync_link import BIG, SyncLink

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def endpoint_url() -> Iterator[str]:
    with EmbeddedValkey(appendonly=False) as server:
        yield server.url


@pytest.fixture
def client(endpoint_url: str) -> Iterator[redis.Redis]:
    r = RedisEndpoint(endpoint_url).sync_client()
    yield r
    r.close()


def test_stream_entries_come_back_raw_with_large_payloads_as_read_only_views(
    client: redis.Redis,
) -> None:
    key, big = f"s{uuid.uuid4().hex[:8]}", uuid.uuid4().bytes * (BIG // 4)
    entry = client.xadd(key, {b"d": big, b"n": b"1"})
    link = SyncLink(client)
    try:
        version, read = link.call([(b"GET", key + "v"), (b"XRANGE", key, b"-", b"+")])
        assert version is None
        ((entry_id, fields),) = read
        assert entry_id == entry and fields[0] == b"d" and fields[2:] == [b"n", b"1"]
        assert isinstance(fields[1], memoryview) and fields[1].readonly and fields[1] == big
    finally:
        link.close()


def test_one_connection_kept_and_opened_again_after_a_loss(client: redis.Redis) -> None:
    key = f"k{uuid.uuid4().hex[:8]}"
    link = SyncLink(client)
    try:
        first = link.call([(b"CLIENT", b"ID")])[0]
        assert link.call([(b"CLIENT", b"ID")])[0] == first
        client.client_kill_filter(_id=first)
        with pytest.raises(redis.ConnectionError):
            link.call([(b"SET", key, 1)])
        assert link.call([(b"SET", key, 2), (b"GET", key)]) == [b"OK", b"2"]
        assert link.call([(b"CLIENT", b"ID")])[0] != first
    finally:
        link.close()
    assert client.get(key) == b"2"


def test_a_link_reconnects_after_its_pool_disconnected_it(endpoint_url: str) -> None:
    """The pool drops every connection, the link's included (the client closed): the
    next call connects again instead of reading a dead socket."""
    r = redis.Redis.from_url(endpoint_url)
    link = SyncLink(r)
    try:
        first = link.call([(b"CLIENT", b"ID")])[0]
        r.connection_pool.disconnect()
        assert link.call([(b"CLIENT", b"ID")])[0] != first
    finally:
        link.close()
        r.close()


def test_an_error_reply_is_raised_once_every_reply_is_read(client: redis.Redis) -> None:
    key = f"k{uuid.uuid4().hex[:8]}"
    link = SyncLink(client)
    try:
        with pytest.raises(redis.ResponseError, match="NOGROUP"):
            link.call(
                [(b"XREADGROUP", b"GROUP", b"g", b"c", b"STREAMS", key, b">"), (b"SET", key, 1)]
            )
        assert client.get(key) == b"1"  # the command after the failing one ran
        assert link.call([(b"INCR", key)]) == [2]  # and the connection is in step
    finally:
        link.close()


def test_a_script_the_server_lost_is_sent_whole_once(client: redis.Redis) -> None:
    key = f"k{uuid.uuid4().hex[:8]}"
    script = client.register_script("return redis.call('INCRBY', KEYS[1], ARGV[1])")
    link = SyncLink(client)
    try:
        client.script_flush()
        assert link.run_script(script, [key], [5]) == 5  # EVALSHA refused: EVAL
        assert client.script_exists(script.sha) == [True]
        assert link.run_script(script, [key], [1]) == 6
    finally:
        link.close()


def test_a_silent_server_is_a_client_timeout_and_the_connection_is_dropped() -> None:
    from areal_hex.buffer.errors import is_connection_error

    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve() -> None:
        """Answer the client's handshake (HELLO 3, then +OK per command), then go silent."""
        conn, _ = listener.accept()
        with conn:
            while b"SILENT" not in (data := conn.recv(1 << 16)) and data:
                if b"HELLO" in data:
                    conn.sendall(b"%1\r\n$5\r\nproto\r\n:3\r\n")
                    continue
                conn.sendall(b"+OK\r\n" * sum(x.startswith(b"*") for x in data.split(b"\r\n")))
            stop.wait(5)

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    r = redis.Redis(host="127.0.0.1", port=listener.getsockname()[1], socket_timeout=0.2)
    link = SyncLink(r)
    try:
        with pytest.raises(redis.TimeoutError, match="buffer's server") as err:
            link.call([(b"ECHO", b"SILENT")])
        assert is_connection_error(err.value)
        assert link._conn is not None and link._conn._sock is None
    finally:
        stop.set()
        r.close()
        listener.close()
        server.join()
