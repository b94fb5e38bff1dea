"""The hand-packed MULTI/EXEC a put runs in: the RESP it writes, its errors, and a
connection left usable (or dropped) after them."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator

import pytest
import redis
import redis.asyncio

from areal_hex.buffer import EmbeddedValkey, RedisEndpoint
from areal_hex.buffer.transaction import Link, Parts, pack

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def endpoint() -> Iterator[RedisEndpoint]:
    with EmbeddedValkey(appendonly=False) as server:
        yield RedisEndpoint(server.url, server=server)


def test_pack_writes_resp_with_a_large_argument_as_its_own_chunk() -> None:
    big = b"x" * 20_000
    chunks = pack([(b"SET", "k", 7), (b"XADD", "s", b"*", b"d", big)])
    assert b"".join(chunks) == (
        b"*1\r\n$5\r\nMULTI\r\n"
        b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$1\r\n7\r\n"
        b"*5\r\n$4\r\nXADD\r\n$1\r\ns\r\n$1\r\n*\r\n$1\r\nd\r\n$20000\r\n" + big + b"\r\n"
        b"*1\r\n$4\r\nEXEC\r\n"
    )
    assert big in chunks  # sent as given, not copied into a header


def test_pack_writes_an_argument_given_in_parts_as_those_parts() -> None:
    import numpy as np

    arr = np.arange(4, dtype=np.int32)
    chunks = pack([(b"XADD", "s", b"*", b"d", Parts(3 + arr.nbytes, [b"abc", arr]))])
    assert b"".join(chunks) == (
        b"*1\r\n$5\r\nMULTI\r\n*5\r\n$4\r\nXADD\r\n$1\r\ns\r\n$1\r\n*\r\n$1\r\nd\r\n$19\r\n"
        b"abc" + arr.tobytes() + b"\r\n*1\r\n$4\r\nEXEC\r\n"
    )
    assert any(c is arr or (isinstance(c, memoryview) and c.obj is arr) for c in chunks)


def test_a_group_encoded_in_parts_is_the_group_encoded_whole() -> None:
    from areal_hex.buffer.codec import decode_group, encode_group, encode_group_parts
    from hexctl.bench.micro.buffer import make_groups

    group = make_groups(1, 3, 17)[0]
    nbytes, parts = encode_group_parts(group)
    whole = b"".join(parts)
    assert len(whole) == nbytes and whole == encode_group(group)
    assert decode_group(whole).prompt_id == group.prompt_id


async def test_a_link_keeps_one_connection_and_reopens_it_after_a_loss(
    endpoint: RedisEndpoint,
) -> None:
    r, key = endpoint.async_client(), f"k{uuid.uuid4().hex[:8]}"
    link = Link(r)
    try:
        await link.transaction([(b"CLIENT", b"SETNAME", b"link")])
        first = (await link.transaction([(b"CLIENT", b"ID")]))[0]
        assert (await link.transaction([(b"CLIENT", b"ID")]))[0] == first  # the same one
        await r.client_kill_filter(_id=first)  # the server drops it (a restart would)
        with pytest.raises(redis.ConnectionError):
            await link.transaction([(b"SET", key, 1)])
        assert await link.transaction([(b"SET", key, 2)]) == [b"OK"]  # opened again
        assert (await link.transaction([(b"CLIENT", b"ID")]))[0] != first
        assert await r.get(key) == b"2"
    finally:
        await link.aclose()
        await r.aclose()


async def test_replies_come_back_raw_and_in_order(endpoint: RedisEndpoint) -> None:
    r, key = endpoint.async_client(), f"k{uuid.uuid4().hex[:8]}"
    link = Link(r)
    try:
        assert await link.transaction([(b"SET", key, "é"), (b"INCRBY", key + "n", 3)]) == [
            b"OK",
            3,
        ]
        assert await r.get(key) == "é".encode()
    finally:
        await r.aclose()


async def test_a_command_refused_when_queued_aborts_the_whole_transaction(
    endpoint: RedisEndpoint,
) -> None:
    r, key = endpoint.async_client(), f"k{uuid.uuid4().hex[:8]}"
    link = Link(r)
    try:
        with pytest.raises(redis.ResponseError, match="wrong number of arguments"):
            await link.transaction([(b"SET", key, 1), (b"INCRBY", key)])
        assert await r.exists(key) == 0  # nothing ran
        assert await link.transaction([(b"SET", key, 2)]) == [b"OK"]  # connection still fine
    finally:
        await r.aclose()


async def test_a_command_failing_when_run_raises_after_the_others_ran(
    endpoint: RedisEndpoint,
) -> None:
    """MULTI/EXEC does not roll back: the caller orders its commands so that the one that
    can fail at run time (a put's XADD) comes first and the script after it checks."""
    r, key = endpoint.async_client(), f"k{uuid.uuid4().hex[:8]}"
    try:
        await r.set(key, "a string")
        with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
            await Link(r).transaction([(b"XADD", key, b"*", b"d", b"x"), (b"SET", key + "b", 1)])
        assert await r.get(key + "b") == b"1"
    finally:
        await r.aclose()


async def test_a_silent_server_is_a_client_timeout_and_the_connection_is_dropped() -> None:
    """A timeout reads as the client's own (`is_connection_error`: the caller retries), not
    as the gate's TimeoutError, and the half-read connection is not reused."""
    from areal_hex.buffer.errors import is_connection_error

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Answers the client's handshake (+OK per command), then takes a transaction and
        never answers it."""
        while b"MULTI" not in (data := await reader.read(1 << 16)) and data:
            writer.write(b"+OK\r\n" * sum(x.startswith(b"*") for x in data.split(b"\r\n")))
        await asyncio.sleep(5)

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    r = redis.asyncio.Redis(host="127.0.0.1", port=port, socket_timeout=0.2)
    link = Link(r)
    try:
        with pytest.raises(redis.TimeoutError, match="buffer's server") as err:
            await link.transaction([(b"SET", "k", 1)])
        assert is_connection_error(err.value)
        assert link._conn is not None and not link._conn.is_connected
    finally:
        await r.aclose()
        server.close()


async def test_a_script_runs_by_its_sha_and_is_sent_whole_when_the_server_lost_it(
    endpoint: RedisEndpoint,
) -> None:
    r, key = endpoint.async_client(), f"k{uuid.uuid4().hex[:8]}"
    link = Link(r)
    script = r.register_script("return {redis.call('INCRBY', KEYS[1], ARGV[1]), ARGV[2]}")
    try:
        await r.script_flush()  # as after a restart: the server knows no script
        assert await link.run_script(script, [key], [2, "é"]) == [2, "é".encode()]
        assert await r.script_exists(script.sha) == [True]  # EVAL cached it
        assert await link.run_script(script, [key], [3, ""]) == [5, b""]
        with pytest.raises(redis.ResponseError, match="not an integer"):
            await link.run_script(script, [key], ["x", ""])
        # pipelined commands: every reply read, so the connection stays in step
        with pytest.raises(redis.ResponseError, match="not an integer"):
            await link.call([(b"INCRBY", key, b"x"), (b"INCRBY", key, 1)])
        assert await link.call([(b"GET", key), (b"INCRBY", key, 0)]) == [b"6", 6]
    finally:
        await link.aclose()
        await r.aclose()
