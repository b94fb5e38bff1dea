"""The profile's decode step from two answer lengths: a pair in which the machine stalled
the short wave (no longer than the long one) is measured again instead of entering the
median as a step of ~0 s, which once made a kind's batch-1 decode 1 µs and its planned
generation 1,381 samples/s."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from areal_hex.config import ExperimentConfig
from hexctl.profile.generation import _Driver


class _Timed(_Driver):
    """A driver whose waves take scripted times (seconds per (long, short) pair)."""

    def __init__(self, times: list[tuple[float, float]], min_decode_s: float = 0.0) -> None:
        super().__init__(None, ExperimentConfig(), [[1, 2, 3]], min_decode_s)
        self.times: Iterator[float] = iter(t for pair in times for t in pair)
        self.waves = 0

    async def wave(self, work: list[list[int]], sp: Any) -> tuple[float, list]:
        self.waves += 1
        return next(self.times), []


def test_a_stalled_short_wave_is_measured_again() -> None:
    long_n = max(8, ExperimentConfig().rollout.max_new_tokens)
    short_n = max(2, long_n // 4)
    step = 0.01
    good = (0.1 + long_n * step, 0.1 + short_n * step)  # prefill 0.1 s cancels
    stalled = (0.1 + long_n * step, 0.1 + long_n * step + 0.5)
    d = _Timed([stalled, good, stalled, good, good])
    assert asyncio.run(d.decode_step(4)) == pytest.approx(step)


def test_without_a_usable_pair_the_long_wave_per_token_stands_in() -> None:
    long_n = max(8, ExperimentConfig().rollout.max_new_tokens)
    stalled = (long_n * 0.02, long_n * 0.02)
    d = _Timed([stalled] * 6)
    assert asyncio.run(d.decode_step(4)) == pytest.approx(0.02)


def test_a_throttled_node_times_pairs_until_their_steps_add_up() -> None:
    """A box node's 10 ms quota period lands a pair's few steps a period early or late:
    with `min_decode_s` the pairs go on until their steps add up to it, and the step is
    their total over their steps, where the periods cancel (their median would not)."""
    long_n = max(8, ExperimentConfig().rollout.max_new_tokens)
    short_n = max(2, long_n // 4)
    step, period = 0.003, 0.010
    # two pairs a period late for each one a period early: the median is a period late
    pairs = [(0.1 + long_n * step + e, 0.1 + short_n * step) for e in (period, period, -period)]
    d = _Timed(pairs * 100, min_decode_s=1.0)
    got = asyncio.run(d.decode_step(4))
    used = [lo - sh for lo, sh in (pairs * 100)[: d.waves // 2]]
    assert sum(used) >= 1.0 > sum(used[:-1])  # stopped once its steps covered 1 s
    assert got == pytest.approx(sum(used) / len(used) / (long_n - short_n))
    assert abs(got - step) < 0.1 * step  # the periods cancel, to within one pair's
    median = _Timed(pairs * 2)  # without it: REPEATS pairs, their median
    assert asyncio.run(median.decode_step(4)) == pytest.approx(step + period / (long_n - short_n))


def test_a_continuous_load_shorter_than_its_window_runs_again_longer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A load whose measured middle is shorter than `min_window_s` (a box node's is 4 s:
    its quota throttles every 10 ms) is run again with proportionally more groups; one
    long enough stands."""
    import hexctl.profile.controller as ctl

    calls: list[int] = []

    async def load_once(url, cfg, model_dir, exclude, reloads, groups, rank0):  # noqa: ANN001, ANN202
        calls.append(groups)
        return (100.0 * groups, 0.0, None), groups / 40  # 40 groups per measured second

    monkeypatch.setattr(ctl, "_load_once", load_once)
    cfg = ExperimentConfig()
    first = ctl.CONTINUOUS_ROUNDS * cfg.rollout.max_concurrent_groups
    asyncio.run(ctl.continuous_load("http://x", cfg, None, set(), min_window_s=first / 40))  # type: ignore[arg-type]
    assert calls == [first]
    calls.clear()
    got = asyncio.run(ctl.continuous_load("http://x", cfg, None, set(), min_window_s=4.0))  # type: ignore[arg-type]
    assert calls[0] == first and calls[1] / 40 >= 4.0 and got[0] == 100.0 * calls[1]


@pytest.mark.timeout(120)
def test_a_load_against_a_server_that_never_answers_fails_instead_of_waiting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server that answers its health checks but never a generation (stuck, or left
    paused): the profile's continuous load raises ProfileFailed after STALL_S without a
    sample, naming the server, instead of waiting for ever."""
    from aiohttp import web

    from areal_hex import models
    from areal_hex.config import load_config
    from hexctl.profile import controller as ctl

    model_dir = tmp_path / "v0"
    models.build_tokenizer().save_pretrained(model_dir)
    cfg = load_config(None, ["rollout.group_size=2", "rollout.max_concurrent_groups=2"])
    monkeypatch.setattr(ctl, "STALL_S", 1.5)

    async def stuck(request: web.Request) -> web.Response:
        await asyncio.sleep(3600)
        return web.json_response({})

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def main() -> float:
        app = web.Application()
        app.router.add_get("/health", health)
        app.router.add_post("/generate", stuck)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        t0 = time.monotonic()
        try:
            with pytest.raises(ctl.ProfileFailed, match=f"127.0.0.1:{port}"):
                await ctl.continuous_load(f"http://127.0.0.1:{port}", cfg, model_dir, set())
        finally:
            await runner.cleanup()
        return time.monotonic() - t0

    assert asyncio.run(main()) < 60


@pytest.mark.timeout(120)
def test_a_failed_profile_says_what_its_server_logged_last(tmp_path: Path) -> None:
    from hexctl.profile import server
    from hexctl.profile.controller import ProfileFailed
    from hexctl.profile.devices import LocalDevices

    dev = LocalDevices("CPU", "cpu", 1, None, None, 1, 1, 1.0)
    missing = tmp_path / "no-such-config.yaml"
    t0 = time.monotonic()
    with pytest.raises(ProfileFailed) as got:
        with server.server_process(missing, dev, tmp_path / "serve.log"):
            pytest.fail("a server that cannot start was handed to the profile")
    assert time.monotonic() - t0 < 60  # not the start timeout: the process is watched
    text = str(got.value)
    assert text.startswith("the inference server exited (code ")
    assert "the server's last log lines" in text
    assert "no-such-config.yaml" in text  # the server's own complaint


def test_a_kind_at_another_speed_scales_its_rates_and_times_not_its_ratios() -> None:
    from scheduler.profile import DeviceRates, Profile

    rates = DeviceRates(
        device="box", decode_step_s={1: 0.004, 32: 0.008}, decode_context=40,
        prefill_tokens_per_s=2000.0, train_tokens_per_s=4000.0, train_sync_tokens_per_s=4400.0,
        train_broadcast_s=0.03, reload_idle_s=0.01, update_pause_s=0.05, update_pause_idle_s=None,
        generation_efficiency=0.5, sync_cycle_factor=1.2, host_cpu_s_per_sample=0.001,
    )  # fmt: skip
    prof = Profile(model="m", params=10, kinds={"mem": rates, "fast": rates})
    half = prof.at_speed({"mem": 0.5})
    mem = half.kinds["mem"]
    assert mem.decode_step_s == {1: 0.008, 32: 0.016}
    assert (mem.prefill_tokens_per_s, mem.train_tokens_per_s) == (1000.0, 2000.0)
    assert mem.train_sync_tokens_per_s == 2200.0
    assert (mem.train_broadcast_s, mem.reload_idle_s, mem.update_pause_s) == (0.06, 0.02, 0.1)
    assert mem.update_pause_idle_s is None  # unmeasured stays unmeasured
    assert (mem.generation_efficiency, mem.sync_cycle_factor) == (0.5, 1.2)
    assert mem.host_cpu_s_per_sample == 0.001  # the head node's, not the kind's
    assert half.kinds["fast"] == rates and prof.kinds["mem"] == rates  # others, the original


def test_the_host_work_counts_the_valkey_the_run_starts_beside_the_controller() -> None:
    from hexctl.profile.host_cpu import uncounted

    assert uncounted({10}, 20, valkey_elsewhere=False) == {10}  # the run's own: counted
    assert uncounted({10}, 20, valkey_elsewhere=True) == {10, 20}  # elsewhere: not ours
    assert uncounted({10}, None, valkey_elsewhere=True) == {10}


def test_the_host_cpu_leaves_out_the_profiles_own_readings() -> None:
    """Reading the process tree's CPU from /proc costs CPU of this process, which the
    raw total counts; `TreeCpu` takes it back out, so readings alone add (almost)
    nothing, and work done between readings is still counted."""
    from hexctl.profile.host_cpu import TreeCpu, _tree_cpu_s

    # children this process already has (another test's, in the same pytest worker) are
    # left out: one that exits between two readings takes its CPU out of the tree
    others = _children(os.getpid())
    tree = TreeCpu()
    raw0, net0 = _tree_cpu_s(others), tree(others)
    for _ in range(200):
        tree(others)
    raw1, net1 = _tree_cpu_s(others), tree(others)
    assert raw1 - raw0 > 0.03  # two hundred readings took CPU
    # /proc counts in ticks (10 ms): the readings' own CPU comes back out within that
    assert net1 - net0 < 0.02 + 0.2 * (raw1 - raw0)
    t0 = time.thread_time()
    while time.thread_time() - t0 < 0.2:  # work of the host's kind between readings
        sum(range(1000))
    assert tree(others) - net1 > 0.15


def _children(pid: int) -> set[int]:
    """The live processes whose parent is `pid`."""
    out = set()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except OSError:
            continue
        if ppid == pid:
            out.add(int(d.name))
    return out


def test_a_kinds_efficiency_is_read_at_the_instances_batch() -> None:
    """Measured at the batches its loads held: the nearest one's beyond them, linear in
    the batch between; the single figure where no batch was measured or none is asked."""
    from scheduler.profile import DeviceRates, Profile

    rates = DeviceRates(
        device="box", decode_step_s={1: 0.004, 128: 0.02}, decode_context=40,
        prefill_tokens_per_s=2000.0, train_tokens_per_s=4000.0, generation_efficiency=0.5,
        generation_efficiency_at={64: 0.6, 128: 0.7},
    )  # fmt: skip
    prof = Profile(model="m", params=10, kinds={"k": rates, "old": rates.model_copy(
        update={"generation_efficiency_at": None})})  # fmt: skip
    assert prof.generation_efficiency("k", 32) == 0.6
    assert prof.generation_efficiency("k", 64) == 0.6
    assert abs(prof.generation_efficiency("k", 96) - 0.65) < 1e-12
    assert prof.generation_efficiency("k", 128) == 0.7
    assert prof.generation_efficiency("k", 256) == 0.7
    assert prof.generation_efficiency("k") == 0.5
    assert prof.generation_efficiency("old", 96) == 0.5
    assert prof.generation_efficiency("absent", 96) == 1.0
    again = Profile.model_validate(prof.model_dump(mode="json"))  # as a saved profile reads
    assert again.kinds["k"].generation_efficiency_at == {64: 0.6, 128: 0.7}


def test_a_continuous_load_fills_a_batch_its_groups_leave_half_empty() -> None:
    from hexctl.profile.controller import filled, load_batch

    cfg = ExperimentConfig()
    cfg.rollout.group_size, cfg.rollout.max_concurrent_groups = 8, 8
    cfg.inference.max_running_requests = 128
    assert load_batch(cfg) == 64  # 8 groups of 8 in a batch of 128
    full = filled(cfg)
    assert full is not None and full.rollout.max_concurrent_groups == 16
    assert load_batch(full) == 128 and cfg.rollout.max_concurrent_groups == 8
    cfg.inference.max_running_requests = 60
    assert load_batch(cfg) == 60 and filled(cfg) is None  # 8 groups fill it already
    cfg.inference.max_running_requests = 100
    full = filled(cfg)  # 13 groups of 8: the batch is full with a group to spare
    assert full is not None and full.rollout.max_concurrent_groups == 13 and load_batch(full) == 100


def test_the_profile_summary_shows_the_efficiency_at_each_measured_batch() -> None:
    from hexctl.cli.profile_cmd import _efficiency

    two = {"generation_efficiency": 0.61, "generation_efficiency_at": {"128": 0.669, "64": 0.673}}
    assert _efficiency(two) == "0.67 at 64, 0.67 at 128"
    assert (
        _efficiency({"generation_efficiency": 0.5, "generation_efficiency_at": {"64": 0.5}})
        == "0.50"
    )
    assert _efficiency({"generation_efficiency": 0.5}) == "0.50"  # a profile from before
