"""A box kind's rates from two sittings: after every kind has been profiled once
(`profile_box`), each is timed again, its continuous load in a new server and its
training step in a new process, and the rates the run is priced at are the geometric
mean of the two sittings' medians.

Why: one kind's rates, profiled twice two hours apart on the same host, moved by −41 % to
+32 % (continuous generation) and −25 % to +23 % (training) while runs of one plan moved
less (docs/fidelity.md). Within one server the continuous load's 4-s rounds moved from
372 to 583 samples/s with the node's CPU delivered the same (0.21–0.23 of a core) and the
batch full (61–63 of 64): the CPU one decode step took moved 1.43–1.70 ms, and stayed
put for tens of seconds (rounds of 12 s spread as widely). A second sitting minutes later
is a second draw of that state; the mean of two halves its variance.

The first sitting's figures stay in the kind's `measured.json`; the second's go beside
them under `second_sitting`, with the factors applied to the kind's profile and
inventory."""

from __future__ import annotations

import asyncio
import json
import math
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from areal_hex.config import ExperimentConfig
from areal_hex.config.base import load_yaml_text
from hexctl.job.predict import LocalProfileFiles
from hexctl.profile.devices import LocalDevices, Say, quiet

# rounds of the continuous load and of training in the second sitting (the first: the
# device's repeats, 5 on a box node)
SECOND_ROUNDS = 3


@dataclass(frozen=True)
class Sitting:
    """A kind's second sitting: each continuous round's samples/s and the training's
    tokens/s (median round; `quiet`: the rounds that publish nothing, None if not timed)."""

    continuous: list[float]
    train: float
    quiet: float | None


def sit_again(
    cfg: ExperimentConfig, dev: LocalDevices, files: LocalProfileFiles, say: Say = quiet
) -> Sitting:
    """Time `files`' kind again on `dev` (its node): `SECOND_ROUNDS` continuous loads in a
    new server, then `SECOND_ROUNDS` training rounds in a new process, at the lengths its
    first sitting measured."""
    from hexctl.profile.controller import continuous_load
    from hexctl.profile.generation import job_prompts
    from hexctl.profile.server import serve_config, server_process
    from hexctl.profile.training import TRAIN_STEPS, measure_training
    from rollout_service.client import InferenceClient

    gen = json.loads(files.measured.read_text())["generation"]
    model_dir = Path(cfg.model.path)
    cfg, _, _ = job_prompts(cfg, model_dir)
    rates: list[float] = []
    with tempfile.TemporaryDirectory(prefix="areal-hex-profile-") as tmp:
        path = Path(tmp) / "serve.yaml"
        path.write_text(yaml.safe_dump(serve_config(cfg, model_dir, dev)))
        say("second sitting: a new inference server")
        with server_process(path, dev, Path(tmp) / "serve.log") as (url, pid):

            async def healthy() -> None:
                async with InferenceClient(url, timeout_s=60) as client:
                    await client.wait_healthy(timeout_s=180, interval_s=0.2)

            asyncio.run(healthy())
            for k in range(SECOND_ROUNDS):
                say(
                    f"second sitting: the run's controller keeping the server busy, "
                    f"round {k + 1}/{SECOND_ROUNDS}"
                )
                load = continuous_load(url, cfg, model_dir, {pid}, min_window_s=dev.min_window_s)
                rates.append(asyncio.run(load)[0])
    train = measure_training(
        cfg,
        model_dir,
        dev,
        int(gen["prompt_tokens"]),
        gen["response_tokens"],
        lambda text: say(f"second sitting: {text}"),
        rounds=(SECOND_ROUNDS, TRAIN_STEPS),
        trim=False,
        pair=False,  # the first sitting's send to two receivers stands
    )
    return Sitting(rates, train.tokens_per_s, train.quiet_tokens_per_s)


def mean_factor(first: float | None, second: float | None) -> float:
    """What a first sitting's rate is multiplied by to give the geometric mean of both
    sittings' (1 where either is missing)."""
    if not first or not second or first <= 0 or second <= 0:
        return 1.0
    return math.sqrt(second / first)


def combine(files: LocalProfileFiles, sitting: Sitting) -> dict[str, float]:
    """The kind's profile, inventory and `measured.json` in `files` at the mean of both
    sittings: generation's efficiency (what its continuous rate is priced through),
    training's plain, quiet and trimmed rates and the compute they imply; the factors."""
    from scheduler.profile import load_profile, save_profile

    measured = json.loads(files.measured.read_text())
    gen = measured["generation"]
    factors = {
        "generation": mean_factor(
            gen["continuous_samples_per_s"], statistics.median(sitting.continuous)
        ),
        "train": mean_factor(measured["train_tokens_per_s"], sitting.train),
        "train_quiet": mean_factor(measured.get("train_sync_tokens_per_s"), sitting.quiet),
    }
    prof = load_profile(files.profile)
    for rates in prof.kinds.values():
        if rates.generation_efficiency is not None:
            rates.generation_efficiency *= factors["generation"]
        if rates.generation_efficiency_at is not None:  # the plain load's factor, for each
            at = rates.generation_efficiency_at.items()
            rates.generation_efficiency_at = {b: e * factors["generation"] for b, e in at}
        rates.train_tokens_per_s *= factors["train"]
        if rates.train_trim_tokens_per_s is not None:  # the plain rate over a ratio
            rates.train_trim_tokens_per_s *= factors["train"]
        if rates.train_sync_tokens_per_s is not None:
            rates.train_sync_tokens_per_s *= factors["train_quiet"]
    save_profile(prof, files.profile)
    cluster: dict[str, Any] = load_yaml_text(files.cluster.read_text(), str(files.cluster))
    for over in (cluster.get("gpu_overrides") or {}).values():
        over["bf16_tflops"] = round(over["bf16_tflops"] * factors["train"], 6)
    files.cluster.write_text(yaml.safe_dump(cluster, sort_keys=False))
    measured["second_sitting"] = {
        "continuous_rounds_samples_per_s": sitting.continuous,
        "continuous_samples_per_s": statistics.median(sitting.continuous),
        "train_tokens_per_s": sitting.train,
        "train_sync_tokens_per_s": sitting.quiet,
        "factors": factors,
    }
    files.measured.write_text(json.dumps(measured, indent=2))
    return factors
