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
- weight sync: the engine's reload of a published weights directory.

Writes `cluster.yaml`, `profile.yaml`, `workload.yaml` and `model/config.json` into one
directory, the inputs of `areal-hex plan`:

    areal-hex plan DIR/cluster.yaml --model DIR/model --workload DIR/workload.yaml \\
        --profile DIR/profile.yaml --budget N
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from areal_hex.config import ExperimentConfig
from areal_hex.gc_freeze import freeze_startup
from hexctl.job.predict import LocalProfileFiles
from hexctl.job.processes import stop_process
from hexctl.profile.controller import (
    LOCAL_GROUP,
    composed_rate,
    continuous_load,
    replayed_cycle_s,
    sync_cycle,
)
from hexctl.profile.devices import LocalDevices, local_devices, pinned

LOCAL_ZONE = "local"
REPEATS = 3  # median of: the machine may be shared, and the run will see the same load
TRAIN_STEPS = 10  # per timed round (REPEATS of them) after a warm-up step

Say = Callable[[str], None]


def _quiet(_text: str) -> None:
    pass


def _progress(say: Say) -> Say:
    """`say` with the seconds since the profile began in front of each line."""
    t0 = time.monotonic()
    return lambda text: say(f"profile {time.monotonic() - t0:5.0f} s: {text}")


# ---------------------------------------------------------------- generation
@dataclass
class GenerationRates:
    decode_step_s: dict[int, float]
    prefill_tokens_per_s: float
    prompt_tokens: float  # mean over the dataset's prompts
    response_tokens: float  # mean answer length of the initial policy
    reload_s: float  # pause -> load -> resume of a server with requests in flight
    reload_idle_s: float  # the same with nothing in flight (a synchronous run's case)
    # The run's own controller keeping the server full (an asynchronous run's load):
    continuous_samples_per_s: float  # samples/s generated
    host_cpu_s_per_sample: float  # the controller's CPU (HTTP, decoding, rewards, records)
    # ... with the controller, its Valkey and reward workers on the server's cores
    # (None without pinning: they share every core anyway)
    continuous_shared_samples_per_s: float | None
    reload_shared_s: float | None  # a weight update's pause under that load
    # ... and as a synchronous run drives it: a trainer that only publishes a version and
    # takes the next batch; seconds from the publish to the whole batch (median)
    sync_cycle_s: float


def measure_generation(
    cfg: ExperimentConfig,
    model_dir: Path,
    dev: LocalDevices,
    batches: list[int],
    say: Say = _quiet,
) -> GenerationRates:
    """An `areal-hex serve` process on the inference cores, driven over HTTP from this
    process on the trainer cores, where `run` puts the controller: the server's HTTP
    handling and the client's work are in the figures, as they are in a run."""
    from rollout_service.controller.wiring import load_prompt_set, load_rollout_tokenizer

    cfg = cfg.model_copy(deep=True)
    cfg.model.path = str(model_dir)
    cfg.model.tokenizer_path = None
    tok = load_rollout_tokenizer(cfg)
    prompts = [p.input_ids for p in load_prompt_set(cfg, tok).prompts]
    serve = {
        "model": {"path": str(model_dir), "dtype": cfg.model.dtype},
        "inference": {
            "device": cfg.inference.device,
            "host": dev.address,
            "num_threads": dev.inference_threads,
            "max_running_requests": cfg.inference.max_running_requests,
            "context_length": cfg.inference.context_length,
            "weights_dir": str(model_dir.parent),
        },
        "data": {"max_prompt_tokens": cfg.data.max_prompt_tokens},
        "rollout": {"max_new_tokens": cfg.rollout.max_new_tokens},
    }
    with tempfile.TemporaryDirectory(prefix="areal-hex-profile-") as tmp:
        path = Path(tmp) / "serve.yaml"
        path.write_text(yaml.safe_dump(serve))
        say(f"starting an inference server; then decode steps at batches {batches}")
        with _server(path, dev, Path(tmp) / "serve.log") as (url, pid):
            with pinned(dev.trainer_cores, 1):
                eos = tok.eos_token_id
                gen = asyncio.run(_generation(url, cfg, prompts, eos, batches, model_dir))
                say("decode, prefill and reload timed; a synchronous run's cycle")
                gen.sync_cycle_s = asyncio.run(sync_cycle(url, cfg, model_dir))
            # the controller beside the trainer, then beside the server, alternated: a
            # load that a neighbour slows moves one median, not the choice between them
            alone, shared = [], []
            for k in range(REPEATS):
                say(f"the run's controller keeping the server busy, round {k + 1}/{REPEATS}")
                with pinned(dev.trainer_cores, 1):
                    alone.append(asyncio.run(continuous_load(url, cfg, model_dir, {pid})))
                if dev.inference_cores is not None:
                    with pinned(dev.inference_cores, 1):
                        load = continuous_load(url, cfg, model_dir, {pid}, reloads=True)
                        shared.append(asyncio.run(load))
            gen.continuous_samples_per_s = statistics.median(r for r, _, _ in alone)
            gen.host_cpu_s_per_sample = statistics.median(c for _, c, _ in alone)
            if shared:
                gen.continuous_shared_samples_per_s = statistics.median(r for r, _, _ in shared)
                pauses = [p for _, _, p in shared if p is not None]
                gen.reload_shared_s = statistics.median(pauses) if pauses else None
            return gen


@contextlib.contextmanager
def _server(config: Path, dev: LocalDevices, log_path: Path) -> Iterator[tuple[str, int]]:
    from areal_hex.net import free_port

    port = free_port()
    cores = dev.inference_cores
    env = dict(os.environ, OMP_NUM_THREADS=str(dev.inference_threads))
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "hexctl.cli", "serve", str(config), "--port", str(port)]
    cmd = dev.node_prefix + cmd
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=(lambda: os.sched_setaffinity(0, cores)) if cores else None,
        )
        try:
            yield f"http://{dev.address}:{port}", proc.pid
        finally:
            stop_process(proc)


class _Driver:
    """Sends work to the server as the controller does: one batched call per group."""

    def __init__(self, client: Any, cfg: ExperimentConfig, prompts: list[list[int]]) -> None:
        import random

        self.client, self.r, self.prompts = client, cfg.rollout, prompts
        self.g = cfg.rollout.group_size
        self.rng = random.Random(0)

    def groups(self, n: int) -> list[list[int]]:
        """`n` samples in groups of G sharing a prompt."""
        out: list[list[int]] = []
        while len(out) < n:
            out += [self.rng.choice(self.prompts)] * min(self.g, n - len(out))
        return out

    def fixed(self, n: int) -> Any:
        from areal_hex.api import SamplingParams

        return SamplingParams(max_new_tokens=n, temperature=self.r.temperature, ignore_eos=True)

    async def wave(self, work: list[list[int]], sp: Any) -> tuple[float, list]:
        t0 = time.perf_counter()
        chunks = [work[i : i + self.g] for i in range(0, len(work), self.g)]
        calls = [
            self.client.generate_batch(c, sp, [f"p{t0}-{i}-{j}" for j in range(len(c))])
            for i, c in enumerate(chunks)
        ]
        outs = await asyncio.gather(*calls)
        return time.perf_counter() - t0, [o for out in outs for o in out]

    async def answer_length(self, eos: int | None) -> float:
        """Mean answer length: G samples of a few prompts, sampled as the run samples."""
        from areal_hex.api import SamplingParams

        r = self.r
        sampling = SamplingParams(
            max_new_tokens=r.max_new_tokens,
            temperature=r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            stop_token_ids=[eos] if eos is not None else [],
        )
        picked = self.rng.sample(self.prompts, min(8, len(self.prompts)))
        _, outs = await self.wave([p for p in picked for _ in range(self.g)], sampling)
        return statistics.fmean(len(o.output_ids) for o in outs)

    async def decode_step(self, batch: int) -> float:
        """Seconds per decode step at `batch`: two answer lengths, the prefill cancels."""
        long_n = max(8, self.r.max_new_tokens)
        short_n = max(2, long_n // 4)
        diffs = []
        for _ in range(REPEATS):
            work = self.groups(batch)
            t_long, _ = await self.wave(work, self.fixed(long_n))
            t_short, _ = await self.wave(work, self.fixed(short_n))
            diffs.append(max(1e-6, (t_long - t_short) / (long_n - short_n)))
        return statistics.median(diffs)

    async def prefill_rate(self, batch: int, step_s: float) -> float:
        """Prompt tokens/s, one prompt per group (the group shares its prefill)."""
        rates = []
        for _ in range(REPEATS):
            work = self.groups(batch)
            t, _ = await self.wave(work, self.fixed(1))
            rates.append(sum(len(p) for p in work[:: self.g]) / max(1e-9, t - step_s))
        return statistics.median(rates)

    async def reload(self, model_dir: Path, version: int, batch: int) -> float:
        """One weight update as the controller makes it (pause in the run's
        `rollout.update_pause` mode, retract for auto, load, resume), while `batch`
        samples generate (0: an idle server); the pause's length. An in-place pause
        keeps the requests' KV cache, so its length is not a retract's."""
        work = self.groups(batch)
        long_n = max(8, self.r.max_new_tokens)
        task = asyncio.create_task(self.wave(work, self.fixed(long_n))) if work else None
        await asyncio.sleep(0.05)
        t0 = time.perf_counter()
        mode = self.r.update_pause if self.r.update_pause == "in_place" else "retract"
        await self.client.pause(mode)
        await self.client.update_weights_from_disk(
            str(model_dir), version, abort_all_requests=False
        )
        await self.client.resume()
        took = time.perf_counter() - t0
        if task is not None:
            await task
        return took


async def _generation(
    url: str,
    cfg: ExperimentConfig,
    prompts: list[list[int]],
    eos: int | None,
    batches: list[int],
    model_dir: Path,
) -> GenerationRates:
    from rollout_service.client import InferenceClient

    async with InferenceClient(url, timeout_s=None) as client:
        await client.wait_healthy(timeout_s=180, interval_s=0.2)
        d = _Driver(client, cfg, prompts)
        await d.wave([prompts[0]], d.fixed(4))  # warm-up: first-call allocations
        response = await d.answer_length(eos)
        steps = {b: await d.decode_step(b) for b in batches}
        top = max(batches)
        prefill = await d.prefill_rate(top, steps[top])
        versions = range(1, REPEATS + 1)
        busy = [await d.reload(model_dir, 2 * v, top) for v in versions]
        idle = [await d.reload(model_dir, 2 * v + 1, 0) for v in versions]
    return GenerationRates(
        decode_step_s=steps,
        prefill_tokens_per_s=prefill,
        prompt_tokens=statistics.fmean(len(p) for p in prompts),
        response_tokens=response,
        reload_s=statistics.median(busy),
        reload_idle_s=statistics.median(idle),
        continuous_samples_per_s=0.0,
        continuous_shared_samples_per_s=None,
        reload_shared_s=None,
        host_cpu_s_per_sample=0.0,
        sync_cycle_s=0.0,
    )


# ---------------------------------------------------------------- training
def measure_training(
    cfg: ExperimentConfig,
    model_dir: Path,
    dev: LocalDevices,
    prompt_len: int,
    response: float,
    say: Say = _quiet,
    rounds: tuple[int, int] = (REPEATS, TRAIN_STEPS),
) -> float:
    """Tokens/s (prompt + answer) of the trainer's step on one rank, the run's batch, in a
    process of its own as the run's trainer is: nothing of the generation measurements
    in its heap, and DeepSpeed's process groups (cached per process, stale once
    destroyed) new each time a process profiles. `rounds`: (timed rounds, steps each),
    the median round's rate is returned."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    say(f"training: {rounds[0]} rounds of {rounds[1]} steps after a warm-up, in a new process")
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=spawn) as pool:
        args = (cfg, model_dir, dev, prompt_len, response, rounds)
        return pool.submit(_measure_training, *args).result()


def _measure_training(
    cfg: ExperimentConfig,
    model_dir: Path,
    dev: LocalDevices,
    prompt_len: int,
    response: float,
    rounds: tuple[int, int],
) -> float:
    import torch.distributed as dist

    if dev.cgroup is not None:  # a box node: this process (a spawned one) joins its cgroup
        Path(dev.cgroup, "cgroup.procs").write_text(str(os.getpid()))
    with pinned(dev.trainer_cores, dev.trainer_threads), contextlib.redirect_stdout(sys.stderr):
        from trainer_service.engine import init_single_rank

        init_single_rank(dev.device)
        try:
            return _train_rate(cfg, model_dir, dev, prompt_len, response, rounds)
        finally:
            dist.destroy_process_group()


def _train_rate(
    cfg: ExperimentConfig,
    model_dir: Path,
    dev: LocalDevices,
    prompt_len: int,
    response: float,
    rounds: tuple[int, int],
) -> float:
    from areal_hex.models import load_model
    from trainer_service.engine import build_engine
    from trainer_service.step import StepContext, optimize
    from trainer_service.synthetic import synthetic_groups

    t = cfg.trainer
    model = load_model(model_dir, dev.device, "float32" if dev.device == "cpu" else "bfloat16")
    engine = build_engine(model.train(), t, world_size=1)
    ctx = StepContext(
        engine,
        cfg.algo,
        t.micro_batch_tokens,
        cfg.rollout.max_new_tokens,
        0,
        rank=0,
        world=1,
        device=dev.device,
        max_new_tokens=cfg.rollout.max_new_tokens,
    )
    vocab = model.config.vocab_size
    # answers spread around the measured mean, capped by max_new_tokens, the mean kept:
    # the padded length (the step's cost) and the tokens counted are then the run's
    half = max(0.0, min(0.5 * response, cfg.rollout.max_new_tokens - response))
    lo = max(1, round(response - half))
    hi = max(lo, round(response + half))
    b, g = cfg.buffer.groups_per_step, cfg.rollout.group_size
    rates = []
    freeze_startup()  # as the run's trainer does once it is built (trainer_service/main.py)
    try:
        optimize(ctx, synthetic_groups(b, g, vocab, prompt_len, (lo, hi), seed=0))  # warm-up
        n_rounds, n_steps = rounds
        for r in range(n_rounds):  # rounds of n_steps steps, tokens over seconds each
            tokens, t0 = 0, time.perf_counter()
            for step in range(n_steps):
                seed = 1 + r * n_steps + step
                groups = synthetic_groups(b, g, vocab, prompt_len, (lo, hi), seed=seed)
                tokens += optimize(ctx, groups).num_tokens
            rates.append(tokens / (time.perf_counter() - t0))
    finally:
        gc.unfreeze()
    return statistics.median(rates)


# ---------------------------------------------------------------- files
def profile_local(
    cfg: ExperimentConfig,
    out: Path,
    batches: list[int] | None = None,
    dev: LocalDevices | None = None,
    say: Say | None = None,
) -> LocalProfileFiles:
    """Measure this machine for `cfg`'s job and write the planner's inputs into `out`;
    `dev`: the devices to time (default: those `run` uses here); `say` hears each stage
    as it begins (with the seconds so far)."""
    from scheduler.model_shape import load_model_shape
    from scheduler.profile import DeviceRates, Profile, save_profile

    files = LocalProfileFiles(out)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = _model_dir(cfg, out)
    dev = dev or local_devices(cfg)
    cap = cfg.inference.max_running_requests
    batches = sorted({b for b in (batches or [1, 8, 32, cap]) if 0 < b <= cap} | {cap})
    say = _progress(say) if say is not None else _quiet
    gen = measure_generation(cfg, model_dir, dev, batches, say)
    prompt = int(gen.prompt_tokens)
    train = measure_training(cfg, model_dir, dev, prompt, gen.response_tokens, say)
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
        train_tokens_per_s=train,
        reload_idle_s=gen.reload_idle_s,
    )
    prof = Profile(model=str(files.model), params=shape.params, kinds={dev.kind: rates})
    spec = cluster_spec(dev, shape.params, gen, train)
    files.cluster.write_text(yaml.safe_dump(spec, sort_keys=False))
    files.workload.write_text(yaml.safe_dump(workload_for(cfg, gen), sort_keys=False))
    # what the timings compose to for this job, against what the controller then reached
    mine = prof.kinds[dev.kind]
    composed = composed_rate(files, prof)
    mine.generation_efficiency = gen.continuous_samples_per_s / composed
    if gen.continuous_shared_samples_per_s is not None:
        mine.generation_efficiency_shared = gen.continuous_shared_samples_per_s / composed
        mine.reload_shared_s = gen.reload_shared_s
    mine.host_cpu_s_per_sample = gen.host_cpu_s_per_sample
    mine.sync_cycle_factor = gen.sync_cycle_s / replayed_cycle_s(files, prof)
    save_profile(prof, files.profile)
    cores = {
        "inference_cores": sorted(dev.inference_cores or []),
        "trainer_cores": sorted(dev.trainer_cores or []),
    }
    measured = {
        "devices": {**dev.__dict__, **cores},
        "generation": gen.__dict__,
        "train_tokens_per_s": train,
        "generation_efficiency": mine.generation_efficiency,
        "generation_efficiency_shared": mine.generation_efficiency_shared,
        "sync_cycle_factor": mine.sync_cycle_factor,
    }
    files.measured.write_text(json.dumps(measured, indent=2))
    return files


def _model_dir(cfg: ExperimentConfig, out: Path) -> Path:
    """The job's initial model: `model.path` if set, else written (warm start included)."""
    if cfg.model.path is not None and (Path(cfg.model.path) / "config.json").is_file():
        return Path(cfg.model.path)
    from hexctl.job.prepare import materialize_v0

    return materialize_v0(cfg, out)


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


def workload_for(cfg: ExperimentConfig, gen: GenerationRates) -> dict[str, Any]:
    """The planner's workload for `cfg`'s job, with the lengths measured here."""
    return {
        "groups_per_step": cfg.buffer.groups_per_step,
        "group_size": cfg.rollout.group_size,
        "prompt_tokens": max(1, round(gen.prompt_tokens)),
        "response_tokens": max(1, round(gen.response_tokens)),
        "max_response_tokens": cfg.rollout.max_new_tokens,
        "max_staleness": cfg.buffer.max_staleness,
        "publish_every": cfg.trainer.publish_every,
        "reference_model": cfg.algo.kl_coef > 0,
        "rollout_tp": 1,
        "zero_stage": cfg.trainer.zero_stage,
        "weight_sync": cfg.rollout.weight_sync,
        "constants": {
            "max_running_requests": cfg.inference.max_running_requests,
            # a CPU trainer publishes fp32
            "weight_sync_bytes_per_param": 4.0 if cfg.trainer.device == "cpu" else 2.0,
            "weight_sync_bucket_mb": cfg.trainer.weight_sync_bucket_mb,
        },
    }
