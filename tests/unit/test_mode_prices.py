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
    """Hybrid async from the split's rates: W = (B − G_own·T) / (G_own + G_lent), rate =
    B / (T + W + switch), the lent server priced as one of its own."""
    from hexctl.job.predict import predict_run

    prof = _profile(tmp_path)
    own = predict_run(_cfg("disaggregated-async"), None, prof)["asynchronous"]
    b = 8 * 16
    g, t = own["generation_samples_per_s"], b / own["training_samples_per_s"]
    assert g * t < b  # generation binds: something to lend
    expect = b / (t + (b - g * t) / (2 * g) + SWITCH_S)
    assert _rate(_cfg("hybrid-async"), prof) == pytest.approx(expect, rel=1e-6)
    assert _rate(_cfg("hybrid-async"), prof) > own["pipeline_samples_per_s"]


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
