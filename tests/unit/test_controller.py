"""The controller against in-process servers behind the `GenerationClient` Protocol and an
in-memory producer with the buffer's gate rule (the real ones: tests/integration)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from fakes import ANSWER, TOK, FakeServer, MemoryProducer

from areal_hex.config import DataConfig, RolloutConfig
from areal_hex.data import build_prompts, generate_arithmetic
from areal_hex.record import GroupRecord
from areal_hex.rewards import RewardPool
from rollout_service.controller.dispatch import Dispatcher
from rollout_service.controller.rollout import RolloutController


def _prompts(n: int = 8):
    return build_prompts(generate_arithmetic(n, "train"), TOK, DataConfig()).prompts


def _decode(ids: list[int]) -> str:
    return TOK.decode(ids, skip_special_tokens=True)


@pytest.fixture
async def rewards():
    pool = RewardPool(workers=1, timeout_s=10.0)
    await pool.start()
    yield pool
    await pool.aclose()


def _controller(
    servers, producer, rewards, tmp_path: Path, max_groups: int, buffer_retry_s=60.0, **cfg
):
    base = dict(group_size=3, max_new_tokens=16, metrics_interval_s=0.2, probe_interval_s=0.05)
    return RolloutController(
        servers,
        producer,
        _prompts(),
        _decode,
        RolloutConfig(**{**base, **cfg}),
        max_groups=max_groups,
        metrics_path=tmp_path / "rollout.jsonl",
        rewards=rewards,
        buffer_retry_s=buffer_retry_s,
    )


# ---------------------------------------------------------------- dispatch
async def test_dispatch_least_outstanding_work() -> None:
    servers = [FakeServer(f"s{i}") for i in range(3)]
    d = Dispatcher(servers)
    assert d.pick() is None  # nothing probed yet
    assert await d.probe_all() == 3
    s0, s1, s2 = d.servers
    with d.lease(s0, 100), d.lease(s1, 30):
        assert d.pick() is s2
        with d.lease(s2, 50):
            assert d.pick() is s1  # 30 < 50 < 100
            assert d.pick(exclude={1}) is s2
            assert d.pick(exclude={0, 1, 2}) is s1  # all excluded: still the least loaded
            d.mark_unhealthy(s1, "test")
            assert d.pick() is s2
            assert d.in_flight == 3
    assert (s0.outstanding_tokens, s1.outstanding_tokens, d.in_flight) == (0, 0, 0)
    assert d.pick() is s0 and d.busy_s > 0
    servers[1].down = True
    assert await d.probe_all() == 2 and not s1.healthy
    servers[1].down = False
    assert await d.probe_all() == 3 and s1.healthy


async def test_dispatch_spreads_a_burst_evenly() -> None:
    d = Dispatcher([FakeServer(f"s{i}") for i in range(4)])
    await d.probe_all()
    leases = []
    for _ in range(12):
        s = d.pick()
        assert s is not None
        cm = d.lease(s, 10)
        cm.__enter__()
        leases.append(cm)
    assert [s.in_flight for s in d.servers] == [3, 3, 3, 3]
    for cm in leases:
        cm.__exit__(None, None, None)


# ---------------------------------------------------------------- controller
@pytest.mark.timeout(60)
async def test_groups_shapes_rewards_and_metrics(rewards, tmp_path: Path) -> None:
    servers = [FakeServer("a"), FakeServer("b")]
    producer = MemoryProducer(groups_per_step=100)
    ctl = _controller(servers, producer, rewards, tmp_path, max_groups=6)
    final = await ctl.run()
    assert len(producer.groups) == 6 and producer.submitted == 6
    prompts = {p.id: p for p in _prompts()}
    for g in producer.groups:
        assert len(g.completions) == 3 and g.version == 0 and g.temperature == 1.0
        assert list(g.prompt_ids) == prompts[g.prompt_id].input_ids
        for c in g.completions:
            assert list(c.token_ids) == ANSWER and c.finish_reason == "stop"
            assert list(c.versions) == [0] * len(ANSWER)
            assert c.text == "#### 7"
            assert c.reward == (1.0 if prompts[g.prompt_id].answer == "7" else 0.0)
        assert g.finished_at >= g.created_at > 0
    assert sum(len(s.calls) for s in servers) == 18
    assert min(len(s.calls) for s in servers) >= 6  # spread over both servers
    lines = [json.loads(x) for x in (tmp_path / "rollout.jsonl").read_text().splitlines()]
    assert lines[-1] == {**final, "time": lines[-1]["time"]} and lines[-1]["final"] is True
    assert final["groups_produced_total"] == 6 and final["samples_total"] == 18
    assert final["finish_reasons"] == {"stop": 18} and final["groups_in_flight"] == 0
    assert final["requests_retried_total"] == 0 and final["gen_busy_s"] > 0


@pytest.mark.timeout(60)
async def test_weight_update_interrupts_and_resumes(rewards, tmp_path: Path) -> None:
    servers = [FakeServer("a", delay_s=0.05), FakeServer("b", delay_s=0.05)]
    producer = MemoryProducer(groups_per_step=100)
    ctl = _controller(servers, producer, rewards, tmp_path, max_groups=2)
    run = asyncio.create_task(ctl.run())
    await asyncio.sleep(0.18)  # a few tokens into every sample
    await producer.publish(1, "/weights/v1")
    final = await run
    assert [s.updates for s in servers] == [[("/weights/v1", 1)]] * 2
    assert final["version"] == 1 and final["weight_syncs_total"] == 1
    assert final["requests_aborted_total"] == 6
    for g in producer.groups:
        assert g.version == 0
        for c in g.completions:
            assert list(c.token_ids) == ANSWER  # resumed exactly where it stopped
            v = list(c.versions)
            k = v.index(1)
            assert 0 < k < len(ANSWER) and v == [0] * k + [1] * (len(v) - k)
            assert list(c.logprobs) == pytest.approx([-0.5] * k + [-1.5] * (len(v) - k))
    # Each resend asked for fewer new tokens and sent the partial output as input.
    resends = [c for s in servers for c in s.calls if c[1] < 16]
    lengths = {len(p.input_ids) for p in _prompts()}
    assert len(resends) == 6 and all(n + m - 16 in lengths for n, m in resends)


@pytest.mark.timeout(60)
async def test_dead_and_hung_servers_requests_finish_elsewhere(rewards, tmp_path: Path) -> None:
    dead, hung, good = FakeServer("dead"), FakeServer("hung"), FakeServer("good")
    producer = MemoryProducer(groups_per_step=100)
    ctl = _controller(
        [dead, hung, good], producer, rewards, tmp_path, max_groups=4, request_timeout_s=0.5
    )
    await ctl.dispatcher.probe_all()  # all three start healthy
    dead.down, hung.hang = True, True
    final = await ctl.run()
    assert len(producer.groups) == 4
    assert all(list(c.token_ids) == ANSWER for g in producer.groups for c in g.completions)
    assert final["requests_retried_total"] >= 2 and final["groups_failed_total"] == 0
    d, h, _ = ctl.dispatcher.servers
    assert not d.healthy and d.failures_total >= 1  # refused: down until a probe succeeds
    assert h.failures_total >= 1 and h.last_error == "timeout"  # /health ok: re-probed up


async def test_a_stalled_server_is_found_by_its_health_probe() -> None:
    """Hung, not dead: /health does not answer. A healthy server is probed too, with a
    timeout, and taken out as stalled; it comes back once it answers again."""
    a, b = FakeServer("a"), FakeServer("b")
    d = Dispatcher([a, b], probe_interval_s=0.05)
    assert await d.probe_all() == 2
    a.stalled = True
    await d.check_live(timeout_s=0.1)
    sa, sb = d.servers
    assert not sa.healthy and "stalled: no answer to /health in 0.1 s" in sa.last_error
    assert sb.healthy and d.pick() is sb
    a.stalled = False
    assert await d.probe_all() == 2


@pytest.mark.timeout(60)
async def test_groups_the_trainer_drops_are_owed_until_its_last_version(
    rewards, tmp_path: Path
) -> None:
    """At its target the controller waits for the trainer's last version, making one
    group for each the trainer dropped meanwhile (stale, or from lost weights)."""
    producer = MemoryProducer(groups_per_step=100)
    ctl = RolloutController(
        [FakeServer("a")],
        producer,
        _prompts(),
        _decode,
        RolloutConfig(group_size=2, max_new_tokens=16, probe_interval_s=0.05),
        max_groups=4,
        rewards=rewards,
        final_version=1,
    )
    run = asyncio.create_task(ctl.run())
    while len(producer.groups) < 4:
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.3)
    assert not run.done() and len(producer.groups) == 4  # at its target, waiting
    producer.groups_dropped_stale = 3
    while len(producer.groups) < 7:
        await asyncio.sleep(0.02)
    await producer.publish(1, str(tmp_path / "v1"))
    await asyncio.wait_for(run, timeout=20)
    assert len(producer.groups) == 7 and producer.admitted == 7
    # without a last version to wait for, the controller stops at its target
    done = _controller([FakeServer("b")], MemoryProducer(100), rewards, tmp_path, max_groups=2)
    await asyncio.wait_for(done.run(), timeout=20)


@pytest.mark.timeout(60)
async def test_recovered_server_gets_current_weights(rewards, tmp_path: Path) -> None:
    a, b = FakeServer("a"), FakeServer("b")
    producer = MemoryProducer(groups_per_step=100)
    ctl = _controller([a, b], producer, rewards, tmp_path, max_groups=3)
    await ctl.dispatcher.probe_all()
    b.down = True
    await ctl.update_weights(4, "/w/v4")  # b fails the pause: unhealthy, not updated
    assert a.updates == [("/w/v4", 4)] and b.updates == []
    b.down = False
    await ctl.dispatcher.probe_all()
    assert b.updates == [("/w/v4", 4)] and b.version == 4


@pytest.mark.timeout(60)
async def test_weights_gone_from_disk_fall_back_instead_of_a_recovery_loop(
    rewards, tmp_path: Path
) -> None:
    """v4 was published and loaded, then lost its config.json (a removal cut short, a
    storage fault): a server back from a crash loads v3, the newest complete version,
    at the first probe; a version no server could load is not what recovery reloads."""
    weights = tmp_path / "weights"
    for v in (0, 3, 4):
        (weights / f"v{v}").mkdir(parents=True)
        (weights / f"v{v}" / "config.json").write_text("{}")
    a = FakeServer("a")
    a.reads_disk = True
    producer = MemoryProducer(groups_per_step=100)
    ctl = _controller([a], producer, rewards, tmp_path, max_groups=3)
    ctl.weights.weights_dir = str(weights)
    await ctl.dispatcher.probe_all()
    await ctl.update_weights(4, str(weights / "v4"))
    (weights / "v4" / "config.json").unlink()
    a.version = 0  # restarted with its initial weights
    ctl.dispatcher.mark_unhealthy(ctl.dispatcher.servers[0], "crashed")
    assert await ctl.dispatcher.probe_all() == 1  # recovered at once, no loop
    assert a.updates[-1] == (str(weights / "v3"), 3) and a.version == 3
    await ctl.update_weights(5, str(weights / "v5"))  # never written: fails everywhere
    assert ctl.weights.applied == (3, str(weights / "v3"))
    a.version = 0
    ctl.dispatcher.mark_unhealthy(ctl.dispatcher.servers[0], "crashed")
    assert await ctl.dispatcher.probe_all() == 1 and a.version == 3


@pytest.mark.timeout(60)
async def test_exhausted_retries_fail_group_and_release(rewards, tmp_path: Path) -> None:
    s = FakeServer("only")
    producer = MemoryProducer(groups_per_step=100)
    ctl = _controller([s], producer, rewards, tmp_path, max_groups=2, max_retries=1)
    await ctl.dispatcher.probe_all()
    s.down = True

    async def revive() -> None:  # keep the server flapping: healthy probe, failing generate
        while True:
            await asyncio.sleep(0.02)
            ctl.dispatcher.mark_healthy(ctl.dispatcher.servers[0])

    flap = asyncio.create_task(revive())
    final = await ctl.run()
    flap.cancel()
    assert producer.groups == [] and final["groups_failed_total"] == 2
    assert producer.released == 2 and producer.submitted == 0


@pytest.mark.timeout(60)
async def test_failed_groups_are_owed_until_the_last_version(rewards, tmp_path: Path) -> None:
    """A group whose generation failed is made again in its place: the trainer still gets
    its steps' worth (failed groups not owed left it waiting for groups no one made)."""
    s = FakeServer("only")
    producer = MemoryProducer(groups_per_step=100)
    ctl = RolloutController(
        [s],
        producer,
        _prompts(),
        _decode,
        RolloutConfig(group_size=2, max_new_tokens=16, probe_interval_s=0.05, max_retries=1),
        max_groups=2,
        rewards=rewards,
        final_version=1,
    )
    await ctl.dispatcher.probe_all()
    s.down = True

    async def flap_until_two_failed() -> None:  # healthy probe, failing generate
        while producer.given_back["failed"] < 2:
            await asyncio.sleep(0.02)
            ctl.dispatcher.mark_healthy(ctl.dispatcher.servers[0])
        s.down = False

    flap = asyncio.create_task(flap_until_two_failed())
    run = asyncio.create_task(ctl.run())
    while len(producer.groups) < 2:
        await asyncio.sleep(0.02)
    await flap
    await producer.publish(1, str(tmp_path / "v1"))
    final = await asyncio.wait_for(run, timeout=20)
    failed = producer.given_back["failed"]
    assert len(producer.groups) == 2 and failed >= 2 and final["groups_failed_total"] == failed
    assert producer.admitted == 2 + failed  # one more admission for each failed group


@pytest.mark.timeout(60)
async def test_gate_and_stop_abandons_in_flight(rewards, tmp_path: Path) -> None:
    servers = [FakeServer("a", delay_s=0.02)]
    producer = MemoryProducer(groups_per_step=2, eta=1)  # cap (0 + 1 + 1) * 2 = 4
    ctl = _controller(servers, producer, rewards, tmp_path, max_groups=None, stop_grace_s=0.0)
    run = asyncio.create_task(ctl.run())
    for _ in range(200):
        await asyncio.sleep(0.05)
        if len(producer.groups) == 4:
            break
    await asyncio.sleep(0.3)
    assert len(producer.groups) == 4 and producer.submitted == 4  # blocked at the gate
    await producer.publish(1, "/w/v1")  # cap 6: two more groups admitted
    for _ in range(200):
        await asyncio.sleep(0.02)
        if producer.submitted == 6 and ctl.snapshot().groups_in_flight > 0:
            break
    servers[0].delay_s = 5.0  # the in-flight ones will not finish in the grace period
    await asyncio.sleep(0.1)
    ctl.request_stop()
    final = await asyncio.wait_for(run, 20)
    assert producer.max_over == 0
    assert final["groups_in_flight"] >= 1
    assert final["groups_abandoned_total"] == final["groups_in_flight"]
    assert producer.released == final["groups_in_flight"]
    assert producer.submitted == len(producer.groups) == final["groups_produced_total"]


@pytest.mark.timeout(60)
async def test_gate_timeout_ends_cleanly_and_raises(rewards, tmp_path: Path) -> None:
    class StuckGate(MemoryProducer):
        async def admit(self, n: int = 1) -> None:
            if self.submitted >= 2:
                await asyncio.sleep(0.2)
                raise TimeoutError("buffer gate: waited too long")
            await super().admit(n)

    producer = StuckGate(groups_per_step=100)
    ctl = _controller([FakeServer("a")], producer, rewards, tmp_path, max_groups=None)
    with pytest.raises(TimeoutError, match="waited too long"):
        await ctl.run()
    assert len(producer.groups) == 2 and producer.submitted == 2  # admitted ones finished
    last = json.loads((tmp_path / "rollout.jsonl").read_text().splitlines()[-1])
    assert last["final"] is True and last["groups_produced_total"] == 2


@pytest.mark.timeout(60)
async def test_buffer_outage_is_ridden_out(rewards, tmp_path: Path) -> None:
    import redis.exceptions

    class Flaky(MemoryProducer):
        fails = {"admit": 2, "put": 2}

        async def admit(self, n: int = 1) -> None:
            if self.fails["admit"]:
                self.fails["admit"] -= 1
                raise redis.exceptions.ConnectionError("Error 111 connecting")
            await super().admit(n)

        async def put(self, group: GroupRecord) -> str:
            if self.fails["put"]:
                self.fails["put"] -= 1
                raise ConnectionRefusedError("connection refused")
            return await super().put(group)

    producer = Flaky(groups_per_step=100)
    ctl = _controller([FakeServer("a")], producer, rewards, tmp_path, max_groups=3)
    final = await ctl.run()
    assert len(producer.groups) == 3 and final["groups_failed_total"] == 0
    assert producer.fails == {"admit": 0, "put": 0}

    class Down(MemoryProducer):
        async def admit(self, n: int = 1) -> None:
            raise redis.exceptions.ConnectionError("Error 111 connecting")

    ctl = _controller(
        [FakeServer("a")], Down(), rewards, tmp_path, max_groups=3, buffer_retry_s=0.5
    )
    with pytest.raises(redis.exceptions.ConnectionError):
        await ctl.run()


@pytest.mark.timeout(60)
async def test_versions_published_during_a_reload_are_coalesced(rewards, tmp_path: Path) -> None:
    server = FakeServer("a", delay_s=0.05)
    producer = MemoryProducer(groups_per_step=100)
    ctl = _controller([server], producer, rewards, tmp_path, max_groups=2)
    run = asyncio.create_task(ctl.run())
    await asyncio.sleep(0.2)
    for v in (1, 2, 3):  # 2 arrives while 1 loads (50 ms), then 3 replaces it
        await producer.publish(v, f"/w/v{v}")
        await asyncio.sleep(0.01)
    final = await run
    assert server.updates == [("/w/v1", 1), ("/w/v3", 3)]
    assert final["version"] == 3 and final["weight_syncs_total"] == 2


@pytest.mark.timeout(60)
async def test_a_bug_in_the_weight_update_fails_the_run(rewards, tmp_path: Path) -> None:
    class Buggy(FakeServer):
        async def update_weights_from_disk(
            self, model_path: str, weight_version: int, abort_all_requests: bool = True
        ) -> None:
            raise TypeError("bad argument")  # not a server error: must not be swallowed

    producer = MemoryProducer(groups_per_step=1000)
    ctl = _controller(
        [Buggy("a", delay_s=0.05)], producer, rewards, tmp_path, max_groups=10**6, stop_grace_s=1
    )
    run = asyncio.create_task(ctl.run())
    await asyncio.sleep(0.2)
    await producer.publish(1, "/w/v1")
    with pytest.raises(TypeError, match="bad argument"):
        await asyncio.wait_for(run, 30)


@pytest.mark.timeout(60)
async def test_metrics_endpoint_carries_the_rows(rewards, tmp_path: Path) -> None:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    from areal_hex.config import load_config
    from rollout_service.controller.wiring import serve_metrics

    producer = MemoryProducer(groups_per_step=100)
    ctl = _controller([FakeServer("a")], producer, rewards, tmp_path, max_groups=4)
    server = serve_metrics(load_config(None, ["rollout.metrics_port=0"]), ctl)
    assert server is not None
    try:
        final = await ctl.run()
        url = f"http://127.0.0.1:{server.port}/metrics"
        text = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read())
    finally:
        server.stop()
    got = {
        s.name: s.value for f in text_string_to_metric_families(text.decode()) for s in f.samples
    }
    assert got["areal_hex_rollout_groups_produced_total"] == final["groups_produced_total"] == 4
    assert got["areal_hex_rollout_samples_total"] == final["samples_total"]
    assert got["areal_hex_rollout_generation_busy_seconds_total"] == final["gen_busy_s"]
