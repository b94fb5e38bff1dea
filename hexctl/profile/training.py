"""`profile --local`, training: `trainer_service.step.optimize` under DeepSpeed (one
rank, in a process of its own) on groups shaped like the run's batch, prompt and answer
lengths as measured."""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from areal_hex.config import ExperimentConfig
from areal_hex.gc_freeze import freeze_startup
from hexctl.profile.devices import LocalDevices, Say, pinned, quiet

TRAIN_STEPS = 10  # per timed round (the device's repeats of them) after a warm-up step
CHECKPOINTS = 2  # timed after the rounds


@dataclass(frozen=True)
class TrainingRates:
    tokens_per_s: float  # prompt + answer tokens over the optimizer steps' seconds
    # per weight publish: what the step waits for (gather, hand-off); None: no step
    # published (fewer steps timed than trainer.publish_every)
    publish_s: float | None
    checkpoint_s: float  # per checkpoint
    # tokens/s in rounds that publish nothing (timed on a box node only, between the
    # others): a synchronous run's step, whose weight write ends while it waits
    quiet_tokens_per_s: float | None = None


def measure_training(
    cfg: ExperimentConfig,
    model_dir: Path,
    dev: LocalDevices,
    prompt_len: int,
    response: float,
    say: Say = quiet,
    rounds: tuple[int, int] | None = None,
) -> TrainingRates:
    """The trainer's step on one rank, the run's batch, in a process of its own as the
    run's trainer is: nothing of the generation measurements in its heap, and
    DeepSpeed's process groups (cached per process, stale once destroyed) new each time
    a process profiles. The steps publish the weights every `trainer.publish_every` as
    the run's do (to disk, the writing thread sharing the cores with the next step), and
    checkpoints are timed after them. `rounds`: (timed rounds, steps each; by default the
    device's repeats and `TRAIN_STEPS`), and a round goes on past its steps until it has
    trained for the device's `min_window_s` (a box node's share moves within seconds);
    the median round's rate is returned. On a box node each round is followed by one
    that publishes nothing: the writing thread shares the node's quota with the next
    step, which a synchronous run's step does not (its write ends while it waits)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    rounds = rounds or (dev.repeats, TRAIN_STEPS)
    quiet_too = ", each followed by one that publishes nothing" if dev.cgroup else ""
    say(
        f"training: {rounds[0]} rounds of {rounds[1]} steps and at least "
        f"{dev.min_window_s:g} s each after a warm-up{quiet_too}, in a new process"
    )
    spawn = multiprocessing.get_context("spawn")
    job = _TrainingJob(cfg, model_dir, dev, prompt_len, response, rounds)
    with ProcessPoolExecutor(max_workers=1, mp_context=spawn) as pool:
        return pool.submit(_measure_training, job).result()


@dataclass(frozen=True)
class _TrainingJob:
    """What the timing process needs (pickled to it)."""

    cfg: ExperimentConfig
    model_dir: Path
    dev: LocalDevices
    prompt_len: int
    response: float  # mean answer length, tokens
    rounds: tuple[int, int]  # (timed rounds, steps each)


def _measure_training(job: _TrainingJob) -> TrainingRates:
    import torch.distributed as dist

    dev = job.dev

    if dev.cgroup is not None:  # a box node: this process (a spawned one) joins its cgroup
        Path(dev.cgroup, "cgroup.procs").write_text(str(os.getpid()))
    with pinned(dev.trainer_cores, dev.trainer_threads), contextlib.redirect_stdout(sys.stderr):
        from trainer_service.engine import init_single_rank

        init_single_rank(dev.device)
        try:
            return _train_rate(job)
        finally:
            dist.destroy_process_group()


def _train_rate(job: _TrainingJob) -> TrainingRates:
    import tempfile

    from areal_hex.models import load_model
    from trainer_service import checkpoint
    from trainer_service.engine import build_engine
    from trainer_service.publish import AsyncPublisher, full_state_dict
    from trainer_service.step import StepContext, optimize
    from trainer_service.synthetic import synthetic_groups

    cfg, dev, prompt_len, response = job.cfg, job.dev, job.prompt_len, job.response
    t = cfg.trainer
    model = load_model(job.model_dir, dev.device, "float32" if dev.device == "cpu" else "bfloat16")
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
    rates: list[float] = []
    alone: list[float] = []
    published: list[float] = []
    saved: list[float] = []
    scratch = Path(tempfile.mkdtemp(prefix="areal-hex-profile-train-"))
    publisher = AsyncPublisher(scratch / "weights", job.model_dir, 2, lambda v, p: None)
    ctx.before_update = publisher.wait  # the next step waits for the write, as the run's

    def publish(version: int) -> None:
        t0 = time.perf_counter()
        publisher.submit(version, full_state_dict(engine, t.zero_stage, 0) or {})
        published.append(time.perf_counter() - t0)

    freeze_startup()  # as the run's trainer does once it is built (trainer_service/main.py)
    try:
        optimize(ctx, synthetic_groups(b, g, vocab, prompt_len, (lo, hi), seed=0))  # warm-up
        n_rounds, n_steps = job.rounds
        k = 0

        def timed_round(publishing: bool) -> float:
            """n_steps steps or more, tokens over seconds."""
            nonlocal k
            tokens, busy, steps = 0, 0.0, 0
            while steps < n_steps or busy < dev.min_window_s:
                k, steps = k + 1, steps + 1
                groups = synthetic_groups(b, g, vocab, prompt_len, (lo, hi), seed=k)
                t0 = time.perf_counter()
                tokens += optimize(ctx, groups).num_tokens
                busy += time.perf_counter() - t0
                if publishing and k % t.publish_every == 0:
                    publish(k)
            publisher.wait()  # the last write is not the next round's
            return tokens / busy

        for _ in range(n_rounds):
            rates.append(timed_round(publishing=True))
            if dev.cgroup is not None:  # a box node: the step alone, right after
                alone.append(timed_round(publishing=False))
        publisher.wait()
        for i in range(CHECKPOINTS):
            t0 = time.perf_counter()
            checkpoint.save(engine, scratch / "checkpoints", i + 1, {}, keep=1)
            saved.append(time.perf_counter() - t0)
    finally:
        gc.unfreeze()
        with contextlib.suppress(Exception):
            publisher.wait()
        shutil.rmtree(scratch, ignore_errors=True)
    return TrainingRates(
        tokens_per_s=statistics.median(rates),
        quiet_tokens_per_s=statistics.median(alone) if alone else None,
        publish_s=statistics.median(published) if published else None,
        checkpoint_s=statistics.median(saved),
    )
