"""One local profile prices every mode of `bench modes`: the disaggregated and hybrid runs
from the rates of each side's cores, the colocated run from the rates on every core and
the profiled switch. Fixed rates, hand-checked figures."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from areal_hex.config import load_config
from hexctl.bench.system.modes import MODES, lent_overrides

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples/tiny_cpu.yaml"
SWITCH_S = 0.02


def _rates(step: float, prefill: float, train: float) -> dict:
    return {
        "decode_step_s": {1: step, 8: 1.5 * step, 64: 6 * step},
        "prefill_tokens_per_s": prefill,
        "train_tokens_per_s": train,
    }


def _profile(tmp: Path, every_core: bool = True) -> Path:
    """A local profile of a 2-core host: each side's core, and (with `every_core`) the
    same timed on both cores, generation 1.6x and training 1.8x as fast."""
    d = tmp / "profile"
    shutil.copytree(ROOT / "tests/data/box_thin_profile/model", d / "model")
    cluster = {
        "name": "local-test",
        "zones": [
            {
                "name": "local",
                "region": "local",
                "inter_node_bandwidth_gbs": 100.0,
                "inter_node_latency_ms": 5.0,
            }
        ],  # fmt: skip
        "node_groups": [
            {
                "name": "local",
                "gpu": "CPU",
                "gpus_per_node": 2,
                "nodes": 1,
                "zone": "local",
                "usd_per_gpu_hour": 1.0,
                "intra_node": {"kind": "pcie", "bandwidth_gbs": 10.0},
            }
        ],  # fmt: skip
        "gpu_overrides": {"CPU": {"bf16_tflops": 0.01, "hbm_gb": 4.0, "hbm_gbs": 0.06}},
    }
    kind = {
        "device": "cpu",
        **_rates(0.004, 3000.0, 30000.0),
        "decode_context": 40,
        "train_publish_s": 0.005,
        "train_checkpoint_s": 0.03,
        "reload_idle_s": 0.01,
        "context_switch_s": SWITCH_S,
    }
    if every_core:
        kind["every_core"] = {
            **_rates(0.004 / 1.6, 3000.0 * 1.6, 30000.0 * 1.8),
            "inference_threads": 2,
            "trainer_threads": 2,
        }
    prof = {"model": str(d / "model"), "params": 80704, "kinds": {"CPU": kind}}
    w = yaml.safe_load((ROOT / "tests/data/box_thin_profile/workload.yaml").read_text())
    w.update(weight_sync="disk", max_trainer_nodes=1)
    for name, data in (("cluster", cluster), ("profile", prof), ("workload", w)):
        (d / f"{name}.yaml").write_text(yaml.safe_dump(data))
    return d


def _cfg(name: str, *extra: str):  # type: ignore[no-untyped-def]
    mode = MODES[name]
    base = ["run.host_cores=trainer", *extra]
    return load_config(TINY, [*base, *lent_overrides(str(TINY), base, mode), *mode.overrides()])


def _rate(cfg, prof: Path) -> float:  # type: ignore[no-untyped-def]
    from hexctl.job.predict import predict_run

    pred = predict_run(cfg, None, prof)
    assert "unavailable" not in pred, pred
    side = "synchronous" if cfg.run.mode == "sync" else "asynchronous"
    return pred[side]["pipeline_samples_per_s"]


def test_one_profile_prices_all_five_modes(tmp_path: Path) -> None:
    prof = _profile(tmp_path)
    rates = {name: _rate(_cfg(name), prof) for name in MODES}
    assert all(r > 0 for r in rates.values()), rates
    # generation binds at these rates: lending the trainer's core pays, in either mode
    assert rates["hybrid-async"] > rates["disaggregated-async"]
    assert rates["hybrid-sync"] > rates["disaggregated-sync"]


def test_colocated_is_the_sync_layout_on_every_core_plus_the_switch(tmp_path: Path) -> None:
    """Colocated sync = the disaggregated sync step with the every-core rates, plus the
    profiled switch; without every-core rates, the same step on each side's cores."""
    b = _cfg("colocated-sync").buffer.groups_per_step * 16  # B·G of tiny_cpu
    every = _profile(tmp_path / "a")
    side = _profile(tmp_path / "b", every_core=False)
    on_every = tmp_path / "c"
    shutil.copytree(every, on_every)
    p = yaml.safe_load((every / "profile.yaml").read_text())
    p["kinds"]["CPU"].update(p["kinds"]["CPU"].pop("every_core"))
    for k in ("inference_threads", "trainer_threads"):
        p["kinds"]["CPU"].pop(k)
    (on_every / "profile.yaml").write_text(yaml.safe_dump(p))

    apart = _rate(_cfg("disaggregated-sync"), on_every)
    together = _rate(_cfg("colocated-sync"), every)
    assert b / together == pytest.approx(b / apart + SWITCH_S)
    slower = _rate(_cfg("colocated-sync"), side)
    assert b / slower == pytest.approx(b / _rate(_cfg("disaggregated-sync"), side) + SWITCH_S)
    assert together > slower


def test_hybrid_async_lends_the_trainers_core_while_it_waits(tmp_path: Path) -> None:
    """Hybrid async from the split's rates: the trainer steps T, then waits for what the
    servers of their own did not make: the lend (the switch and the lent server's idle
    update) and the lent server's first group F, then every server,
    W = (B − G_own·T + G_lent·(lend + F)) / (G_own + G_lent), rate = B / (T + W); no
    host work profiled on the trainer's core, so the lent server makes what one of its
    own does."""
    from hexctl.job.predict import predict_run

    prof = _profile(tmp_path)
    own = predict_run(_cfg("disaggregated-async"), None, prof)["asynchronous"]
    hybrid = predict_run(_cfg("hybrid-async"), None, prof)
    b = 8 * 16
    g = own["generation_samples_per_s"]
    t = b / own["training_samples_per_s"]
    lend = SWITCH_S + hybrid["synchronous"]["weight_sync_s"]
    late = lend + hybrid["asynchronous"]["lent_first_group_s"]
    assert g * (t + late) < b  # generation binds: something to lend
    # the lent server as one of its own, without the weight updates' pauses
    g_lent = hybrid["asynchronous"]["lent_samples_per_s"]
    assert g < g_lent < 1.1 * g
    expect = b / (t + (b - g * t + g_lent * late) / (g + g_lent))
    got = hybrid["asynchronous"]
    assert got["pipeline_samples_per_s"] == pytest.approx(expect, rel=1e-6)
    assert got["generation_samples_per_s"] == pytest.approx(expect, rel=1e-6)
    assert expect > own["pipeline_samples_per_s"]


def test_a_synchronous_step_fills_its_server_with_the_whole_batch(tmp_path: Path) -> None:
    """A synchronous step's gate admits its B·G answers at once (B = 4, G = 8: 32, under
    the engine's 64), so the replay's server holds them all, whatever η the run's config
    names; the asynchronous gate's steady state stays (η − 1)·B groups, at least B/2, of
    their mean occupancy. One wave, then: no longer than the idle weight load (0.01 s),
    the 32 prefills (34 prompt tokens shared by a group of 8, at 3000 tokens/s) and 16
    decode steps at batch 32."""
    from scheduler.cluster import load_cluster
    from scheduler.costmodel import inflight_cap, rollout_config
    from scheduler.model_shape import load_model_shape
    from scheduler.predict import TrainerLayout, predict_layout
    from scheduler.profile import load_profile
    from scheduler.workload import load_workload

    d = _profile(tmp_path, every_core=False)
    cl, m = load_cluster(d / "cluster.yaml"), load_model_shape(str(d / "model"))
    w, prof = load_workload(d / "workload.yaml"), load_profile(d / "profile.yaml")
    group, bg = cl.spec.node_groups[0], w.samples_per_step
    sync_w = w.model_copy(update={"max_staleness": 0})
    assert bg == 32 and inflight_cap(sync_w) < bg
    assert rollout_config(cl, group, 1, m, sync_w, prof).batch == inflight_cap(sync_w)
    one = rollout_config(cl, group, 1, m, sync_w, prof, synchronous=True)
    assert one is not None and one.batch == bg
    trainer = TrainerLayout((("local", 1),), 1)
    syn = [
        predict_layout(cl, m, w.model_copy(update={"max_staleness": eta}), prof,
                       [("local", 1)], trainer).synchronous
        for eta in (0, 4)
    ]  # fmt: skip
    assert syn[0] == syn[1]
    step_32 = 0.004 * (1.5 + 4.5 * 24 / 56)  # between the timed batches 8 and 64
    wave = 0.01 + bg * 34 / 8 / 3000.0 + 16 * step_32
    assert syn[0].generation_samples_per_s >= bg / wave * (1 - 1e-9)


def _busy_host(prof: Path, host_cpu_s: float, shared: float | None) -> None:
    """The profile's host work: `host_cpu_s` CPU seconds a sample, and generation beside
    it at `shared` of the server's rate alone (None: not timed)."""
    p = yaml.safe_load((prof / "profile.yaml").read_text())
    p["kinds"]["CPU"].update(host_cpu_s_per_sample=host_cpu_s, generation_efficiency_shared=shared)
    (prof / "profile.yaml").write_text(yaml.safe_dump(p))


def test_a_lent_server_makes_what_the_host_work_leaves_it(tmp_path: Path) -> None:
    """On the trainer's core beside the controller: the rate measured sharing its core,
    times 1 − h·G_own (the controller's work for the server of its own); beside nothing
    (the host's work on the servers' side) the rate of one of its own."""
    from scheduler.cluster import load_cluster
    from scheduler.costmodel import rollout_config
    from scheduler.model_shape import load_model_shape
    from scheduler.predict import LayoutError, TrainerLayout, predict_layout
    from scheduler.profile import load_profile
    from scheduler.workload import load_workload

    d = _profile(tmp_path)
    _busy_host(d, 0.0005, 0.5)
    cl, m = load_cluster(d / "cluster.yaml"), load_model_shape(str(d / "model"))
    w, prof = load_workload(d / "workload.yaml"), load_profile(d / "profile.yaml")
    trainer, servers = TrainerLayout((("local", 1),), 1), [("local", 1)] * 2
    alone = rollout_config(cl, cl.spec.node_groups[0], 1, m, w, prof)
    assert alone is not None and w.host_work == "trainer"
    r = alone.samples_per_s  # efficiency 1 (not profiled): beside the host work 0.5 of it
    for host, expect in (("trainer", 0.5 * r * (1 - 0.0005 * r)), ("rollout", r)):
        wh = w.model_copy(update={"host_work": host})
        got = predict_layout(cl, m, wh, prof, servers, trainer, lent=1).lent_samples_per_s
        assert got == pytest.approx(expect)
        assert predict_layout(cl, m, wh, prof, servers, trainer).lent_samples_per_s == 0.0
    with pytest.raises(LayoutError, match="2 lent of 2 rollout instances"):
        predict_layout(cl, m, w, prof, servers, trainer, lent=2)


def test_hybrid_sync_below_the_split_where_the_lent_core_is_busy(tmp_path: Path) -> None:
    """Synchronous: a lent server on a core the controller keeps busy takes whole groups
    at a fraction of the rate, so the batch ends later than on the server of its own
    alone; with its core free it ends sooner. A dearer switch lowers the synchronous
    hybrid; the asynchronous one, whose busy lent server's first group outlasts the
    trainer's wait, lends nothing and pays no switch."""
    prof = _profile(tmp_path)
    free = _rate(_cfg("hybrid-sync"), prof)
    split = _rate(_cfg("disaggregated-sync"), prof)
    assert free > split
    _busy_host(prof, 0.002, 0.3)
    busy = _rate(_cfg("hybrid-sync"), prof)
    assert busy < _rate(_cfg("disaggregated-sync"), prof)
    b = 8 * 16
    p = yaml.safe_load((prof / "profile.yaml").read_text())
    dearer = tmp_path / "dearer"
    shutil.copytree(prof, dearer)
    p["kinds"]["CPU"]["context_switch_s"] = 3 * SWITCH_S
    (dearer / "profile.yaml").write_text(yaml.safe_dump(p))
    assert _rate(_cfg("hybrid-sync"), dearer) < _rate(_cfg("hybrid-sync"), prof)
    split = _rate(_cfg("disaggregated-async"), prof)
    assert _rate(_cfg("hybrid-async"), dearer) == _rate(_cfg("hybrid-async"), prof)
    assert _rate(_cfg("hybrid-async"), prof) == pytest.approx(split)
    assert b / _rate(_cfg("hybrid-sync"), dearer) == pytest.approx(b / busy + 2 * SWITCH_S)


def test_every_core_rates_scale_with_the_kind() -> None:
    from scheduler.profile import DeviceRates

    r = DeviceRates(
        device="cpu",
        decode_context=40,
        **_rates(0.004, 3000.0, 6000.0),
        train_sync_tokens_per_s=5000.0,
        every_core={
            **_rates(0.002, 5000.0, 9000.0),
            "inference_threads": 2,
            "trainer_threads": 2,
        },  # fmt: skip
    )
    shared = r.on_every_core()
    assert shared.decode_step_s[1] == 0.002 and shared.train_tokens_per_s == 9000.0
    assert shared.train_sync_tokens_per_s == pytest.approx(7500.0)
    assert shared.every_core is None and shared.on_every_core() == shared
    fast = r.at_speed(2.0).on_every_core()
    assert fast.decode_step_s[1] == pytest.approx(0.001)
    assert fast.prefill_tokens_per_s == pytest.approx(10000.0)


def test_a_hybrid_trainer_steps_at_its_trimmed_rate(tmp_path: Path) -> None:
    """A hybrid's trainer gives its heap back every step: it is priced at the rate the
    profile timed with the trim (the training rate in both modes falls by it); the
    disaggregated run's trainer does not trim and keeps its rate."""
    from hexctl.job.predict import predict_run
    from scheduler.profile import DeviceRates

    prof = _profile(tmp_path)
    names = ("disaggregated-async", "hybrid-async", "hybrid-sync")

    def training() -> dict[str, float]:
        out = {}
        for name in names:
            side = "synchronous" if MODES[name].run_mode == "sync" else "asynchronous"
            out[name] = predict_run(_cfg(name), None, prof)[side]["training_samples_per_s"]
        return out

    before = training()
    p = yaml.safe_load((prof / "profile.yaml").read_text())
    p["kinds"]["CPU"]["train_trim_tokens_per_s"] = 0.8 * 30000.0
    (prof / "profile.yaml").write_text(yaml.safe_dump(p))
    after = training()
    assert after["disaggregated-async"] == before["disaggregated-async"]
    assert after["hybrid-async"] < before["hybrid-async"]
    assert after["hybrid-sync"] < before["hybrid-sync"]
    r = DeviceRates(
        device="cpu",
        decode_context=40,
        **_rates(0.004, 3000.0, 6000.0),
        train_sync_tokens_per_s=5000.0,
        train_trim_tokens_per_s=4800.0,
    )
    trimmed = r.with_heap_trim()
    assert trimmed.train_tokens_per_s == 4800.0
    assert trimmed.train_sync_tokens_per_s == pytest.approx(4000.0)
    untimed = r.model_copy(update={"train_trim_tokens_per_s": None})
    assert untimed.with_heap_trim() == untimed
    assert r.at_speed(2.0).train_trim_tokens_per_s == pytest.approx(9600.0)


def test_a_prediction_is_made_once_per_inputs(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The launcher prices each placement `auto` may pick from the kept profile, then
    predicts the picked run again from the run's copy of it: the same inputs (config
    values, files' contents) are predicted once; another value, or a changed file, anew."""
    from hexctl.job import predict as pr

    made = []

    def counted(*args):  # type: ignore[no-untyped-def]
        made.append(args)
        return real(*args)

    real = pr._predict
    monkeypatch.setattr(pr, "_MADE", {})
    monkeypatch.setattr(pr, "_predict", counted)
    prof = _profile(tmp_path)
    first = pr.predict_run(_cfg("disaggregated-async"), None, prof)
    first["asynchronous"]["pipeline_samples_per_s"] = -1.0  # the caller's own copy
    again = pr.predict_run(_cfg("disaggregated-async", "run.run_id=x"), None, prof)
    assert len(made) == 1 and again["asynchronous"]["pipeline_samples_per_s"] > 0
    copied = shutil.copytree(prof, tmp_path / "run" / "profile")  # the run's own copy
    mine = pr.predict_run(_cfg("disaggregated-async"), None, copied)
    assert len(made) == 1 and mine == {**again, "cluster": str(copied / "cluster.yaml")}
    more = pr.predict_run(_cfg("disaggregated-async", "buffer.groups_per_step=4"), None, prof)
    assert len(made) == 2 and more != again
    p = yaml.safe_load((prof / "profile.yaml").read_text())
    p["kinds"]["CPU"]["train_tokens_per_s"] *= 2
    (prof / "profile.yaml").write_text(yaml.safe_dump(p))
    faster = pr.predict_run(_cfg("disaggregated-async", "run.run_id=x"), None, prof)
    assert len(made) == 3 and faster != again
