"""Scoring priced at the concurrency the run's controller keeps at a task, and the reward
model as a task on a box: timed on its own `/classify` per kind, priced by that rate,
served from its planned node (hexctl/profile/scoring.py, scheduler/task_costs.py,
hexctl/box/place.py)."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest

from areal_hex.config.workflow import TaskSpec
from scheduler.profile import DeviceRates, Profile, load_profile

ROOT = Path(__file__).resolve().parents[2]
THIN = ROOT / "tests/data/box_thin_profile"


def test_the_runs_concurrency_is_its_groups_in_flight_within_the_batch_limit() -> None:
    from hexctl.profile.scoring import scoring_concurrency

    assert scoring_concurrency(8, 64, 8) == 8  # mem: every slot's group at once
    assert scoring_concurrency(8, 4, 8) == 1  # fast: not one whole group fits; one at a time
    assert scoring_concurrency(8, 32, 8) == 4  # the batch limit holds four groups
    assert scoring_concurrency(2, 64, 8) == 2  # two slots: two requests at most


def test_a_box_nodes_rounds_last_its_load_window_and_this_machines_do_not() -> None:
    from hexctl.profile.devices import LocalDevices
    from hexctl.profile.scoring import scoring_window_s

    cores = LocalDevices("CPU", "cpu", 1, None, None, 1, 1, 1.0, min_window_s=1.0)
    node = LocalDevices("CPU", "cpu", 1, None, None, 1, 1, 1.0, cgroup="/cg/mem-0",
                        min_window_s=4.0)  # fmt: skip
    assert scoring_window_s(cores) == 0.0 and scoring_window_s(node) == 4.0


def test_timed_rounds_keeps_that_many_requests_in_flight_and_no_more() -> None:
    """A request that waits 20 ms: four in flight score four times the tokens per second
    of one at a time, and the fifth never starts before one of the four ends; with a
    window, a round goes on until it has lasted that long."""
    from hexctl.profile.scoring import timed_rounds

    in_flight, peak = 0, 0

    async def send(_k: int) -> int:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.02)
        in_flight -= 1
        return 100

    one = asyncio.run(timed_rounds(send, 1, repeats=2))
    assert peak == 1 and one == pytest.approx(100 / 0.02, rel=0.35)
    four = asyncio.run(timed_rounds(send, 4, repeats=2))
    assert peak == 4 and four / one == pytest.approx(4.0, rel=0.35)

    calls = []

    async def counted(k: int) -> int:
        calls.append(k)
        return await send(k)

    # a round of one sender lasts its window: ~0.2 s of 20 ms requests, not the least 4
    windowed = asyncio.run(timed_rounds(counted, 1, repeats=1, min_window_s=0.2))
    assert len(calls) >= 8 and windowed == pytest.approx(one, rel=0.35)


def _rates(**kw: float) -> DeviceRates:
    base = {"device": "box", "decode_step_s": {1: 0.01}, "decode_context": 41,
            "prefill_tokens_per_s": 2_000.0, "train_tokens_per_s": 10_000.0}  # fmt: skip
    return DeviceRates(**{**base, **kw})


def _thin(kinds: dict[str, DeviceRates] | None = None):
    from hexctl.bench.system.hetero import plan_inputs
    from hexctl.job.predict import LocalProfileFiles

    cl, m, w, prof = plan_inputs(LocalProfileFiles(THIN))
    if kinds:
        prof = prof.model_copy(update={"kinds": {**prof.kinds, **kinds}})
    return cl, m, w, prof


def test_a_task_is_priced_at_the_concurrent_rate_then_one_at_a_time_then_prefill() -> None:
    """T = 34 + 15 = 49 tokens a sample on the thin box's workload; the reference is the
    actor's shape, so no FLOPs ratio."""
    from scheduler.task_costs import instance_rate

    cl, m, w, _ = _thin()
    fast = next(g for g in cl.spec.node_groups if g.name == "fast")
    ref = TaskSpec(name="reference", role="reference", command=["x"], port=1, gpus=1)

    def rate(r: DeviceRates) -> float | None:
        prof = Profile(model="m", params=1, kinds={"fast": r})
        return instance_rate(cl, fast, ref, m, m, w, prof)

    assert rate(_rates()) == pytest.approx(2_000 / 49)  # a profile from before scoring
    assert rate(_rates(score_tokens_per_s=8_000.0)) == pytest.approx(8_000 / 49)
    both = _rates(score_tokens_per_s=8_000.0, score_concurrent_tokens_per_s=20_000.0)
    assert rate(both) == pytest.approx(20_000 / 49)


def test_a_reward_model_is_priced_at_its_own_classify_rate_not_the_actors() -> None:
    """Measured on its own model, its /classify rate is taken as it is (no FLOPs ratio to
    the actor's, whatever shape the workload names); a kind without it scales the actor's
    scoring rate by the FLOPs."""
    from scheduler.task_costs import forward_flops_per_sample, instance_rate

    cl, m, w, _ = _thin()
    fast = next(g for g in cl.spec.node_groups if g.name == "fast")
    rm = TaskSpec(name="rm", role="reward_model", command=["x"], port=1, gpus=1)
    small = dataclasses.replace(m, intermediate=m.intermediate // 2)
    measured = _rates(score_concurrent_tokens_per_s=20_000.0, classify_tokens_per_s=6_000.0)
    prof = Profile(model="m", params=1, kinds={"fast": measured})
    assert instance_rate(cl, fast, rm, small, m, w, prof) == pytest.approx(6_000 / 49)
    unmeasured = Profile(model="m", params=1, kinds={"fast": _rates(score_tokens_per_s=8e3)})
    ratio = forward_flops_per_sample(m, w) / forward_flops_per_sample(small, w)
    got = instance_rate(cl, fast, rm, small, m, w, unmeasured)
    assert got == pytest.approx(8_000 / 49 * ratio)


def test_an_old_profile_loads_and_the_new_rates_follow_the_kinds_speed(tmp_path: Path) -> None:
    """The thin box's profile predates both rates: it loads with them unset. A profile
    with them scales them by a kind's speed like every rate."""
    from scheduler.profile import save_profile

    old = load_profile(THIN / "profile.yaml")
    assert all(r.score_concurrent_tokens_per_s is None for r in old.kinds.values())
    assert all(r.classify_tokens_per_s is None for r in old.kinds.values())
    new = _rates(score_concurrent_tokens_per_s=20_000.0, score_concurrency=8,
                 classify_tokens_per_s=6_000.0, classify_concurrency=8)  # fmt: skip
    save_profile(Profile(model="m", params=1, kinds={"mem": new}), tmp_path / "p.yaml")
    back = load_profile(tmp_path / "p.yaml").kinds["mem"]
    assert back.score_concurrency == 8 and back.classify_tokens_per_s == 6_000.0
    slow = back.at_speed(0.5)
    assert slow.score_concurrent_tokens_per_s == 10_000.0 and slow.classify_tokens_per_s == 3e3


def test_plan_b_keeps_the_reward_model_beside_the_actor_and_binds_there() -> None:
    """The thin box with a reward model measured at 20,000 tokens/s on fast and 3,000 on
    mem (408 and 61 samples/s): at $8/h the planner trains on fast, generates on mem
    and scores on the other fast node; kept with the actor's generation on mem it binds
    plan b at its own rate, well under plan a's."""
    from hexctl.bench.system.tasks import plan_pair, task_kinds

    base = _thin()[3]
    kinds = {
        "fast": base.kinds["fast"].model_copy(update={"classify_tokens_per_s": 20_000.0}),
        "mem": base.kinds["mem"].model_copy(update={"classify_tokens_per_s": 3_000.0}),
    }
    cl, m, w, prof = _thin(kinds)
    rm = TaskSpec(name="rm", role="reward_model", command=["x"], port=31200, gpus=1)
    w = w.model_copy(update={"tasks": [rm]})
    plans = plan_pair(cl, m, w, prof, 8.0, "tiny")
    a, b = plans["a"], plans["b"]
    assert task_kinds(a) == {"rm": "fast"} and task_kinds(b) == {"rm": "mem"}
    rm_a, rm_b = a.decisions.task("rm"), b.decisions.task("rm")
    assert rm_a is not None and rm_b is not None
    assert rm_a.predicted_samples_per_s == pytest.approx(20_000 / 49)
    assert rm_b.predicted_samples_per_s == pytest.approx(3_000 / 49)
    assert rm_a.predicted_samples_per_s > a.predicted.samples_per_s  # a: not bound by it
    assert b.predicted.samples_per_s == pytest.approx(3_000 / 49, rel=1e-3)  # b: bound
    assert a.predicted.samples_per_s / b.predicted.samples_per_s >= 1.3


def test_the_reward_model_task_serves_from_its_planned_node(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """examples/box/tiny_box_rm.yaml on a box: the controller reaches the reward model at
    its node's address, and its `serve --reward-model` starts in that node with the
    node's threads for the classifier."""
    from tests.unit.test_box_inventory import _state
    from tests.unit.test_box_tasks import _with_task, on_box

    state = _state(tmp_path, monkeypatch)
    plan = _with_task("fast-0", ["mem-0", "mem-1"], "fast-1", task="rm")
    cfg, specs = on_box(tmp_path, "examples/box/tiny_box_rm.yaml", plan)
    fast1 = state.node("fast-1")
    rm = cfg.workflow.task_with_role("reward_model")
    assert rm is not None and rm.instance_urls() == [f"http://{fast1.address}:31200"]
    cmd = specs["rm-0"].command
    assert cmd[5] == fast1.netns and "--reward-model" in cmd
    at = cmd.index("serve") + 2
    assert cmd[at] == f"inference.host={fast1.address}"
    assert "rollout.reward_model.num_threads=1" in cmd[at : at + 4]


def test_the_tiny_reward_model_takes_a_shape_of_its_own() -> None:
    """`rollout.reward_model.tiny` sets its shape (and its cache key); unset, the
    policy's shape and the key it always had."""
    from areal_hex.config import load_config
    from areal_hex.reward_model import tiny_key, tiny_shape

    cfg = load_config(ROOT / "examples/box/tiny_box_rm.yaml")
    assert tiny_shape(cfg).hidden_size == 96 and cfg.model.tiny is not None
    plain = cfg.model_copy(deep=True)
    plain.rollout.reward_model.tiny = None
    assert tiny_shape(plain) == cfg.model.tiny
    assert tiny_key(plain)[0] != tiny_key(cfg)[0]
    assert tiny_key(plain)[1]["shape"]["hidden_size"] == 64
