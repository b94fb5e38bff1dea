"""Hybrid placement: the config's refusals, the lent servers' turns (paused while the
trainer steps, generating while it waits), their cores, and the price."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from areal_hex.config import ConfigError, load_config
from scheduler.profile import DeviceRates

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples/tiny_cpu.yaml"


def test_hybrid_needs_a_server_of_its_own_and_a_version_a_step() -> None:
    cfg = load_config(TINY, ["workflow.placement=hybrid", "inference.num_servers=2"])
    assert (cfg.workflow.placement, cfg.workflow.lent_servers) == ("hybrid", 1)
    sync = load_config(
        TINY, ["workflow.placement=hybrid", "inference.num_servers=2", "run.mode=sync"]
    )
    assert sync.buffer.max_staleness == 0
    with pytest.raises(ConfigError, match=r"expected inference.num_servers >= 2"):
        load_config(TINY, ["workflow.placement=hybrid"])
    with pytest.raises(ConfigError, match=r"expected inference.num_servers >= 4"):
        load_config(
            TINY,
            ["workflow.placement=hybrid", "inference.num_servers=3", "workflow.lent_servers=3"],
        )
    with pytest.raises(ConfigError, match=r"expected trainer.publish_every=1"):
        load_config(
            TINY,
            ["workflow.placement=hybrid", "inference.num_servers=2", "trainer.publish_every=2"],
        )


@pytest.mark.timeout(60)
async def test_the_lent_server_pauses_while_the_trainer_steps(tmp_path: Path) -> None:
    """Async, η = 1, B = 2, server b lent: once the trainer's next batch is put, b pauses
    in place (the trainer, this test, steps); after its publish b generates again unless
    the batch after is already made. No request is retried, no group fails."""
    import asyncio

    from fakes import TOK, FakeServer, MemoryProducer

    from areal_hex.config import DataConfig, RolloutConfig
    from areal_hex.data import build_prompts, generate_arithmetic
    from areal_hex.rewards import RewardPool
    from rollout_service.controller.lend import Lending
    from rollout_service.controller.rollout import RolloutController

    prompts = build_prompts(generate_arithmetic(8, "train"), TOK, DataConfig()).prompts
    own, lent = FakeServer("a", delay_s=0.002), FakeServer("b", delay_s=0.002)
    producer = MemoryProducer(groups_per_step=2, eta=1)
    pool = RewardPool(workers=1, timeout_s=10.0)
    await pool.start()
    ctl = RolloutController(
        [own, lent],
        producer,
        prompts,
        lambda ids: TOK.decode(ids, skip_special_tokens=True),
        RolloutConfig(group_size=3, max_new_tokens=16, probe_interval_s=0.05),
        max_groups=8,
        rewards=pool,
        final_version=3,
        metrics_path=tmp_path / "rollout.jsonl",
        phases=functools.partial(Lending, lent=1, groups_per_step=2),
    )
    continued = []  # a continue of the paused lent server: one switch (pause, continue)
    resume = lent.resume

    async def counted_resume() -> None:
        if not lent.running.is_set():
            continued.append(1)
        await resume()

    lent.resume = counted_resume  # type: ignore[method-assign]
    run = asyncio.create_task(ctl.run())
    stepping = []
    try:
        for v in range(1, 4):
            while len(producer.groups) < 2 * v:  # the trainer waits for its batch
                await asyncio.sleep(0.002)
            while lent.running.is_set():  # it has it: the lent server pauses
                await asyncio.sleep(0.002)
            stepping.append((lent.running.is_set(), ctl.dispatcher.servers[1].lent_away))
            await asyncio.sleep(0.02)  # the step: nothing new reaches the lent server
            await producer.publish(v, "")
        final = await asyncio.wait_for(run, 20)
    finally:
        await pool.aclose()
    assert stepping == [(False, True)] * 3
    assert lent.calls and own.calls  # the lent server generated while the trainer waited
    # a continue follows a publish unless the batch after is already made (load decides)
    assert final["context_switches_total"] == len(continued)
    assert final["context_switch_s_total"] >= 0
    assert final["requests_retried_total"] == 0 and final["groups_failed_total"] == 0
    assert len(producer.groups) == 8


async def test_a_paused_lent_server_misses_the_updates_and_loads_as_it_continues() -> None:
    """B = 1, server b lent. Paused for the trainer, b is left out of the weight update
    (no load on the trainer's devices) and loads the version as the lend continues it;
    generating when an update comes, b loads with the others and its continue loads
    nothing. Lent after two updates in a row, it pauses in place; still paused after an
    update (the trainer has its next batch), what it holds ends, to go on elsewhere."""
    from fakes import FakeServer, MemoryProducer

    from rollout_service.controller.dispatch import Dispatcher
    from rollout_service.controller.lend import Lending
    from rollout_service.controller.weight_sync import UpdateGate, WeightSync

    own, lent = FakeServer("a"), FakeServer("b")
    weights = WeightSync(Dispatcher([own, lent], 0.05), MemoryProducer(), UpdateGate())
    await weights.dispatcher.probe_all()
    lending = Lending(weights, set, lent=1, groups_per_step=1)
    pauses: list[str] = []
    pause = lent.pause

    async def counted_pause(mode: str = "abort") -> None:
        pauses.append(mode)
        await pause(mode)  # type: ignore[arg-type]

    lent.pause = counted_pause  # type: ignore[method-assign]
    await lending.after_put()  # the trainer has its batch: b pauses (not lent before: abort)
    assert lending.away and pauses == ["abort"]
    await weights.update(1, "/w/1")  # the trainer waits for the next: b loads, continues
    assert own.updates == [("/w/1", 1)] and lent.updates == [("/w/1", 1)]
    assert pauses == ["abort"] and not lending.away and lent.running.is_set()
    assert lending.row_fields()["lent_loads_total"] == 1
    await weights.update(2, "/w/2")  # b generating: loaded by the update, as the others
    assert lent.updates[-1] == ("/w/2", 2) and lending.loads_total == 1
    for _ in range(3):  # the next batch, and one group of the batch after
        await lending.after_put()
    assert lending.away
    await lending.after_put()  # the batch after is made too: b stays paused
    await weights.update(3, "/w/3")
    assert lending.away and lent.updates[-1] == ("/w/2", 2) and own.updates[-1][1] == 3
    # the lend's; update 2's; the lend's, in place (lent after updates 1 and 2); paused
    # through update 3, what it held ends
    assert pauses == ["abort", "abort", "in_place", "abort"]
    await weights.dispatcher.aclose()


async def test_a_group_dropped_as_stale_keeps_the_lent_server_generating() -> None:
    """B = 1: the trainer dropped one group put as stale, so the next group put is not
    its batch yet; the lent server generates on until the one after."""
    from fakes import FakeServer, MemoryProducer

    from rollout_service.controller.dispatch import Dispatcher
    from rollout_service.controller.lend import Lending
    from rollout_service.controller.weight_sync import UpdateGate, WeightSync

    producer = MemoryProducer(groups_per_step=1)
    producer.groups_dropped_stale = 3  # before this controller's first put: not its own
    weights = WeightSync(
        Dispatcher([FakeServer("a"), FakeServer("b")], 0.05), producer, UpdateGate()
    )
    await weights.dispatcher.probe_all()
    lending = Lending(weights, set, lent=1, groups_per_step=1)
    await lending.after_put()
    await weights.update(1, "/w/1")  # the trainer stepped and waits for its next batch
    assert not lending.away
    producer.groups_dropped_stale += 1  # it dropped the group put as stale
    await lending.after_put()
    assert not lending.away and lending.dropped == 1
    await lending.after_put()
    assert lending.away
    await weights.dispatcher.aclose()


async def test_requests_wait_in_the_controller_for_the_lent_server() -> None:
    """Asynchronous hybrid: a server is sent what it runs at once and one group more; a
    group beyond waits in the controller, and goes to the lent server as soon as it
    continues (not to the back of the server of its own's queue)."""
    import asyncio

    from fakes import FakeServer

    from rollout_service.controller.dispatch import Dispatcher
    from rollout_service.controller.lend import server_requests

    assert server_requests(64, 16, asynchronous=True) == 80
    assert server_requests(64, 16, asynchronous=False) is None
    d = Dispatcher([FakeServer("own"), FakeServer("lent")])
    await d.probe_all()
    own, lent = d.servers
    d.max_requests = server_requests(16, 16, asynchronous=True)  # one group runs, one waits
    lent.lent_away = True
    with d.lease(own, 100, 16), d.lease(own, 100, 16):
        assert d.pick() is None  # full, and the lent server paused for the trainer
        waiting = asyncio.ensure_future(d.acquire())
        await asyncio.sleep(0.01)
        assert not waiting.done()
        lent.lent_away = False  # the trainer waits for its batch: the lend continues it
        d.wake()
        assert await asyncio.wait_for(waiting, 1.0) is lent
        with d.lease(lent, 100, 16), d.lease(lent, 100, 16):
            waiting = asyncio.ensure_future(d.acquire())
            await asyncio.sleep(0.01)
            assert not waiting.done()
        assert await asyncio.wait_for(waiting, 1.0) is lent  # a call ended there
    await d.aclose()


def test_lending_refuses_a_layout_without_a_server_of_its_own() -> None:
    from fakes import FakeServer, MemoryProducer

    from rollout_service.controller.dispatch import Dispatcher
    from rollout_service.controller.lend import Lending
    from rollout_service.controller.weight_sync import UpdateGate, WeightSync

    weights = WeightSync(Dispatcher([FakeServer("a")], 0.05), MemoryProducer(), UpdateGate())
    with pytest.raises(ValueError, match="one of its own"):
        Lending(weights, set, lent=1, groups_per_step=2)


def test_lent_servers_run_on_the_trainers_cores(tmp_path: Path) -> None:
    from hexctl.job.cores import core_groups, usable_cores
    from hexctl.job.layout import build_layout
    from hexctl.launch.run import process_specs

    if len(usable_cores() or ()) < 2:
        pytest.skip("needs two usable cores")
    cfg = load_config(
        TINY,
        [f"run.output_dir={tmp_path}", "run.run_id=h", "workflow.placement=hybrid"]
        + ["inference.num_servers=2"],
    )
    specs = {s.name: s for s in process_specs(cfg, build_layout(cfg), tmp_path / "c.yaml")}
    inference, trainer = core_groups(True, "hybrid")
    assert specs["inference-0"].cpus == inference
    assert specs["inference-1"].cpus == trainer == specs["trainer"].cpus
    assert specs["inference-1"].env["OMP_WAIT_POLICY"] == "PASSIVE"


def test_a_hybrid_lends_only_when_the_trainer_would_wait() -> None:
    """B = 128, T = 0.5 s: a server of its own at 128/s makes half the batch while the
    trainer steps; the lent server loads and continues (the lend), then both make the
    rest. A server of its own that keeps up lends nothing and pays no lend: the
    disaggregated rate, less the trainer's heap trim where it gives its heap back."""
    from scheduler.hybrid import lent_asynchronous
    from scheduler.predict import LayoutRates

    own = LayoutRates(128.0, 128.0, 256.0, 0.01)
    got = lent_asynchronous(own, 128.0, 128, 0.01)
    # 64 made while stepping; 1.28 more in the lend; the other 62.72 at 256/s
    wait = 0.01 + 62.72 / 256
    assert got.pipeline_samples_per_s == pytest.approx(128 / (0.5 + wait))
    # the servers busy all the cycle: their mean rate is the pipeline's
    assert got.generation_samples_per_s == pytest.approx(got.pipeline_samples_per_s)
    assert got.training_samples_per_s == pytest.approx(256.0)
    # a lend longer than the wait: the servers of their own make the rest alone
    slow = lent_asynchronous(own, 128.0, 128, 1.0)
    assert slow.pipeline_samples_per_s == pytest.approx(128.0)
    fast = LayoutRates(256.0, 400.0, 256.0, 0.01)
    assert lent_asynchronous(fast, 400.0, 128, 0.05) == fast
    trimmed = lent_asynchronous(fast, 400.0, 128, 0.05, trim=0.01)
    assert trimmed.pipeline_samples_per_s == pytest.approx(128 / 0.51)
    assert trimmed.generation_samples_per_s == 400.0  # the lent servers stay paused


@pytest.mark.parametrize("lend", [0.0, 0.01, 0.05])
def test_the_lend_costs_only_where_generation_binds(lend: float) -> None:
    """Training binds (the servers of their own keep up): the hybrid is the disaggregated
    rate whatever the lend. Generation binds: lending raises the rate while the lend
    costs less than the wait it saves, and every second of lend lowers it."""
    from scheduler.hybrid import lent_asynchronous
    from scheduler.predict import LayoutRates

    trainer_bound = LayoutRates(256.0, 400.0, 256.0, 0.01)
    got = lent_asynchronous(trainer_bound, 200.0, 128, lend).pipeline_samples_per_s
    assert got == pytest.approx(256.0)
    gen_bound = LayoutRates(128.0, 128.0, 256.0, 0.01)
    lent = lent_asynchronous(gen_bound, 128.0, 128, lend).pipeline_samples_per_s
    more = lent_asynchronous(gen_bound, 128.0, 128, lend + 0.01).pipeline_samples_per_s
    assert lent > 128.0 and more < lent


def _device_rates(device: str, context: int, **extra: float) -> DeviceRates:
    """A kind's rates: 10 ms decode steps, 10k prefill and 1k training tokens/s."""
    return DeviceRates(
        device=device,
        decode_step_s={1: 0.01},
        decode_context=context,
        prefill_tokens_per_s=1e4,
        train_tokens_per_s=1e3,
        **extra,
    )


def test_a_trimming_trainer_pays_its_trim_in_the_lend() -> None:
    """The step at the profile's trimmed rate over its rate: compute · (rate / trimmed −
    1) s more; nothing where the trim was not timed, or for a kind not profiled."""
    from scheduler.lending import heap_trim_s
    from scheduler.profile import Profile

    rates = _device_rates("cpu", 40, train_trim_tokens_per_s=800.0)
    prof = Profile(model="m", params=1, kinds={"CPU": rates})
    assert heap_trim_s(prof, "CPU", 0.4) == pytest.approx(0.1)
    assert heap_trim_s(prof, "H800", 0.4) == 0.0 and heap_trim_s(None, "CPU", 0.4) == 0.0
    untimed = rates.model_copy(update={"train_trim_tokens_per_s": None})
    assert heap_trim_s(Profile(model="m", params=1, kinds={"CPU": untimed}), "CPU", 0.4) == 0.0


# ---------------------------------------------------------------- the switch, profiled
def test_a_profiled_switch_replaces_the_default() -> None:
    """`profile --local` times the switch per kind; the colocated price and a local
    run's prediction take it, and keep `constants.context_switch_s` where it is not."""
    from scheduler.cluster import load_cluster
    from scheduler.colocated import best_colocated, switch_s
    from scheduler.model_shape import load_model_shape
    from scheduler.planner import problem_for
    from scheduler.profile import Profile
    from scheduler.workload import load_workload

    w = load_workload(ROOT / "examples/workloads/math_grpo.yaml")
    cl = load_cluster(ROOT / "tests/data/one_node_2gpu.yaml")
    m = load_model_shape("qwen3-8b")
    p = problem_for(cl, m, w)
    rates = _device_rates("H800", 100, context_switch_s=7.0)
    prof = Profile(model="qwen3-8b", params=m.params, kinds={"H800": rates})
    default = best_colocated(p, w, 20.0)
    timed = best_colocated(p, w, 20.0, prof)
    assert default is not None and timed is not None
    assert (default.switch_s, timed.switch_s) == (w.constants.context_switch_s, 7.0)
    step = w.samples_per_step / default.samples_per_s - default.switch_s
    assert w.samples_per_step / timed.samples_per_s == pytest.approx(step + 7.0)
    assert switch_s(w, prof, "H20") == w.constants.context_switch_s  # not profiled


async def test_the_profile_times_a_switch_as_the_controller_makes_it() -> None:
    from fakes import FakeServer

    from hexctl.profile.generation import _Driver

    server = FakeServer("a")
    driver = _Driver(server, load_config(TINY), [[5, 6]])
    took = await driver.context_switch()
    assert took > 0 and server.memory_calls == ["release", "resume"]
    assert not server.released and server.running.is_set()


def test_the_planner_prices_the_hybrid_beside_the_others() -> None:
    """Training binds the 56-GPU plan: lending its GPUs adds nothing and costs nothing (a
    lent instance paused for the trainer is left out of the weight updates), so the
    hybrid's price is the disaggregated one and the tie goes to the split. The
    same plan with generation binding: the trainer's GPUs generating while it waits raise
    the rate, never past training's, where the wait outlasts a lent instance's first
    group (the longest of G long answers, `lending.first_group_s`); a shorter wait
    gains nothing from the lend."""
    from dataclasses import replace

    from test_modes import _plan_on

    from scheduler.hybrid import best_hybrid
    from scheduler.report import table
    from scheduler.workload import load_workload

    res = _plan_on("examples/clusters/h800_h20.yaml", 60.0)
    b = res.plan.baselines
    w = load_workload(ROOT / "examples/workloads/math_grpo.yaml")
    assert b.binding == "training" and b.hybrid_samples_per_s is not None
    assert b.hybrid_samples_per_s == pytest.approx(b.disaggregated_samples_per_s, rel=1e-3)
    assert res.plan.decisions.placement != "hybrid"
    assert "hybrid async" in table(res)
    sol = res.solution
    slow = replace(sol, rate=sol.train_rate / 3, gen_rate=sol.train_rate / 3)
    got = best_hybrid(res.problem, w, slow)
    assert got is not None and slow.rate < got < sol.train_rate
    half = replace(sol, rate=sol.train_rate / 2, gen_rate=sol.train_rate / 2)
    assert best_hybrid(res.problem, w, half) == pytest.approx(half.rate)


# ---------------------------------------------------------------- bench switching
def test_bench_switching_levels_and_requests() -> None:
    """A process's RSS early and late in the run, placed by the switches counted; the
    requests sent against those answered; the processes told apart by their argv."""
    from hexctl.bench.system.switching import _role, levels, requests

    rows = [(float(t), t) for t in range(0, 51)]  # one switch a second
    flat = [(t + 0.5, 100 * 2**20) for t in range(50)]
    held = levels(flat, rows, 5, 50, 16.0, 3.0)
    assert held["holds"] and held["growth_mib"] == 0 and held["rss_before_mib"] == 100
    leaking = [(t + 0.5, (100 + t) * 2**20) for t in range(50)]
    grew = levels(leaking, rows, 5, 50, 16.0, 3.0)
    assert not grew["holds"] and grew["growth_mib"] > 30
    assert grew["slope_kib_per_switch"] == 1024.0 and held["slope_kib_per_switch"] == 0.0
    assert "error" in levels(flat[:3], rows, 5, 50, 16.0, 3.0)
    final = {"requests_total": 10, "finish_reasons": {"stop": 9, "length": 1}}
    got = requests({**final, "groups_produced_total": 4}, 4)
    assert got["none_lost"] and got["requests_sent"] == got["samples_answered"] == 10
    assert not requests({**final, "groups_produced_total": 3}, 4)["none_lost"]
    assert not requests({**final, "groups_produced_total": 4, "requests_retried_total": 1}, 4)[
        "none_lost"
    ]
    rank = ["/py", "-u", "-m", "trainer_service.main", "c.yaml", "--local_rank=0"]
    runner = ["/py", "-m", "deepspeed.launcher.runner", "--module", "trainer_service.main"]
    assert (_role(rank), _role(runner)) == ("trainer", None)
    assert _role(["/py", "-m", "hexctl.cli", "serve", "c.yaml", "--index", "1"]) == "server 1"


def test_the_profile_waits_passively_where_the_sides_share_cores(monkeypatch) -> None:
    import os

    from hexctl.profile.devices import LocalDevices, passive_waits

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    shared = LocalDevices("CPU", "cpu", 2, {0, 1}, {0, 1}, 2, 2, 1.0)
    with passive_waits(shared):
        assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    assert "OMP_WAIT_POLICY" not in os.environ
    with passive_waits(LocalDevices("CPU", "cpu", 2, {0}, {1}, 1, 1, 1.0)):
        assert "OMP_WAIT_POLICY" not in os.environ
