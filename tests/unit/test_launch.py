"""Run preparation, process specs from the layout, weight resolution for eval."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import pytest

from areal_hex.config import load_config
from areal_hex.net import free_port_block
from hexctl.job.cores import core_groups
from hexctl.job.layout import build_layout
from hexctl.job.prepare import apply_mode
from hexctl.job.warm_start import sft_texts, without_answer_line
from hexctl.launch.run import assign_local_gpus, process_specs
from hexctl.report.evaluate import EvalError, pass_at_k, resolve_weights


def test_sync_mode_sets_eta_zero() -> None:
    cfg = load_config(None, ["buffer.max_staleness=4", "trainer.publish_every=3"])
    sync = apply_mode(cfg, "sync")
    assert sync.run.mode == "sync" and sync.buffer.max_staleness == 0
    assert sync.trainer.publish_every == 1
    assert cfg.buffer.max_staleness == 4  # the input is not changed
    assert apply_mode(cfg, "async").buffer.max_staleness == 4


def test_free_port_block_skips_a_busy_port() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = s.getsockname()[1]
        base = free_port_block(2, busy - 1)
        assert busy not in (base, base + 1)  # the block avoids the busy port
    free = free_port_block(1, busy)
    assert free == busy  # the configured port when it is free


def test_embedded_redis_stays_in_the_layout_after_resolution() -> None:
    cfg = load_config(None, ["run.run_id=r", "inference.num_servers=2"])
    assert [s.name for s in build_layout(cfg).services][0] == "redis"
    cfg.redis.url = "redis://127.0.0.1:1234/0"
    assert "redis" not in [s.name for s in build_layout(cfg).services]  # an external Redis
    cfg.run.embedded_redis = True
    names = [s.name for s in build_layout(cfg).services]
    assert names == ["redis", "inference-0", "inference-1", "controller", "trainer"]


def test_process_specs_commands_policies_and_pinning(tmp_path: Path) -> None:
    cfg = load_config(None, [f"run.output_dir={tmp_path}", "run.run_id=r", "run.pin_cores=true"])
    config = tmp_path / "r" / "config.yaml"
    specs = {s.name: s for s in process_specs(cfg, build_layout(cfg), config)}
    assert specs["trainer"].command == [sys.executable, "-m", "hexctl.cli", "train", str(config)]
    assert specs["inference-0"].command[-2:] == ["--index", "0"]
    assert specs["inference-0"].on_exit == "restart"
    assert specs["trainer"].on_exit == "finish" and specs["controller"].on_exit == "fail"
    assert specs["redis"].on_exit == "restart"  # on its append-only file
    assert all(s.restart_on_failure and s.max_restarts == 3 for s in specs.values())
    assert specs["controller"].log_path == tmp_path / "r" / "logs" / "controller.log"
    rollout, trainer = core_groups(True)
    if rollout is None:
        pytest.skip("fewer than 2 usable cores")
    assert specs["inference-0"].cpus == rollout and specs["trainer"].cpus == trainer
    assert specs["controller"].cpus == trainer and specs["redis"].cpus == trainer
    assert not rollout & trainer
    assert specs["trainer"].env["OMP_NUM_THREADS"] == str(len(trainer))
    assert specs["controller"].env["OMP_NUM_THREADS"] == "1"
    # run.host_cores: inference puts Valkey and the controller beside the servers
    beside = {s.name: s for s in process_specs(cfg, build_layout(cfg), config, "inference")}
    assert beside["controller"].cpus == rollout and beside["redis"].cpus == rollout
    assert beside["trainer"].cpus == trainer and beside["inference-0"].cpus == rollout


def test_host_side_follows_the_faster_predicted_pipeline(monkeypatch) -> None:
    from hexctl.job import predict as pr

    rates = {"trainer": 500.0, "inference": 600.0}

    def fake(cfg, plan, profile_dir, host="trainer"):
        return {"asynchronous": {"pipeline_samples_per_s": rates[host]}, "host_cores": host}

    monkeypatch.setattr(pr, "predict_run", fake)
    cfg = load_config(None, ["run.pin_cores=true"])
    side, pred = pr.host_side(cfg)
    assert side == "inference" and pred["host_cores"] == "inference"
    assert pred["host_cores_candidates"] == rates
    rates["inference"] = 400.0
    assert pr.host_side(cfg)[0] == "trainer"
    for fixed in ("trainer", "inference"):  # an explicit choice is kept
        assert pr.host_side(load_config(None, [f"run.host_cores={fixed}"]))[0] == fixed
    rates["inference"] = 900.0
    sync = load_config(None, ["run.pin_cores=true", "run.mode=sync"])
    assert pr.host_side(sync)[0] == "trainer"  # the trainer waits while they work
    assert pr.host_side(load_config(None, ["run.pin_cores=false"]))[0] == "trainer"
    # without a profile (the run's prediction unavailable) a named side holds still
    why = {"unavailable": "no profile of this machine for this job"}
    named = load_config(None, ["run.pin_cores=true", "run.host_cores=inference"])
    assert pr.host_side(named, unavailable=why) == ("inference", why)
    assert pr.host_side(cfg, unavailable=why) == ("trainer", why)


def test_local_gpus_are_handed_out_in_layout_order() -> None:
    cfg = load_config(
        None,
        [
            "inference.device=cuda",
            "inference.num_servers=2",
            "inference.sglang.tp_size=2",
            "trainer.device=cuda",
            "trainer.num_ranks=3",
        ],
    )
    layout = build_layout(cfg)
    assign_local_gpus(layout)
    got = {s.name: s.devices for s in layout.services}
    assert got["inference-0"] == [0, 1] and got["inference-1"] == [2, 3]
    assert got["trainer"] == [4, 5, 6] and got["controller"] == []


def test_resolve_weights_versions_and_errors(tmp_path: Path) -> None:
    cfg = load_config(None, [f"run.output_dir={tmp_path}", "run.run_id=r"])
    root = tmp_path / "r" / "weights"
    for v in (0, 3, 12):
        (root / f"v{v}").mkdir(parents=True)
        (root / f"v{v}" / "config.json").write_text("{}")
    (root / "v13.tmp").mkdir()  # an unfinished write is not a version
    assert resolve_weights(cfg, "latest") == (root / "v12", "12")
    assert resolve_weights(cfg, "v3") == (root / "v3", "3")
    assert resolve_weights(cfg, "0") == (root / "v0", "0")
    assert resolve_weights(cfg, str(root / "v3")) == (root / "v3", "3")
    with pytest.raises(EvalError, match=r"version 5 not in .* \(have \[0, 3, 12\]\)"):
        resolve_weights(cfg, "v5")
    with pytest.raises(EvalError, match="expected a weights directory"):
        resolve_weights(cfg, "newest")
    with pytest.raises(EvalError, match="no config.json"):
        resolve_weights(cfg, str(tmp_path))


def test_pass_at_k() -> None:
    assert pass_at_k([[False, True], [False, False], [True, True]]) == pytest.approx(2 / 3)
    assert pass_at_k([]) == 0.0


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="no CPU affinity")
def test_core_groups_off_means_no_pinning() -> None:
    assert core_groups(False) == (None, None)


def test_bench_steady_rate_skips_the_head_start(tmp_path: Path) -> None:
    import json

    from hexctl.bench.system.e2e import steady_rate

    rows = [  # 3 quick steps (prefilled batches), then one step every 2 s
        {"step": 1, "time": 0.0, "groups_trained_total": 4},
        {"step": 2, "time": 0.1, "groups_trained_total": 8},
        {"step": 3, "time": 0.2, "groups_trained_total": 12},
        {"step": 4, "time": 2.2, "groups_trained_total": 16},
        {"step": 5, "time": 4.2, "groups_trained_total": 20},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert steady_rate(tmp_path, 8, skip=3) == pytest.approx(8 * 8 / 4.0)
    assert steady_rate(tmp_path, 8, skip=1) == pytest.approx(16 * 8 / 4.2)


def test_warm_start_keeps_the_answer_line_on_the_configured_share() -> None:
    from areal_hex.models import build_tokenizer

    tok = build_tokenizer()
    over = ["data.arithmetic.max_value=19", "data.arithmetic.test_fraction=0.2"]
    full = sft_texts(load_config(None, [*over, "run.warm_start_fraction=1.0"]), tok)
    cfg = load_config(
        None, [*over, "run.warm_start_fraction=1.0", "run.warm_start_answer_fraction=0.4"]
    )
    texts = sft_texts(cfg, tok)
    assert len(texts) == len(full) == 322 and all("####" in t for t in full)
    kept = [t for t in texts if "####" in t]
    assert 0.3 < len(kept) / len(texts) < 0.5
    assert set(kept) <= set(full)  # kept ones are untouched
    for t in texts:
        assert t.endswith(tok.eos_token)
        if "####" not in t:  # the working is all there, ending with the sum
            assert t.removesuffix(tok.eos_token).split("\n")[-1].count("=") == 1
    assert sft_texts(cfg, tok) == texts  # chosen by run.seed: reproducible
    assert without_answer_line("3 + 4 = 7\n#### 7") == "3 + 4 = 7"
    assert without_answer_line("#### 7") == "#### 7"  # nothing would be left
    assert without_answer_line("no answer line") == "no answer line"


def test_a_benchmark_refuses_the_run_directory_of_an_earlier_one(tmp_path):
    """A benchmark's run in an earlier one's directory would resume it and report its
    figures: refused with the path and what to do, before anything starts."""
    from areal_hex.config import ConfigError
    from hexctl.bench.system.e2e import fresh_run_dir

    fresh_run_dir(tmp_path / "bench-async")  # missing: fine
    (tmp_path / "bench-async").mkdir()
    fresh_run_dir(tmp_path / "bench-async")  # empty: fine
    (tmp_path / "bench-async" / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(ConfigError, match=r"bench-async holds a run .* new --output-dir"):
        fresh_run_dir(tmp_path / "bench-async")
