"""A lent server counts toward the trainer's batch in whole groups: its first group ends
a group's latency after the lend (`lending.first_group_s`), and the asynchronous hybrid
price (`hybrid.lent_asynchronous`) counts its samples from then on."""

from __future__ import annotations

import pytest

from scheduler.costmodel import RolloutOption
from scheduler.hybrid import lent_asynchronous
from scheduler.lending import first_group_s
from scheduler.predict import LayoutRates
from scheduler.workload import Workload


def _workload() -> Workload:
    return Workload(
        groups_per_step=8,
        group_size=16,
        prompt_tokens=34,
        response_tokens=16,
        max_response_tokens=24,
    )


def _option(samples_per_s: float | None = None) -> RolloutOption:
    """Decode steps of 1 ms at a batch of 64, 0.1 ms of prefill a sample: 0.35 ms a
    sample from those timings alone (2857/s), or `samples_per_s`."""
    alone = 16 * 0.001 / 64 + 0.0001
    rate = samples_per_s if samples_per_s is not None else 1 / alone
    return RolloutOption("g", "CPU", "z", 1, 64, 0.001, 0.0001, rate, 16 * rate, 1.0)


def test_a_first_group_takes_its_longest_answer_and_its_prefill() -> None:
    # answers 16·U(0.5, 1.5): the longest of 16 is 16·(0.5 + 16/17) = 23.06 tokens
    longest = 16 * (0.5 + 16 / 17)
    got = first_group_s(_workload(), _option())
    assert got == pytest.approx(longest * 0.001 + 16 * 0.0001, rel=2e-3)
    # a server at half the rate its timings give (its efficiency, the host's work
    # beside it) takes twice as long; one faster than its timings is not shortened
    assert first_group_s(_workload(), _option(1428.57)) == pytest.approx(2 * got, rel=1e-3)
    assert first_group_s(_workload(), _option(5000.0)) == pytest.approx(got)


def test_a_lent_server_counts_from_its_first_group_on() -> None:
    """B = 128, T = 0.5 s, a server of its own at 128/s: 64 samples left when the
    trainer has stepped. The lent server (128/s) adds what it makes after the lend and
    its first group; a first group that ends after the servers of their own have made
    the batch adds nothing: their rate."""
    own = LayoutRates(128.0, 128.0, 256.0, 0.01)
    at_once = lent_asynchronous(own, 128.0, 128, 0.01)
    late = lent_asynchronous(own, 128.0, 128, 0.01, first_group=0.1)
    # 64 left: the servers of their own make 128·W, the lent one 128·(W − 0.11)
    wait = (64 + 128 * 0.11) / 256
    assert late.pipeline_samples_per_s == pytest.approx(128 / (0.5 + wait))
    assert late.pipeline_samples_per_s < at_once.pipeline_samples_per_s
    assert late.generation_samples_per_s == pytest.approx(late.pipeline_samples_per_s)
    # the first group ends after the 0.5 s the servers of their own need for the rest
    never = lent_asynchronous(own, 128.0, 128, 0.01, first_group=0.5)
    assert never.pipeline_samples_per_s == pytest.approx(128.0)
    # training binds: nothing lent, the latency changes nothing
    fast = LayoutRates(256.0, 400.0, 256.0, 0.01)
    assert lent_asynchronous(fast, 400.0, 128, 0.05, first_group=1.0) == fast


def test_a_synchronous_lent_server_pays_the_host_work_once_a_step() -> None:
    """Synchronous, the batch's groups spread evenly and the host's work for the
    servers of their own's samples (h = 0.2 ms each) is a fixed part of the step on the
    trainer's core: a lent server at 1000/s beside its own host work makes
    1 / (1 ms + 0.2 ms · own/lent). Asynchronous, that work takes 1 − h·G_own of every
    second (G_own = 2000/s: 600/s). With the host's work beside the servers of their own,
    a lent server shares nothing."""
    from scheduler.lending import lent_share, lent_synchronous_rate
    from scheduler.profile import DeviceRates, Profile

    rates = DeviceRates(
        device="cpu",
        decode_step_s={1: 0.001},
        decode_context=40,
        prefill_tokens_per_s=1e4,
        train_tokens_per_s=1e4,
        host_cpu_s_per_sample=0.0002,
    )
    prof = Profile(model="tiny", params=80704, kinds={"CPU": rates})
    w = _workload().model_copy(update={"host_work": "trainer"})
    one = lent_synchronous_rate(w, prof, "CPU", 1000.0, own=1, lent=1)
    assert one == pytest.approx(1 / 0.0012)
    assert lent_synchronous_rate(w, prof, "CPU", 1000.0, own=2, lent=1) == pytest.approx(1 / 0.0014)
    assert lent_synchronous_rate(w, prof, "CPU", 1000.0, own=1, lent=2) == pytest.approx(1 / 0.0011)
    assert 1000.0 * lent_share(w, prof, "CPU", 2000.0) == pytest.approx(600.0)
    beside_servers = w.model_copy(update={"host_work": "rollout"})
    assert lent_synchronous_rate(beside_servers, prof, "CPU", 1000.0, 1, 1) == 1000.0
    assert lent_synchronous_rate(w, None, "CPU", 1000.0, 1, 1) == 1000.0
