"""A controller SIGKILLed three times in a row, then run to the end: the dead ones'
admissions are reclaimed, the fourth is not deadlocked at the gate, the prompt order
continues where the durable position left it (no prompt repeated, none skipped but the
ones the dead were generating), and every admission is accounted for.

Real Valkey and the real producer, controller and reward pool in a child process; the
generation servers are the in-process fakes of tests/fakes.py (generation is not what is
under test, and the fakes make a group take milliseconds)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fakes import TOK

from areal_hex.buffer import EmbeddedValkey, RedisEndpoint, RedisWeightPublisher
from areal_hex.buffer.codec import decode_group
from areal_hex.buffer.keys import GIVE_BACK_REASONS, BufferKeys
from areal_hex.config import BufferConfig, DataConfig
from areal_hex.data import build_prompts, generate_arithmetic, iterate_prompts

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(240)

B, ETA, TOTAL, TTL_S = 4, 1, 24, 0.5

CHILD = """
import asyncio, json, sys
from fakes import TOK, FakeServer
from areal_hex.buffer import RedisTrajectoryProducer
from areal_hex.buffer.embedded import RedisEndpoint
from areal_hex.config import BufferConfig, DataConfig, RolloutConfig
from areal_hex.data import build_prompts, generate_arithmetic
from rollout_service.controller.rollout import RolloutController

url, run_id, buffer = sys.argv[1], sys.argv[2], BufferConfig(**json.loads(sys.argv[3]))

async def main() -> None:
    prompts = build_prompts(generate_arithmetic(16, "train"), TOK, DataConfig()).prompts
    ep = RedisEndpoint(url)
    producer = RedisTrajectoryProducer(ep.async_client(), run_id, buffer)
    cfg = RolloutConfig(group_size=2, max_new_tokens=8, probe_interval_s=0.05,
                        max_concurrent_groups=4, reward_workers=1)
    servers = [FakeServer("s0", delay_s=float(sys.argv[5]))]
    ctl = RolloutController(servers, producer, prompts,
                            lambda ids: TOK.decode(ids, skip_special_tokens=True), cfg,
                            max_groups=int(sys.argv[4]), seed=3, settle_s=2 * buffer.lease_ttl_s)
    final = await ctl.run()
    await producer.give_back_all()
    await producer.aclose()
    print(json.dumps({"start": ctl.start.admitted, "final": final}), flush=True)

asyncio.run(main())
"""


@pytest.fixture(scope="module")
def endpoint() -> Iterator[RedisEndpoint]:
    with EmbeddedValkey(appendonly=False) as server:
        yield RedisEndpoint(server.url, server=server)


def _buffer_cfg() -> dict[str, object]:
    return {
        "groups_per_step": B,
        "max_staleness": ETA,
        "lease_ttl_s": TTL_S,
        "gate_timeout_s": 60.0,
    }


def _controller(
    endpoint: RedisEndpoint, run_id: str, token_delay_s: float = 0.02
) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}"}
    args = [endpoint.url, run_id, json.dumps(_buffer_cfg()), str(TOTAL), str(token_delay_s)]
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, *args], stdout=subprocess.PIPE, text=True, env=env
    )


def _stream_seqs(r: object, keys: BufferKeys) -> list[tuple[int, str]]:
    entries = r.xrange(keys.traj)  # type: ignore[attr-defined]
    groups = [decode_group(fields[b"d"]) for _, fields in entries]
    return [(int(g.metadata["seq"]), g.prompt_id) for g in groups]


def test_three_controller_kills_then_the_run_completes(endpoint: RedisEndpoint) -> None:
    run_id = f"t{os.getpid()}{int(time.time())}"
    keys, r = BufferKeys(run_id), endpoint.sync_client()
    pub = RedisWeightPublisher(r, run_id, BufferConfig(**_buffer_cfg()))
    held_at_kill: list[int] = []
    dead: set[bytes] = set()  # lease holders of the controllers killed so far
    for k in range(3):  # each holds admissions when killed: 8 at the gate's bound of v0
        # a slow token (a group takes ~0.25 s) keeps the kill inside the controller's work
        # even when this process is descheduled for a while on a busy machine
        proc = _controller(endpoint, run_id, token_delay_s=0.05)
        deadline, own = time.monotonic() + 60, None
        while own is None and time.monotonic() < deadline:  # killed once it holds some
            held = {h: int(v) for h, v in r.hgetall(keys.leases).items() if h not in dead}
            own = next((h for h, v in held.items() if v > 0), None)
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        assert own is not None, f"controller {k} never held an admission"
        dead.add(own)
        held_at_kill.append(int(r.hget(keys.leases, own) or 0))
        if k == 1:  # the trainer takes a step in between: the gate opens by B
            pub.set_version(1, "/w/v1")
    assert all(h > 0 for h in held_at_kill), held_at_kill  # each died holding admissions

    pub.set_version(6, "/w/v6")  # the trainer moved on: room for every group at the gate
    # the dead controllers' heartbeats expire after the lease TTL; only then are their
    # admissions the next controller's to reclaim
    deadline = time.monotonic() + 20 * TTL_S
    while any(r.exists(keys.lease(h)) for h in r.hkeys(keys.leases)):
        assert time.monotonic() < deadline, "a dead controller's lease never expired"
        time.sleep(0.05)
    proc = _controller(endpoint, run_id)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    result = json.loads(out.strip().splitlines()[-1])
    assert result["start"] > 0  # it resumed at the durable position, not at prompt 0

    seqs = _stream_seqs(r, keys)
    given_back = {x: int(r.get(keys.given_back(x)) or 0) for x in GIVE_BACK_REASONS}
    admitted = int(r.get(keys.admitted))
    # every admission: put (in the stream: nothing was consumed) or given back
    assert admitted == len(seqs) + sum(given_back.values())
    # what the dead held came back (a count read at a kill can include a group whose put
    # was already on its way, so the sum bounds the reclaimed count from above)
    assert 0 < given_back["reclaimed"] <= sum(held_at_kill)
    assert given_back["abandoned"] == given_back["filtered"] == 0
    assert r.hlen(keys.leases) == 0
    # the kept groups reach the target across all four controllers
    assert len(seqs) + given_back["failed"] == TOTAL
    # the prompt order continued: each prompt number once, in the seeded epoch order; the
    # numbers never put are exactly the admissions given back
    numbers = [s for s, _ in seqs]
    assert len(set(numbers)) == len(numbers)
    assert len(set(range(admitted)) - set(numbers)) == sum(given_back.values())
    prompts = build_prompts(generate_arithmetic(16, "train"), TOK, DataConfig()).prompts
    order = iterate_prompts(prompts, 3)
    expected = [next(order)[1].id for _ in range(admitted)]
    assert all(pid == expected[s] for s, pid in seqs)
