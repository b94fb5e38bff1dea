"""`profile --local`, every core: what a colocated run's phases get on this host.

A CPU host whose run pins the servers and the trainer to cores of their own is profiled
on those cores (`devices.local_devices`). A colocated run gives each phase every core in
turn (`hexctl/job/cores.py:core_groups`): each server its share of them, the trainer all
of them. So the same profile also times, with that pinning and those thread counts, one
server's decode steps and prefill, and the trainer's step; the cost model prices a
colocated run from these (`scheduler/profile.py:DeviceRates.on_every_core`), a hybrid
one from the rates of the cores of each side, and all five modes of `bench modes` come
from one profile. Not taken where the profile's sides already share every core, or on
a GPU (the devices are the same ones in every placement).
"""

from __future__ import annotations

import asyncio
import dataclasses
import tempfile
from pathlib import Path

import yaml

from areal_hex.config import ExperimentConfig
from hexctl.profile.devices import LocalDevices, Say, local_devices, passive_waits, pinned, quiet


def every_core_devices(cfg: ExperimentConfig, dev: LocalDevices) -> LocalDevices | None:
    """The devices a colocated run of `cfg` gives its phases, where they differ from
    `dev` (a CPU host with the two sides pinned apart); None where they do not."""
    if dev.device != "cpu" or dev.node_prefix or dev.cgroup is not None:
        return None
    if dev.inference_cores is None or dev.inference_cores == dev.trainer_cores:
        return None
    shared = cfg.model_copy(deep=True)
    shared.workflow.placement = "colocated"
    every = local_devices(shared)
    if every.inference_cores is None or every.inference_cores != every.trainer_cores:
        return None
    return dataclasses.replace(every, repeats=dev.repeats, min_window_s=dev.min_window_s)


def measure_every_core(
    cfg: ExperimentConfig,
    model_dir: Path,
    every: LocalDevices,
    batches: list[int],
    prompt_len: int,
    response: float,
    say: Say = quiet,
) -> dict[str, object]:
    """One server's decode steps at `batches` and prefill, and the trainer's step, each
    on every core with a colocated run's threads (its processes waiting asleep, as the
    launcher starts them); the fields of `scheduler.profile.EveryCore`."""
    from hexctl.profile.training import measure_training

    with passive_waits(every):
        decode, prefill = _generation(cfg, model_dir, every, batches, say)
        say("every core: the trainer's step")
        train = measure_training(cfg, model_dir, every, prompt_len, response, say, trim=False)
    return {
        "decode_step_s": decode,
        "prefill_tokens_per_s": prefill,
        "train_tokens_per_s": train.tokens_per_s,
        "inference_threads": every.inference_threads,
        "trainer_threads": every.trainer_threads,
    }


def _generation(
    cfg: ExperimentConfig, model_dir: Path, every: LocalDevices, batches: list[int], say: Say
) -> tuple[dict[int, float], float]:
    from hexctl.profile.generation import job_prompts
    from hexctl.profile.server import serve_config, server_process

    cfg, _tok, prompts = job_prompts(cfg, model_dir)
    with tempfile.TemporaryDirectory(prefix="areal-hex-profile-every-") as tmp:
        path = Path(tmp) / "serve.yaml"
        path.write_text(yaml.safe_dump(serve_config(cfg, model_dir, every)))
        say(
            f"every core: a server with {every.inference_threads} thread(s); decode steps "
            f"at batches {batches} and prefill"
        )
        with server_process(path, every, Path(tmp) / "serve.log") as (url, _pid):
            with pinned(every.trainer_cores, 1):
                return asyncio.run(_timings(url, cfg, prompts, batches))


async def _timings(
    url: str, cfg: ExperimentConfig, prompts: list[list[int]], batches: list[int]
) -> tuple[dict[int, float], float]:
    from hexctl.profile.generation import WAVE_TIMEOUT_S, _Driver
    from rollout_service.client import InferenceClient

    async with InferenceClient(url, timeout_s=WAVE_TIMEOUT_S) as client:
        await client.wait_healthy(timeout_s=180, interval_s=0.2)
        d = _Driver(client, cfg, prompts)
        await d.wave([prompts[0]], d.fixed(4))  # warm-up: first-call allocations
        steps = {b: await d.decode_step(b) for b in batches}
        top = max(batches)
        return steps, await d.prefill_rate(top, steps[top])


def lacks_every_core(cfg: ExperimentConfig, out: Path) -> bool:
    """Whether the local profile in `out` (of `cfg`'s job) needs the rates on every core
    for a colocated run and has none: a profile taken for the other modes only."""
    from hexctl.job.predict import LocalProfileFiles
    from scheduler.profile import load_profile

    prof = load_profile(LocalProfileFiles(out).profile)
    if any(r.every_core is not None for r in prof.kinds.values()):
        return False
    return every_core_devices(cfg, local_devices(cfg)) is not None


def add_every_core(cfg: ExperimentConfig, out: Path, say: Say = quiet) -> None:
    """Time the rates on every core of `cfg`'s job into the local profile in `out`, taken
    without them: the batches its decode steps were timed at, the lengths its workload
    holds, the job's initial model."""
    from hexctl.job.predict import LocalProfileFiles
    from hexctl.job.prepare import initial_model_dir
    from scheduler.profile import EveryCore, load_profile, save_profile

    files = LocalProfileFiles(out)
    prof = load_profile(files.profile)
    dev = local_devices(cfg)
    every = every_core_devices(cfg, dev)
    if every is None:
        return
    work = yaml.safe_load(files.workload.read_text())
    rates = prof.kinds[dev.kind]
    fields = measure_every_core(
        cfg,
        initial_model_dir(cfg, out),
        every,
        sorted(rates.decode_step_s),
        int(work["prompt_tokens"]),
        float(work["response_tokens"]),
        say,
    )
    rates.every_core = EveryCore(**fields)  # type: ignore[arg-type]
    save_profile(prof, files.profile)
