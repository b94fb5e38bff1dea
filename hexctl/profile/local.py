"""`areal-hex profile --local`: this machine as a cluster, measured with the real engines.

The devices are what `areal-hex run` uses here: on a CUDA host the GPUs (one kind); on a
CPU-only host the two core groups `run.pin_cores` makes (the inference servers' cores and
the trainer's cores), each timed while pinned to its own cores with the thread count the
run gives it. What is timed is the job's own code on the job's model:

- generation: an `areal-hex serve` process on the inference cores, driven over HTTP as
  the run's controller drives it: decode step time at several batches (from two answer
  lengths, so the prefill cancels), prefill tokens/s, the answer lengths the initial
  policy really produces on the dataset's prompts with the run's sampling parameters,
  and the rate the run's own controller keeps it at (beside the trainer and beside it);
- training: `trainer_service.step.optimize` under DeepSpeed (one rank, in a process of
  its own) on groups shaped like the run's batch (prompt and answer lengths as
  measured);
- weight sync: the engine's reload of a published weights directory;
- with `every_core` (a colocated run's `run.profile_first`), on a CPU host whose run pins
  the sides apart: one server's decode steps and prefill, and the trainer's step, each on
  every core (`every_core.py`), for the colocated price. One profile of the
  disaggregated split prices every placement (`cache.profiled_job`).

Writes `cluster.yaml`, `profile.yaml`, `workload.yaml` and `model/config.json` into one
directory, the inputs of `areal-hex plan`:

    areal-hex plan DIR/cluster.yaml --model DIR/model --workload DIR/workload.yaml \\
        --profile DIR/profile.yaml --budget N
"""

from __future__ import annotations

import json
import shutil
import socket
import time
from pathlib import Path
from typing import Any

import yaml

from areal_hex.config import ExperimentConfig
from hexctl.job.predict import LocalProfileFiles
from hexctl.profile.controller import LOCAL_GROUP, composed_rate, replayed_cycle_s
from hexctl.profile.devices import LocalDevices, Say, local_devices, passive_waits, quiet
from hexctl.profile.every_core import every_core_devices, measure_every_core
from hexctl.profile.generation import GenerationRates, measure_generation
from hexctl.profile.lengths import run_response_tokens
from hexctl.profile.training import measure_training

LOCAL_ZONE = "local"


def _progress(say: Say) -> Say:
    """`say` with the seconds since the profile began in front of each line."""
    t0 = time.monotonic()
    return lambda text: say(f"profile {time.monotonic() - t0:5.0f} s: {text}")


def profile_local(
    cfg: ExperimentConfig,
    out: Path,
    batches: list[int] | None = None,
    dev: LocalDevices | None = None,
    say: Say | None = None,
    every_core: bool = False,
) -> LocalProfileFiles:
    """Measure this machine for `cfg`'s job and write the planner's inputs into `out`;
    `dev`: the devices to time (default: those `run` uses here); `say` hears each stage
    as it begins (with the seconds so far); `every_core`: also time each side on every
    core, for a colocated run's price (`every_core.py`; where the sides are apart)."""
    from scheduler.model_shape import load_model_shape
    from scheduler.profile import DeviceRates, EveryCore, Profile, save_profile

    files = LocalProfileFiles(out)
    out.mkdir(parents=True, exist_ok=True)
    from hexctl.job.prepare import initial_model_dir

    model_dir = initial_model_dir(cfg, out)
    dev = dev or local_devices(cfg)
    cap = cfg.inference.max_running_requests
    batches = sorted({b for b in (batches or [1, 8, 32, cap]) if 0 < b <= cap} | {cap})
    say = _progress(say) if say is not None else quiet
    with passive_waits(dev):
        gen = measure_generation(cfg, model_dir, dev, batches, say)
        prompt = int(gen.prompt_tokens)
        train = measure_training(cfg, model_dir, dev, prompt, gen.response_tokens, say)
    every = every_core_devices(cfg, dev) if every_core else None
    shared = None
    if every is not None:  # a colocated run's phases: each on every core
        shared = measure_every_core(
            cfg, model_dir, every, batches, prompt, gen.response_tokens, say
        )
    say("training timed; writing the profile")
    files.model.mkdir(parents=True, exist_ok=True)
    if files.model.resolve() != model_dir.resolve():
        shutil.copy(model_dir / "config.json", files.model / "config.json")
    shape = load_model_shape(str(files.model / "config.json"))
    rates = DeviceRates(
        device=dev.device if dev.device == "cpu" else dev.kind,
        decode_step_s=gen.decode_step_s,
        decode_context=int(gen.prompt_tokens + gen.response_tokens / 2),
        prefill_tokens_per_s=gen.prefill_tokens_per_s,
        score_tokens_per_s=gen.score_tokens_per_s,
        score_concurrent_tokens_per_s=gen.score_concurrent_tokens_per_s,
        score_concurrency=gen.score_concurrency,
        classify_tokens_per_s=gen.classify_tokens_per_s,
        classify_concurrency=gen.classify_concurrency,
        train_tokens_per_s=train.tokens_per_s,
        train_sync_tokens_per_s=train.quiet_tokens_per_s,
        train_trim_tokens_per_s=train.trim_tokens_per_s,
        train_publish_s=train.publish_s,
        train_broadcast_s=train.broadcast_s,
        train_broadcast_pair_s=train.broadcast_pair_s,
        train_after_send_s=train.after_send_s if train.publish_sync == "network" else None,
        train_checkpoint_s=train.checkpoint_s,
        reload_idle_s=gen.reload_idle_s,
        # the server's part; the trainer on a CPU gives nothing back (its threads sleep)
        context_switch_s=gen.context_switch_s,
        every_core=EveryCore(**shared) if shared is not None else None,
    )
    prof = Profile(model=str(files.model), params=shape.params, kinds={dev.kind: rates})
    spec = cluster_spec(dev, shape.params, gen, train.tokens_per_s)
    files.cluster.write_text(yaml.safe_dump(spec, sort_keys=False))
    # the timings calibrated at the lengths they were timed with (the initial policy's)
    files.workload.write_text(yaml.safe_dump(workload_for(cfg, gen), sort_keys=False))
    # what the timings compose to for this job, against what the controller then reached
    mine = prof.kinds[dev.kind]
    composed = composed_rate(files, prof)
    at = efficiency_at(files, prof, gen)
    mine.generation_efficiency = gen.continuous_samples_per_s / composed
    mine.generation_efficiency_at = at
    if gen.continuous_shared_samples_per_s is not None:
        mine.generation_efficiency_shared = gen.continuous_shared_samples_per_s / composed
        mine.reload_shared_s = gen.reload_shared_s
    mine.host_cpu_s_per_sample = gen.host_cpu_s_per_sample
    mine.reload_overlap_s = gen.reload_overlap_s
    if gen.reload_under_load_sync is not None:
        mine.reload_overlap_sync = gen.reload_under_load_sync  # type: ignore[assignment]
    mine.sync_cycle_factor = gen.sync_cycle_s / replayed_cycle_s(files, prof)
    save_profile(prof, files.profile)
    # the run's answers priced at the length they will have on average (`lengths.py`)
    run_lengths = workload_for(cfg, gen, run_length=True)
    files.workload.write_text(yaml.safe_dump(run_lengths, sort_keys=False))
    cores = {
        "inference_cores": sorted(dev.inference_cores or []),
        "trainer_cores": sorted(dev.trainer_cores or []),
    }
    measured = {
        "devices": {**dev.__dict__, **cores},
        "generation": gen.__dict__,
        "train_tokens_per_s": train.tokens_per_s,
        "train_sync_tokens_per_s": train.quiet_tokens_per_s,
        "train_trim_tokens_per_s": train.trim_tokens_per_s,
        "train_trim_step_ratio": train.trim_step_ratio,
        "train_trim_call_s": train.trim_call_s,
        "train_trim_call_cpu_s": train.trim_call_cpu_s,
        "train_publish_sync": train.publish_sync,
        "train_broadcast_s": train.broadcast_s,
        "train_broadcast_pair_s": train.broadcast_pair_s,
        "train_after_send_s": train.after_send_s,
        "train_publish_s": train.publish_s,
        "train_checkpoint_s": train.checkpoint_s,
        "generation_efficiency": mine.generation_efficiency,
        "generation_efficiency_shared": mine.generation_efficiency_shared,
        "generation_efficiency_at": at,
        "sync_cycle_factor": mine.sync_cycle_factor,
        "reload_overlap_s": mine.reload_overlap_s,
        "every_core": shared,
    }
    files.measured.write_text(json.dumps(measured, indent=2))
    return files


def efficiency_at(
    files: LocalProfileFiles, prof: Any, gen: GenerationRates
) -> dict[int, float] | None:
    """The continuous loads' samples/s over the rate the timings compose to at the batch
    each load held (`DeviceRates.generation_efficiency_at`); None where the load's batch
    was not recorded."""
    if gen.continuous_batch is None:
        return None
    loads = {gen.continuous_batch: gen.continuous_samples_per_s}
    if gen.continuous_full_batch is not None and gen.continuous_full_samples_per_s:
        loads[gen.continuous_full_batch] = gen.continuous_full_samples_per_s
    return {b: rate / composed_rate(files, prof, b) for b, rate in loads.items()}


def cluster_spec(
    dev: LocalDevices, params: int, gen: GenerationRates, train_tokens_per_s: float
) -> dict[str, Any]:
    """One machine, one node group of `dev.count` devices. The kind's figures, for a CPU,
    are the effective ones measured: bandwidth = weight bytes (bf16, as the cost model
    counts them) / one decode step at batch 1; compute = 6N·tokens/s at the cost model's
    training MFU. The weight-sync latency is the engine's measured reload."""
    from scheduler.workload import CostConstants

    spec: dict[str, Any] = {
        "name": f"local-{socket.gethostname()}",
        "zones": [
            {
                "name": LOCAL_ZONE,
                "region": LOCAL_ZONE,
                "inter_node_bandwidth_gbs": 100.0,
                "inter_node_latency_ms": round(gen.reload_s * 1e3, 3),
            }
        ],
        "node_groups": [
            {
                "name": LOCAL_GROUP,
                "gpu": dev.kind,
                "gpus_per_node": dev.count,
                "nodes": 1,
                "zone": LOCAL_ZONE,
                "usd_per_gpu_hour": 1.0,
                "intra_node": {"kind": "pcie", "bandwidth_gbs": 10.0},
            }
        ],
    }
    if dev.kind == "CPU":
        step1 = gen.decode_step_s[min(gen.decode_step_s)]
        mfu = CostConstants().train_mfu
        spec["gpu_overrides"] = {
            "CPU": {
                "bf16_tflops": round(6.0 * params * train_tokens_per_s / mfu / 1e12, 6),
                "hbm_gb": round(dev.memory_gb, 2),
                "hbm_gbs": round(2.0 * params / step1 / 1e9, 6),
            }
        }
    return spec


def workload_for(
    cfg: ExperimentConfig, gen: GenerationRates, run_length: bool = False
) -> dict[str, Any]:
    """The planner's workload for `cfg`'s job, with the lengths measured here: the
    initial policy's answers, or (`run_length`) the mean a run's answers will have
    (`lengths.run_response_tokens`)."""
    response = gen.response_tokens
    if run_length:
        response = run_response_tokens(response, gen.rewarded_response_tokens)
    return {
        "groups_per_step": cfg.buffer.groups_per_step,
        "group_size": cfg.rollout.group_size,
        "prompt_tokens": max(1, round(gen.prompt_tokens)),
        "response_tokens": max(1, round(response)),
        "max_response_tokens": cfg.rollout.max_new_tokens,
        "max_staleness": cfg.buffer.max_staleness,
        "publish_every": cfg.trainer.publish_every,
        "checkpoint_every": cfg.trainer.checkpoint_every,
        # π_ref in the trainer's step, unless a reference task scores it
        "reference_model": cfg.algo.kl_coef > 0
        and cfg.workflow.task_with_role("reference") is None,
        "critic": cfg.algo.advantage == "gae",
        "rollout_tp": 1,
        "zero_stage": cfg.trainer.zero_stage,
        "weight_sync": cfg.rollout.weight_sync,
        "tasks": [t.model_dump(mode="json") for t in cfg.workflow.tasks],
        "constants": {
            "max_running_requests": cfg.inference.max_running_requests,
            # a CPU trainer publishes fp32
            "weight_sync_bytes_per_param": 4.0 if cfg.trainer.device == "cpu" else 2.0,
            "weight_sync_bucket_mb": cfg.rollout.weight_sync_bucket_mb,
        },
    }
