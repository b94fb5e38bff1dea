"""This machine as a cluster, end to end and small: `profile --local` -> `plan` -> `run
--plan`, and the run's summary holds the plan's prediction next to what it measured."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from areal_hex.plan import load_plan

ROOT = Path(__file__).resolve().parents[2]
SMALL = [
    "model.tiny.sft_steps=0",
    "buffer.groups_per_step=2",
    "rollout.group_size=4",
    "rollout.max_new_tokens=8",
    "rollout.max_concurrent_groups=4",
    "rollout.metrics_interval_s=0.5",
    "inference.max_running_requests=16",
    "trainer.total_steps=5",
    "trainer.checkpoint_every=5",
]


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "hexctl.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=500,
    )


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_profile_local_plan_run(tmp_path: Path) -> None:
    lp = tmp_path / "local"
    r = cli("profile", "--local", "--out-dir", str(lp), "--batches", "1,16", *SMALL)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "next: areal-hex plan" in r.stdout
    # each stage said on stderr as it begins, with the seconds so far
    assert "areal-hex profile: profile" in r.stderr and "training" in r.stderr
    spec = yaml.safe_load((lp / "cluster.yaml").read_text())
    assert spec["node_groups"][0]["gpu"] == "CPU" and spec["node_groups"][0]["gpus_per_node"] == 2
    rates = yaml.safe_load((lp / "profile.yaml").read_text())["kinds"]["CPU"]
    assert {int(b) for b in rates["decode_step_s"]} == {1, 16} and rates["reload_idle_s"] > 0
    # the run's controller kept the server full: its rate against the timings', its CPU
    assert 0.05 < rates["generation_efficiency"] < 5 and rates["host_cpu_s_per_sample"] > 0
    assert 0.05 < rates["sync_cycle_factor"] < 20  # publish -> next batch, over the replay
    work = yaml.safe_load((lp / "workload.yaml").read_text())
    assert (work["groups_per_step"], work["group_size"], work["max_response_tokens"]) == (2, 4, 8)

    plan_path = tmp_path / "plan.yaml"
    p = cli(
        "plan", str(lp / "cluster.yaml"), "--model", str(lp / "model"), "--workload",
        str(lp / "workload.yaml"), "--profile", str(lp / "profile.yaml"), "--budget", "2",
        "--out", str(plan_path),
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    plan = load_plan(plan_path)
    # the plan's shape follows what this noisy machine measured, so only what holds for
    # any pick is asserted: it fits the node's two devices, the trainer has at least one,
    # and a disaggregated pick keeps the pools apart (a hybrid pick lends the trainer's
    # device to generation: its lent instances sit there)
    trainer_slots = {(s.node, tuple(s.gpu_ids)) for s in plan.trainer.placements}
    rollout_slots = {(r.placement.node, tuple(r.placement.gpu_ids)) for r in plan.rollout}
    used = {(node, g) for node, ids in trainer_slots | rollout_slots for g in ids}
    assert len(used) <= 2 and 1 <= plan.trainer.world_size <= 2 and plan.rollout
    own = {
        (r.placement.node, tuple(r.placement.gpu_ids))
        for i, r in enumerate(plan.rollout)
        if i not in plan.decisions.lent
    }
    if plan.decisions.placement != "colocated":
        assert not own & trainer_slots, (plan.decisions.placement, own, trainer_slots)
    for i in plan.decisions.lent:
        lent = plan.rollout[i].placement
        assert (lent.node, tuple(lent.gpu_ids)) in trainer_slots
    assert plan.sources is not None and plan.sources.profile == str(lp / "profile.yaml")

    out = tmp_path / "runs"
    run = cli(
        "run", str(ROOT / "examples" / "tiny_cpu.yaml"), *SMALL, f"run.output_dir={out}",
        "run.run_id=planned", "--plan", str(plan_path), "--no-progress",
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    run_dir = out / "planned"
    summary = json.loads((run_dir / "summary.json").read_text())
    block = summary["fidelity"]
    assert block["source"] == "plan" and block["mode"] == "async"
    assert block["predicted"]["pipeline_samples_per_s"] == pytest.approx(
        json.loads((run_dir / "prediction.json").read_text())["asynchronous"][
            "pipeline_samples_per_s"
        ]
    )
    assert block["measured"]["pipeline_samples_per_s"] > 0
    assert block["measured"]["training_samples_per_s"] > 0
    err = block["relative_error"]["pipeline_samples_per_s"]
    meas = block["measured"]["pipeline_samples_per_s"]
    assert err == pytest.approx(block["predicted"]["pipeline_samples_per_s"] / meas - 1)
    assert "report/fidelity.png" in summary["plots"]

    # a run without a plan is priced for the layout it runs, from the local profile
    from areal_hex.config import load_config
    from hexctl.job.predict import predict_run

    cfg = load_config(run_dir / "config.yaml")
    host = json.loads((run_dir / "prediction.json").read_text())["host_cores"]
    planless = predict_run(cfg, None, lp, host)
    assert planless["source"] == "local profile"
    assert planless["asynchronous"] == pytest.approx(
        json.loads((run_dir / "prediction.json").read_text())["asynchronous"]
    )
    assert "no plan and no local profile" in predict_run(cfg, None, None)["unavailable"]


@pytest.mark.timeout(300)
def test_training_profile_twice_in_one_process(tmp_path: Path) -> None:
    """A process that profiles twice (`bench e2e`: one `run.profile_first` per run) times
    training both times: each measurement gets a process of its own, so DeepSpeed's
    cached process groups of the first do not break the second."""
    from areal_hex.config import load_config
    from hexctl.job.prepare import materialize_v0
    from hexctl.profile.devices import local_devices
    from hexctl.profile.training import measure_training

    cfg = load_config(ROOT / "examples/tiny_cpu.yaml", SMALL)
    model_dir = materialize_v0(cfg, tmp_path)
    dev = local_devices(cfg)
    # one round of one step after the warm-up: the subject is the second process's
    # DeepSpeed set-up, not the rate
    rates = [measure_training(cfg, model_dir, dev, 10, 6.0, rounds=(1, 1)) for _ in range(2)]
    assert all(r.tokens_per_s > 0 for r in rates)
    # the step published its weights (publish_every 1) and two checkpoints were written
    assert all(r.publish_s is not None and r.publish_s >= 0 for r in rates)
    assert all(r.checkpoint_s > 0 for r in rates)
    # on a CPU each round is followed by one whose steps trim the heap (a hybrid's trainer)
    assert all(r.trim_tokens_per_s is not None and r.trim_tokens_per_s > 0 for r in rates)
