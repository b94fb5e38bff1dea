"""Trajectory buffer throughput: producer put + consumer get_batch + ack vs raw redis-py.

Both paths move the same groups (G completions x T tokens with log-probs and versions)
through the same embedded Valkey in the same chunks (put a chunk, then consume it in
batches of B and acknowledge), alternating chunk by chunk so both see the same load.
The baselines are bare redis-py on pre-encoded bytes (XADD, XREADGROUP, XACK); ours adds
encoding, the put token's ledger (each group carries one, as the controller's do),
validated decoding, the staleness check, dead-letter triage and XACK + XDEL.
Repeated passes report medians.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid
from typing import TYPE_CHECKING, Any

# The CLI imports this module to build its parser: heavy imports wait for run().
if TYPE_CHECKING:
    from areal_hex.buffer.embedded import RedisEndpoint
    from areal_hex.record import GroupRecord


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--groups", type=int, default=2000, help="groups per measured pass")
    p.add_argument("--completions", type=int, default=8, help="G: completions per group")
    p.add_argument("--tokens", type=int, default=1024, help="T: tokens per completion")
    p.add_argument("--batch", type=int, default=8, help="B: groups per get_batch")
    p.add_argument("--chunk", type=int, default=64, help="groups put before consuming")
    p.add_argument("--repeats", type=int, default=3, help="alternating passes of each")


def make_groups(n: int, g: int, t: int, seed: int = 0) -> list[GroupRecord]:
    import numpy as np

    from areal_hex.record import Completion, GroupRecord

    rng = np.random.default_rng(seed)
    comps = [
        Completion(
            token_ids=rng.integers(0, 150_000, t, dtype=np.int32),
            logprobs=-rng.random(t, dtype=np.float32) * 5,  # (T,) behaviour log-probs
            versions=np.zeros(t, dtype=np.int32),
            finish_reason="length",
            reward=1.0,
        )
        for _ in range(g)
    ]
    prompt = rng.integers(0, 150_000, 128, dtype=np.int32)
    # Each group carries a put token, as the rollout controller's do (`put_token`): ours
    # then takes the controller's path (the token's ledger that makes a retried put append
    # once), not the cheaper one of a caller without a token.
    return [
        GroupRecord(f"bench-{i}", prompt, comps, metadata={"put_token": f"bench-{i}"})
        for i in range(n)
    ]


class RawPath:
    """Baseline: the same bytes through bare redis-py XADD, XREADGROUP(COUNT B), XACK.

    `payloads` are our codec's bytes for the very groups our path sends (one distinct buffer
    each, as a producer would have). With `loop`, XADD goes through redis.asyncio as our
    producer's does (the contract makes the producer async), so the ratio isolates our own
    work; without it, all calls are sync.
    """

    def __init__(
        self,
        ep: RedisEndpoint,
        payloads: list[bytes],
        batch: int,
        loop: asyncio.AbstractEventLoop | None,
    ) -> None:
        self.r, self.payloads, self.batch, self.loop = ep.sync_client(), payloads, batch, loop
        self.a = ep.async_client() if loop is not None else None
        self.stream = f"bench-raw-{uuid.uuid4().hex[:8]}"
        self.r.xgroup_create(self.stream, "trainer", id="0", mkstream=True)
        self.got = 0

    async def _xadd(self, part: list[bytes]) -> None:
        assert self.a is not None
        for payload in part:
            await self.a.xadd(self.stream, {b"d": payload})

    def chunk(self, lo: int, n: int) -> float:
        part = self.payloads[lo : lo + n]
        start = time.perf_counter()
        if self.loop is not None:
            self.loop.run_until_complete(self._xadd(part))
        else:
            for payload in part:
                self.r.xadd(self.stream, {b"d": payload})
        left = n
        while left > 0:
            resp = self.r.xreadgroup("trainer", "c", {self.stream: ">"}, count=self.batch)
            ids = [i for i, _ in resp[0][1]]
            self.r.xack(self.stream, "trainer", *ids)
            left -= len(ids)
        self.got += n
        return time.perf_counter() - start

    def close(self) -> None:
        self.r.delete(self.stream)
        self.r.close()
        if self.a is not None and self.loop is not None:
            self.loop.run_until_complete(self.a.aclose())


class OurPath:
    """Ours: async producer `put`, sync consumer `get_batch` + `ack`."""

    def __init__(self, ep: RedisEndpoint, batch: int, total: int) -> None:
        run_id = f"bench-{uuid.uuid4().hex[:8]}"
        from areal_hex.buffer.consumer import RedisTrajectoryConsumer
        from areal_hex.buffer.producer import RedisTrajectoryProducer
        from areal_hex.config.buffer import BufferConfig

        cfg = BufferConfig(groups_per_step=batch, max_pending=total + 1)
        self.batch = batch
        self.consumer = RedisTrajectoryConsumer(ep.sync_client(), run_id, cfg, keepalive=False)
        self.loop = asyncio.new_event_loop()
        self.producer = RedisTrajectoryProducer(ep.async_client(), run_id, cfg)
        self.seen: set[str] = set()

    async def _put(self, groups: list[GroupRecord]) -> None:
        for g in groups:
            await self.producer.put(g)

    def chunk(self, groups: list[GroupRecord]) -> float:
        start = time.perf_counter()
        self.loop.run_until_complete(self._put(groups))
        left = len(groups)
        while left > 0:
            got = self.consumer.get_batch(min(self.batch, left), timeout_s=10)
            self.seen.update(g.prompt_id for g in got.groups)
            self.consumer.ack(got.entry_ids)
            left -= len(got.groups)
        return time.perf_counter() - start

    def close(self) -> None:
        self.loop.run_until_complete(self.producer.aclose())
        self.loop.run_until_complete(self.producer.r.aclose())
        self.loop.close()
        self.consumer.close()


def measure(ep: RedisEndpoint, groups: list[GroupRecord], args: argparse.Namespace) -> dict:
    """One pass of each path over all groups, chunk by chunk, rotating which goes first so
    all see the same machine load. Returns seconds per path and losses."""
    ours = OurPath(ep, args.batch, len(groups))
    from areal_hex.buffer.codec import encode_group

    payloads = [encode_group(g) for g in groups]
    raw = RawPath(ep, payloads, args.batch, ours.loop)
    sync = RawPath(ep, payloads, args.batch, None)
    secs = {"ours": 0.0, "raw": 0.0, "sync": 0.0}
    cpu = dict.fromkeys(secs, 0.0)  # this process's CPU seconds (less noisy than wall)
    for k, lo in enumerate(range(0, len(groups), args.chunk)):
        part = groups[lo : lo + args.chunk]
        runs = [
            ("ours", lambda p=part: ours.chunk(p)),
            ("raw", lambda lo=lo, p=part: raw.chunk(lo, len(p))),
            ("sync", lambda lo=lo, p=part: sync.chunk(lo, len(p))),
        ]
        for name, fn in runs[k % 3 :] + runs[: k % 3]:
            c0 = time.process_time()
            secs[name] += fn()
            cpu[name] += time.process_time() - c0
    raw.close()
    sync.close()
    ours.close()
    lost = len(groups) - len(ours.seen & {g.prompt_id for g in groups})
    return {
        **secs,
        **{f"cpu_{k}": v for k, v in cpu.items()},
        "lost": lost,
        "raw_lost": 2 * len(groups) - raw.got - sync.got,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    from areal_hex.buffer.codec import encode_group
    from areal_hex.buffer.embedded import EmbeddedValkey, RedisEndpoint

    n = args.groups
    groups = make_groups(n, args.completions, args.tokens)
    secs_keys = ("ours", "raw", "sync")
    with EmbeddedValkey(appendonly=False) as server:
        ep = RedisEndpoint(server.url)
        measure(ep, groups[: min(n, 2 * args.chunk)], args)  # warm-up (connections, scripts)
        passes = [measure(ep, groups, args) for _ in range(args.repeats)]
    ours, raw, sync = (n / statistics.median(p[k] for p in passes) for k in secs_keys)
    payload = len(encode_group(groups[0]))
    cpu_ours, cpu_raw = (statistics.median(p[k] for p in passes) for k in ("cpu_ours", "cpu_raw"))
    return {
        "groups": n,
        "completions": args.completions,
        "tokens": args.tokens,
        "batch": args.batch,
        "payload_bytes": payload,
        "groups_per_s": round(ours, 1),
        "raw_xadd_per_s": round(raw, 1),
        "ratio": round(ours / raw, 3),
        "raw_sync_per_s": round(sync, 1),
        "ratio_vs_sync": round(ours / sync, 3),
        "mb_per_s": round(ours * payload / 1e6, 1),
        # Client CPU per group, ours vs the async-XADD baseline (robust to a busy machine).
        "cpu_us_per_group": round(cpu_ours / n * 1e6, 1),
        "raw_cpu_us_per_group": round(cpu_raw / n * 1e6, 1),
        "cpu_ratio": round(cpu_raw / cpu_ours, 3),
        "lost": max(p["lost"] for p in passes),
        "raw_lost": max(p["raw_lost"] for p in passes),
        "repeats": args.repeats,
    }
