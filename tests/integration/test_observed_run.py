"""A short `areal-hex run` of the tiny example, observed the three ways a user would:
TensorBoard and W&B (offline) through `run.trackers`, both services' `/metrics` scraped
mid-run, and the report's ledger, with dynamic sampling on.

- every scalar the trackers logged equals the row of `metrics.jsonl` it came from;
- each scrape parses with prometheus_client's text parser and carries exactly the names
  `areal_hex.prom` lists for that service (the inference server: SGLang's), with values
  of the rows written so far;
- produced = trained + dropped stale + dead letters + filtered + pending + in flight
  (the run's ledger, docs/running.md), the filtered count equal to the controller's.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from tracker_files import tensorboard_scalars, wandb_history

from areal_hex.net import free_port
from areal_hex.prom import BUFFER_NAMES, ROLLOUT_NAMES, TRAINER_NAMES
from areal_hex.run_files import RolloutRow, RunPaths, TrainerRow, read_rows
from areal_hex.trackers import scalars

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tiny_cpu.yaml"
STEPS = 6
PORT_LINE = re.compile(r"metrics on port (\d+)")
# The inference server's own names, SGLang's (docs/observability.md)
INFERENCE_NAMES = {
    "sglang:" + n
    for n in (
        "num_running_reqs", "num_queue_reqs", "gen_throughput", "is_paused", "weight_version",
        "generation_tokens_total", "prompt_tokens_total", "num_requests_total",
        "num_aborted_requests_total", "weight_updates_total", "prefill_batches_total",
        "decode_steps_total",
    )
}  # fmt: skip


def metrics_ports(run_dir: Path) -> dict[str, int]:
    """The ports the trainer and the controller logged (`... metrics on port N`)."""
    ports = {}
    for service in ("trainer", "controller"):
        log = RunPaths.at(run_dir).log(service)
        found = PORT_LINE.search(log.read_text()) if log.exists() else None
        if found:
            ports[service] = int(found.group(1))
    return ports


def scrape_mid_run(run_dir: Path, proc: subprocess.Popen[str], server: int) -> dict[str, str]:
    """Every service's /metrics (the inference server's on its own `server` port) once
    the trainer has written two steps."""
    deadline = time.monotonic() + 600
    metrics = RunPaths.at(run_dir).metrics
    while time.monotonic() < deadline and proc.poll() is None:
        ports = metrics_ports(run_dir)
        if len(ports) == 2 and len(read_rows(metrics, TrainerRow)) >= 2:
            ports["inference"] = server
            out = {}
            for service, port in ports.items():
                url = f"http://127.0.0.1:{port}/metrics"
                with urllib.request.urlopen(url, timeout=10) as r:
                    out[service] = r.read().decode()
            return out
        time.sleep(0.2)
    return {}


def samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if not s.name.endswith("_created"):
                out.setdefault(s.name, []).append((s.labels, s.value))
    return out


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_observed_run_trackers_scrapes_and_ledger(tmp_path: Path) -> None:
    server_port = free_port()
    overrides = [
        f"run.output_dir={tmp_path}",
        "run.run_id=obs",
        "run.trackers=[tensorboard,wandb]",
        "run.profile_first=false",  # the README's run profiles first; not this one's subject
        "run.warm_start_answer_fraction=1.0",
        "model.tiny.sft_steps=300",  # rewards that differ within a group (dynamic sampling)
        f"trainer.total_steps={STEPS}",
        "trainer.checkpoint_every=3",
        "trainer.metrics_port=0",
        "rollout.metrics_port=0",
        "rollout.group_size=4",
        "rollout.dynamic_sampling=true",
        "rollout.dynamic_sampling_max_factor=16",
        "buffer.groups_per_step=4",
        "inference.gpu_kinds=[L40S]",
        f"inference.base_port={server_port}",
    ]
    run_dir = tmp_path / "obs"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_SILENT": "true", "WANDB_MODE": "offline"}
    env["OMP_NUM_THREADS"] = "1"  # a busy machine: spinning intra-op threads cost ~10x
    proc = subprocess.Popen(
        [sys.executable, "-m", "hexctl.cli", "run", str(EXAMPLE), *overrides, "--no-progress"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )
    try:
        scraped = scrape_mid_run(run_dir, proc, server_port)
        _, stderr = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr[-4000:]
    paths = RunPaths.at(run_dir)
    rows = read_rows(paths.metrics, TrainerRow)
    assert [r.step for r in rows] == list(range(1, STEPS + 1))

    # Prometheus: exactly the listed names, values from the rows
    assert set(scraped) == {"trainer", "controller", "inference"}, "no scrape before the end"
    trainer, controller = samples(scraped["trainer"]), samples(scraped["controller"])
    assert set(samples(scraped["inference"])) == INFERENCE_NAMES
    assert set(trainer) == set(TRAINER_NAMES + BUFFER_NAMES)
    assert set(controller) == set(ROLLOUT_NAMES)
    step = int(trainer["areal_hex_trainer_step"][0][1])
    at = rows[step - 1]
    assert trainer["areal_hex_trainer_tokens_total"] == [({"gpu_kind": "CPU"}, at.tokens_total)]
    phases = {lab["phase"]: v for lab, v in trainer["areal_hex_trainer_step_phase_seconds_count"]}
    assert phases == dict.fromkeys(("wait", "compute", "publish", "checkpoint"), step)
    (wait_sum,) = [v for lab, v in trainer["areal_hex_trainer_step_phase_seconds_sum"]
                   if lab["phase"] == "wait"]  # fmt: skip
    assert wait_sum == pytest.approx(sum(r.wait_s for r in rows[:step]))
    kinds = {lab["gpu_kind"] for lab, _ in controller["areal_hex_rollout_server_tokens_total"]}
    assert kinds == {"L40S"}
    assert controller["areal_hex_rollout_server_healthy"][0][1] == 1
    assert controller["areal_hex_rollout_gate_wait_seconds_count"][0][1] >= 2 * 4

    # trackers: every scalar equals the row it came from
    expected = {r.step: scalars(r, "trainer") for r in rows}
    tb = tensorboard_scalars(run_dir / "tensorboard" / "trainer")
    assert set(tb) == set().union(*expected.values())
    for s, values in expected.items():
        for tag, value in values.items():
            assert tb[tag][s] == pytest.approx(value, rel=1e-6), (tag, s)
    histories = [wandb_history(f) for f in (run_dir / "wandb").glob("offline-run-*/run-*.wandb")]
    (history,) = [h for h in histories if h and "trainer/loss" in h[0]]
    assert [int(h["_step"]) for h in history] == list(expected)
    for h in history:
        values = {k: v for k, v in h.items() if not k.startswith("_")}
        assert values == pytest.approx(expected[int(h["_step"])])

    # the ledger, dynamic sampling's filtered groups included
    summary = json.loads(paths.summary.read_text())
    final = [r for r in read_rows(paths.rollout, RolloutRow) if r.final][-1]
    assert summary["groups_filtered"] == final.groups_filtered_total > 0
    assert summary["buffer"]["given_back"]["filtered"] == final.groups_filtered_total
    assert summary["groups_trained"] == STEPS * 4
    assert summary["groups_produced"] == (
        summary["groups_trained"]
        + summary["groups_dropped_stale"]
        + summary["groups_dead_letter"]
        + summary["groups_filtered"]
        + summary["groups_pending"]
        + summary["groups_in_flight"]
    )
    assert summary["groups_lost"] == 0
