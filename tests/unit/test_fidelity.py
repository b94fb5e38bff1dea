"""Predicted vs measured: the measured rates of a run's rows (hand-computed), the relative
errors, and the cost model's prediction for a fixed layout in both modes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from areal_hex.config import ExperimentConfig
from areal_hex.run_files import RolloutRow, RunPaths, TrainerRow, append_row
from hexctl.report.fidelity import (
    add_fidelity,
    measured_rates,
    relative_errors,
    servers_taking_part,
)


def rows() -> tuple[list[TrainerRow], list[RolloutRow]]:
    # 6 steps of B = 2 groups (G = 4: 8 samples), one per 0.5 s from t = 100; each step
    # computes 0.3 s and publishes 0.05 s
    metrics = [
        TrainerRow(
            step=s, time=100 + 0.5 * s, groups_trained_total=2 * s, compute_s=0.3, publish_s=0.05
        )  # fmt: skip
        for s in range(1, 7)
    ]
    # the controller: 20 samples per second of wall, busy 80 % of it, one update per
    # second taking 0.1 s
    rollout = [
        RolloutRow(
            time=100 + t,
            samples_total=20 * t,
            gen_busy_s=0.8 * t,
            weight_syncs_total=t,
            weight_sync_s_total=0.1 * t,
        )  # fmt: skip
        for t in range(0, 6)
    ]
    return metrics, rollout


def test_measured_rates_over_the_window() -> None:
    metrics, rollout = rows()
    m = measured_rates(metrics, rollout, group_size=4, from_step=3)
    # steps 3 -> 6: 3 steps x 8 samples in 1.5 s; work 3 x 0.35 s
    assert m.pipeline_samples_per_s == pytest.approx(24 / 1.5)
    assert m.training_samples_per_s == pytest.approx(24 / 1.05)
    assert m.generation_samples_per_s == pytest.approx(20 / 0.8)
    assert m.weight_sync_s == pytest.approx(0.1)
    errs = relative_errors({"pipeline_samples_per_s": 20.0, "weight_sync_s": None}, m)
    assert errs["pipeline_samples_per_s"] == pytest.approx(0.25)
    assert errs["weight_sync_s"] is None and errs["training_samples_per_s"] is None


def test_a_planned_server_out_in_the_window_is_said() -> None:
    """Two servers planned: both healthy in every row of the window, all took part; one
    still starting in the first rows only (before the window) is not held against the
    run; one out in a row of the window (a late start, a failure) is."""
    metrics, rollout = rows()
    for r in rollout:
        r.servers_healthy = 2
    rollout[0].servers_healthy = 1  # t = 100: before step 3 (t = 101.5)
    got = servers_taking_part(metrics, rollout, from_step=3, planned=2)
    assert got == {"planned": 2, "at_start": 1, "fewest_in_window": 2, "all_took_part": True}
    rollout[3].servers_healthy = 1  # t = 103: inside the window (steps 3-6, t 101.5-103)
    got = servers_taking_part(metrics, rollout, from_step=3, planned=2)
    assert got["fewest_in_window"] == 1 and got["all_took_part"] is False
    assert servers_taking_part(metrics, [], from_step=3, planned=2)["all_took_part"] is None


def written_rows(run_dir: Path) -> RunPaths:
    """`rows()` written into the run directory `run_dir`, as a run writes them."""
    metrics, rollout = rows()
    paths = RunPaths.at(run_dir)
    for r in metrics:
        append_row(paths.metrics, r)
    for r in rollout:
        append_row(paths.rollout, r)
    return paths


def test_summary_block_and_plot(tmp_path: Path) -> None:
    paths = written_rows(tmp_path)
    cfg = ExperimentConfig()
    cfg.buffer.groups_per_step, cfg.rollout.group_size, cfg.buffer.max_staleness = 2, 4, 2
    summary: dict = {}
    add_fidelity(tmp_path, cfg, summary)
    assert summary["fidelity"]["predicted"] is None
    assert "no prediction" in summary["fidelity"]["unavailable"]
    rates = {"pipeline_samples_per_s": 16.0, "generation_samples_per_s": 30.0,
             "training_samples_per_s": 20.0, "weight_sync_s": 0.1}  # fmt: skip
    paths.prediction.write_text(json.dumps({"asynchronous": rates, "synchronous": rates}))
    add_fidelity(tmp_path, cfg, summary)
    block = summary["fidelity"]
    assert block["window_from_step"] == 3 and block["mode"] == "async"
    # one server configured (the default), none healthy in the rows written
    assert block["servers"]["planned"] == 1 and block["servers"]["all_took_part"] is False
    assert block["relative_error"]["pipeline_samples_per_s"] == pytest.approx(0.0)
    assert block["relative_error"]["generation_samples_per_s"] == pytest.approx(0.2)
    assert (paths.report / "fidelity.png").read_bytes()[:4] == b"\x89PNG"


def _local_cluster(tmp_path: Path) -> tuple:
    import yaml

    from scheduler.cluster import load_cluster
    from scheduler.model_shape import load_model_shape
    from scheduler.profile import DeviceRates, Profile
    from scheduler.workload import Workload

    spec = {
        "name": "box",
        "zones": [{"name": "z", "region": "r", "inter_node_bandwidth_gbs": 100,
                   "inter_node_latency_ms": 20}],
        "node_groups": [{"name": "local", "gpu": "CPU", "gpus_per_node": 2, "nodes": 1,
                         "zone": "z", "usd_per_gpu_hour": 1,
                         "intra_node": {"kind": "pcie", "bandwidth_gbs": 10}}],
        "gpu_overrides": {"CPU": {"bf16_tflops": 0.01, "hbm_gb": 64, "hbm_gbs": 0.02}},
    }  # fmt: skip
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(spec))
    m = load_model_shape("qwen3-0.6b")
    rates = DeviceRates(device="cpu", decode_step_s={1: 0.01, 64: 0.02}, decode_context=40,
                        prefill_tokens_per_s=5000, train_tokens_per_s=6000)  # fmt: skip
    prof = Profile(model="m", params=m.params, kinds={"CPU": rates})
    w = Workload(groups_per_step=8, group_size=16, prompt_tokens=34, response_tokens=20,
                 max_response_tokens=24, max_staleness=2, rollout_tp=1, zero_stage=0,
                 constants={"max_running_requests": 64})  # fmt: skip
    return load_cluster(tmp_path / "c.yaml"), m, w, prof


def test_layout_prediction_in_both_modes(tmp_path: Path) -> None:
    from scheduler.predict import LayoutError, TrainerLayout, predict_layout

    cl, m, w, prof = _local_cluster(tmp_path)
    trainer = TrainerLayout((("local", 1),), 1)
    p = predict_layout(cl, m, w, prof, [("local", 1)], trainer)
    a, s = p.asynchronous, p.synchronous
    # training: B·G samples per step of (34 + 20) tokens each at 6,000 tokens/s, and the
    # publish of 2N bytes at the storage's 2 GB/s
    step = 128 * 54 / 6000 + 2 * m.params / 2e9
    assert a.training_samples_per_s == pytest.approx(128 / step, rel=1e-3)
    # the zone's latency + 5 (weight_sync_factor) x 2N bytes over its 100 GB/s
    sync = 0.02 + 5 * 2 * m.params / 100e9
    assert a.weight_sync_s == pytest.approx(sync, rel=1e-6)
    # generation: 64 at a time, 20 steps of 20 ms each, + prefill of 34/16 tokens, less
    # the pauses: one per step, at the training rate (the bottleneck here)
    per_sample = 20 * 0.02 / 64 + 34 / 16 / 5000
    paused = sync * a.training_samples_per_s / 128
    assert a.generation_samples_per_s == pytest.approx((1 - paused) / per_sample, rel=1e-3)
    assert a.pipeline_samples_per_s == pytest.approx(
        min(a.training_samples_per_s, a.generation_samples_per_s), rel=0.05
    )
    # synchronous: the phases add up, never overlap
    phases = 128 / s.generation_samples_per_s + 128 / s.training_samples_per_s
    assert s.pipeline_samples_per_s < a.pipeline_samples_per_s
    assert s.pipeline_samples_per_s == pytest.approx(128 / (phases + 0.02), rel=0.15)
    with pytest.raises(LayoutError, match="not in"):
        predict_layout(cl, m, w, prof, [("gpu", 1)], trainer)


def test_the_trainers_publish_and_checkpoint_as_profiled(tmp_path: Path) -> None:
    """A kind whose profile timed the trainer's publish and checkpoint: a step pays the
    publish every `publish_every` steps and the checkpoint every `checkpoint_every`,
    instead of the storage estimate; a checkpoint interval unknown to the workload is not
    priced."""
    from scheduler.predict import TrainerLayout, predict_layout

    cl, m, w, prof = _local_cluster(tmp_path)
    trainer = TrainerLayout((("local", 1),), 1)
    compute = 128 * 54 / 6000
    rates = prof.kinds["CPU"]
    rates.train_publish_s, rates.train_checkpoint_s = 0.03, 0.5
    p = predict_layout(cl, m, w, prof, [("local", 1)], trainer).asynchronous
    assert 128 / p.training_samples_per_s == pytest.approx(compute + 0.03, rel=1e-6)
    w2 = w.model_copy(update={"publish_every": 2, "checkpoint_every": 10})
    p2 = predict_layout(cl, m, w2, prof, [("local", 1)], trainer).asynchronous
    assert 128 / p2.training_samples_per_s == pytest.approx(compute + 0.015 + 0.05, rel=1e-6)


def test_a_synchronous_step_trains_at_the_rate_without_a_write_beside_it(
    tmp_path: Path,
) -> None:
    """Where the profile timed steps that publish nothing (`train_sync_tokens_per_s`), a
    synchronous step computes at that rate, publish still paid; an asynchronous one,
    whose write shares the next step's cores, keeps the publishing rate."""
    from scheduler.predict import TrainerLayout, predict_layout

    cl, m, w, prof = _local_cluster(tmp_path)
    trainer = TrainerLayout((("local", 1),), 1)
    rates = prof.kinds["CPU"]
    rates.train_publish_s = 0.03
    before = predict_layout(cl, m, w, prof, [("local", 1)], trainer)
    rates.train_sync_tokens_per_s = 8000.0  # the publishing rate is 6000
    after = predict_layout(cl, m, w, prof, [("local", 1)], trainer)
    a0, a1 = before.asynchronous, after.asynchronous
    assert a1.training_samples_per_s == pytest.approx(a0.training_samples_per_s)
    assert a1.pipeline_samples_per_s == pytest.approx(a0.pipeline_samples_per_s)
    # the synchronous rate is B·G over (cycle + step): the step is 128·54/8000 + 0.03 s
    # where it was 128·54/6000 + 0.03 s, the cycle the same
    s0, s1 = before.synchronous, after.synchronous
    step0, step1 = 128 * 54 / 6000 + 0.03, 128 * 54 / 8000 + 0.03
    cycle = 128 / s0.pipeline_samples_per_s - step0
    assert 128 / s1.pipeline_samples_per_s == pytest.approx(cycle + step1, rel=1e-6)


def test_a_box_kinds_synchronous_replay_runs_at_its_efficiency(tmp_path: Path) -> None:
    """A synchronous step's generation (its decode steps and prefills, not its update) on
    a box kind runs at the kind's `generation_efficiency` of its timings: at 0.5 it takes
    twice as long. On a kind of the host's own cores the replay is unchanged (its cycle
    factor, measured against that replay, holds what the efficiency would)."""
    from scheduler.predict import TrainerLayout, predict_layout
    from scheduler.profile import BOX_DEVICE

    cl, m, w, prof = _local_cluster(tmp_path)
    trainer = TrainerLayout((("local", 1),), 1)
    rates = prof.kinds["CPU"]

    def cycle_and_update() -> tuple[float, float]:
        r = predict_layout(cl, m, w, prof, [("local", 1)], trainer).synchronous
        return 128 / r.pipeline_samples_per_s - 128 / r.training_samples_per_s, r.weight_sync_s

    full, update = cycle_and_update()
    assert 0 < update < full
    rates.generation_efficiency = 0.5
    assert cycle_and_update() == pytest.approx((full, update))  # a CPU kind: as it was
    rates.device = BOX_DEVICE
    assert prof.replay_efficiency("CPU", 64) == 0.5
    slower, same_update = cycle_and_update()
    assert same_update == pytest.approx(update)
    assert slower - update == pytest.approx(2 * (full - update), rel=1e-6)
    # read at the instance's batch where the load was measured at several
    rates.generation_efficiency_at = {32: 0.4, 128: 0.8}
    assert prof.replay_efficiency("CPU", 64) == pytest.approx(0.4 + 0.4 * 32 / 96)
    assert prof.replay_efficiency("absent", 64) == 1.0


def test_continuous_efficiency_and_host_cpu(tmp_path: Path) -> None:
    """`generation_efficiency` scales the kind's generation; `host_cpu_s_per_sample`
    lengthens an asynchronous step by B·G times it on a CPU kind only (the controller
    runs beside a CPU trainer), never a synchronous one (it works while the trainer
    waits)."""
    from scheduler.predict import TrainerLayout, predict_layout

    cl, m, w, prof = _local_cluster(tmp_path)
    trainer = TrainerLayout((("local", 1),), 1)
    base = predict_layout(cl, m, w, prof, [("local", 1)], trainer)
    rates = prof.kinds["CPU"]
    rates.generation_efficiency, rates.host_cpu_s_per_sample = 0.5, 0.002
    p = predict_layout(cl, m, w, prof, [("local", 1)], trainer)
    step = 128 / base.asynchronous.training_samples_per_s
    assert 128 / p.asynchronous.training_samples_per_s == pytest.approx(step + 128 * 0.002)
    assert p.synchronous.training_samples_per_s == pytest.approx(
        base.synchronous.training_samples_per_s
    )
    # generation: half the unpaused rate (the pauses follow the slower training)
    per_sample = (20 * 0.02 / 64 + 34 / 16 / 5000) / 0.5
    paused = p.asynchronous.weight_sync_s * p.asynchronous.training_samples_per_s / 128
    assert p.asynchronous.generation_samples_per_s == pytest.approx(
        (1 - paused) / per_sample, rel=1e-3
    )
    # sync_cycle_factor stretches a synchronous step's generation and reload, not its
    # training
    base_cycle = (
        128 / p.synchronous.pipeline_samples_per_s - 128 / p.synchronous.training_samples_per_s
    )
    rates.sync_cycle_factor = 1.5
    slow = predict_layout(cl, m, w, prof, [("local", 1)], trainer).synchronous
    cycle = 128 / slow.pipeline_samples_per_s - 128 / slow.training_samples_per_s
    assert cycle == pytest.approx(1.5 * base_cycle)
    # fitted on one instance of the kind, it stretches a batch split over two as well
    two = [("local", 1), ("local", 1)]
    fitted = predict_layout(cl, m, w, prof, two, trainer).synchronous
    rates.sync_cycle_factor = None
    replayed = predict_layout(cl, m, w, prof, two, trainer).synchronous

    def cycle_of(r: Any) -> float:
        return 128 / r.pipeline_samples_per_s - 128 / r.training_samples_per_s

    assert cycle_of(fitted) == pytest.approx(1.5 * cycle_of(replayed))
    assert replayed.pipeline_samples_per_s > fitted.pipeline_samples_per_s
    assert fitted.pipeline_samples_per_s > slow.pipeline_samples_per_s
    # on a GPU kind the controller has host cores of its own
    rates.device = "NVIDIA H100 80GB HBM3"
    gpu = predict_layout(cl, m, w, prof, [("local", 1)], trainer)
    assert gpu.asynchronous.training_samples_per_s == pytest.approx(
        base.asynchronous.training_samples_per_s
    )


def test_a_pause_costs_generation_all_but_its_measured_overlap(tmp_path: Path) -> None:
    """`reload_overlap_s` comes off each pause in the generation charge only: the same
    layout generates (1 - (pause - overlap)·R/(B·G))/per-sample, the weight-sync figure
    and the training rate stay, and an overlap longer than the pause charges nothing.
    The overlap is measured with updates from disk, and taken off their pauses only."""
    from scheduler.costmodel import rollout_config
    from scheduler.predict import TrainerLayout, predict_layout

    cl, m, w, prof = _local_cluster(tmp_path)
    trainer = TrainerLayout((("local", 1),), 1)
    full = predict_layout(cl, m, w, prof, [("local", 1)], trainer).asynchronous
    prof.kinds["CPU"].reload_overlap_s = 0.015
    part = predict_layout(cl, m, w, prof, [("local", 1)], trainer).asynchronous
    assert part.weight_sync_s == pytest.approx(full.weight_sync_s)
    assert part.training_samples_per_s == pytest.approx(full.training_samples_per_s)
    per_sample = 20 * 0.02 / 64 + 34 / 16 / 5000
    paused = (part.weight_sync_s - 0.015) * part.pipeline_samples_per_s / 128
    assert part.generation_samples_per_s == pytest.approx((1 - paused) / per_sample, rel=1e-3)
    assert part.generation_samples_per_s > full.generation_samples_per_s
    opt = rollout_config(cl, cl.spec.node_groups[0], 1, m, w, prof)
    assert opt is not None and opt.pause_overlap_s == 0.015
    prof.kinds["CPU"].reload_overlap_s = 10.0  # the whole pause generates
    none = predict_layout(cl, m, w, prof, [("local", 1)], trainer).asynchronous
    assert none.generation_samples_per_s == pytest.approx(1 / per_sample, rel=1e-3)
    # measured with updates from disk: a network update's pause is charged whole
    net = w.model_copy(update={"weight_sync": "network"})
    over = predict_layout(cl, m, net, prof, [("local", 1)], trainer).asynchronous
    paused = over.weight_sync_s * over.pipeline_samples_per_s / 128
    assert over.generation_samples_per_s == pytest.approx((1 - paused) / per_sample, rel=1e-3)
    # measured over the network: taken off a network update's pause, not off disk's
    prof.kinds["CPU"].reload_overlap_s, prof.kinds["CPU"].reload_overlap_sync = 0.015, "network"
    over = predict_layout(cl, m, net, prof, [("local", 1)], trainer).asynchronous
    paused = (over.weight_sync_s - 0.015) * over.pipeline_samples_per_s / 128
    assert over.generation_samples_per_s == pytest.approx((1 - paused) / per_sample, rel=1e-3)
    disk = predict_layout(cl, m, w, prof, [("local", 1)], trainer).asynchronous
    assert disk.generation_samples_per_s == pytest.approx(full.generation_samples_per_s)
    prof.kinds["CPU"].reload_overlap_sync = "disk"
    prof.kinds["CPU"].reload_overlap_s = None  # unmeasured: the whole pause is lost
    again = predict_layout(cl, m, w, prof, [("local", 1)], trainer).asynchronous
    assert again.generation_samples_per_s == pytest.approx(full.generation_samples_per_s)


def test_the_measured_overlap_of_a_pause() -> None:
    """`pause_overlap_s` from a load without and with updates: a pause that stops the
    load for its length overlaps nothing, one the load makes up overlaps all of it."""
    from hexctl.profile.controller import RELOAD_EVERY_S, pause_overlap_s

    e, p = RELOAD_EVERY_S, 0.05
    # the rate between updates equals the plain rate: every pause lost its length
    assert pause_overlap_s(100.0, 100.0, p) == pytest.approx(0.0)
    # as many samples per cycle as without updates: nothing lost
    assert pause_overlap_s(100.0, 100.0 * (e + p) / e, p) == pytest.approx(p)
    # in between: 40 % of the pause lost, 60 % of it (0.03 s) generated
    assert pause_overlap_s(100.0, 100.0 * (e + 0.6 * p) / e, p) == pytest.approx(0.03)
    # noise outside [0, pause] is clipped; no update measured: None
    assert pause_overlap_s(100.0, 50.0, p) == 0.0
    assert pause_overlap_s(100.0, 500.0, p) == p
    assert pause_overlap_s(100.0, 100.0, None) is None


def test_each_rounds_overlap_is_against_the_pooled_plain_rate() -> None:
    """A round's overlap is taken against the median of all the plain rounds, not the
    one load beside it: a plain load that ran fast by chance does not make its round's
    pause look lost."""
    from hexctl.profile.controller import RELOAD_EVERY_S, round_overlaps

    e, p = RELOAD_EVERY_S, 0.05
    made_up = 100.0 * (e + 0.6 * p) / e  # 0.03 s of the pause generated at 100/s
    plain = [100.0, 130.0, 95.0, 100.0, 105.0]  # round 2's plain load ran 30 % fast
    got = round_overlaps(plain, [(made_up, p)] * 5)
    assert got == pytest.approx([0.03] * 5)
    # rounds without a pause measured are left out; no plain round: nothing
    assert round_overlaps(plain, [(made_up, p), (made_up, None)]) == pytest.approx([0.03])
    assert round_overlaps([], [(made_up, p)]) == []


def test_host_work_beside_the_servers(tmp_path: Path) -> None:
    """`host_work: rollout` (`run.host_cores: inference`): the trainer's step pays
    nothing for the controller; the instance's generation is the one measured sharing its
    cores (`generation_efficiency_shared`), else it pays the host CPU per sample."""
    from scheduler.predict import TrainerLayout, predict_layout

    cl, m, w, prof = _local_cluster(tmp_path)
    trainer = TrainerLayout((("local", 1),), 1)
    rates = prof.kinds["CPU"]
    rates.generation_efficiency, rates.host_cpu_s_per_sample = 0.5, 0.002
    beside_trainer = predict_layout(cl, m, w, prof, [("local", 1)], trainer).asynchronous
    wr = w.model_copy(update={"host_work": "rollout"})
    beside = predict_layout(cl, m, wr, prof, [("local", 1)], trainer).asynchronous
    step = 128 / beside_trainer.training_samples_per_s - 128 * 0.002
    assert 128 / beside.training_samples_per_s == pytest.approx(step)
    unpaused = (20 * 0.02 / 64 + 34 / 16 / 5000) / 0.5 + 0.002  # no shared figure
    paused = beside.weight_sync_s * beside.pipeline_samples_per_s / 128
    assert beside.generation_samples_per_s == pytest.approx((1 - paused) / unpaused, rel=1e-3)
    rates.generation_efficiency_shared = 0.25  # measured: half the rate of the other side
    shared = predict_layout(cl, m, wr, prof, [("local", 1)], trainer).asynchronous
    unpaused = (20 * 0.02 / 64 + 34 / 16 / 5000) / 0.25
    paused = shared.weight_sync_s * shared.pipeline_samples_per_s / 128
    assert shared.generation_samples_per_s == pytest.approx((1 - paused) / unpaused, rel=1e-3)


def test_async_pause_follows_the_generation_slack(tmp_path: Path) -> None:
    """An asynchronous update finds servers with slack idle (the profile's idle reload),
    servers at the trainer's rate mid-batch (the in-flight reload), and between the two
    the share of idle updates grows with the slack; the pipeline rate stays as it was."""
    from scheduler.predict import IDLE_AT_SLACK, TrainerLayout, predict_layout

    cl, m, w, prof = _local_cluster(tmp_path)
    trainer = TrainerLayout((("local", 1),), 1)
    rates = prof.kinds["CPU"]
    busy = 0.02 + 5 * 2 * m.params / 100e9  # the in-flight reload (the zone's link)

    def at(train_tokens_per_s: float, idle: float | None) -> Any:
        rates.train_tokens_per_s, rates.reload_idle_s = train_tokens_per_s, idle
        return predict_layout(cl, m, w, prof, [("local", 1)], trainer).asynchronous

    slow_trainer = at(600.0, 0.001)  # generation far above training
    assert slow_trainer.weight_sync_s == pytest.approx(0.001)
    assert slow_trainer.pipeline_samples_per_s == pytest.approx(
        at(600.0, None).pipeline_samples_per_s
    )
    assert at(600.0, None).weight_sync_s == pytest.approx(busy)  # nothing idle profiled
    fast_trainer = at(1e7, 0.001)  # generation binds
    assert fast_trainer.weight_sync_s == pytest.approx(busy)
    assert fast_trainer.generation_samples_per_s < fast_trainer.training_samples_per_s
    # a trainer a little slower than generation: part of the updates find idle servers
    gen = fast_trainer.generation_samples_per_s
    step_tokens = 128 * 54
    publish = 2 * m.params / 2e9
    mid = at(step_tokens / (128 / (gen / 1.1) - publish), 0.001)
    slack = mid.generation_samples_per_s / mid.training_samples_per_s
    assert 1.0 < slack < 1.0 + IDLE_AT_SLACK
    share = (slack - 1.0) / IDLE_AT_SLACK
    assert mid.weight_sync_s == pytest.approx(busy - (busy - 0.001) * share)


def test_sync_phase_times(tmp_path: Path) -> None:
    """bench fidelity's overlap limit comes from the synchronous run's phases: the wait
    for the batch (generation) and the rest of each step (training)."""
    from hexctl.bench.system.fidelity import phase_times

    paths = RunPaths.at(tmp_path)
    for s in range(1, 6):  # one step per 2.5 s: 1.5 s waiting, then 1.0 s of training
        append_row(paths.metrics, TrainerRow(step=s, time=10 + 2.5 * s, wait_s=1.5))
    gen, train = phase_times(tmp_path, from_step=3)
    assert (gen, train) == (pytest.approx(1.5), pytest.approx(1.0))


def test_a_synchronous_update_pauses_idle_servers_in_either_mode(tmp_path: Path) -> None:
    """A synchronous run reloads servers with nothing in flight: disk sync pauses for the
    profile's idle reload; network sync for that pause once plus its buckets' fixed cost
    and bytes over the link, where the asynchronous run pays the in-flight pause (the
    zone's latency) instead."""
    from scheduler.predict import TrainerLayout, predict_layout
    from scheduler.sync_cost import weight_sync_s

    cl, m, w, prof = _local_cluster(tmp_path)
    prof.kinds["CPU"].reload_idle_s = 0.004
    trainer = TrainerLayout((("local", 1),), 1)
    disk = predict_layout(cl, m, w, prof, [("local", 1)], trainer)
    assert disk.synchronous.weight_sync_s == pytest.approx(0.004)
    net_w = w.model_copy(update={"weight_sync": "network"})
    net = predict_layout(cl, m, net_w, prof, [("local", 1)], trainer)
    in_flight = weight_sync_s(cl, m, net_w, "z", "z")  # the zone's 20 ms pause, once
    assert in_flight > 0.020 + net_w.constants.weight_sync_bucket_overhead_ms / 1e3
    assert net.synchronous.weight_sync_s == pytest.approx(in_flight - 0.020 + 0.004)


def test_an_asynchronous_runs_servers_are_priced_at_the_batch_its_controller_holds(
    tmp_path: Path,
) -> None:
    """Two servers of batch 64 under a controller holding 4 groups of 16 run at 32 each,
    priced through the decode step and the efficiency measured at 32; a synchronous step
    admits its whole batch (the replay spreads it), whatever the controller's cap."""
    from scheduler.predict import _rollouts

    cl, m, w, prof = _local_cluster(tmp_path)
    prof.kinds["CPU"].generation_efficiency_at = {32: 0.4, 64: 0.8}
    two = [("local", 1), ("local", 1)]
    full = _rollouts(cl, m, w, prof, two)
    held = _rollouts(cl, m, w, prof, two, max_inflight_groups=4)
    assert [o.batch for o in full] == [64, 64] and [o.batch for o in held] == [32, 32]
    step32 = 0.01 + 0.01 * 31 / 63  # between the timings at 1 and 64
    prefill = 34 / 16 / 5000
    assert full[0].samples_per_s == pytest.approx(0.8 / (20 * 0.02 / 64 + prefill))
    assert held[0].samples_per_s == pytest.approx(0.4 / (20 * step32 / 32 + prefill))
    sync = _rollouts(cl, m, w, prof, two, synchronous=True, max_inflight_groups=4)
    assert [o.batch for o in sync] == [64, 64]
