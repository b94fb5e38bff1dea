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
from typing import TYPE_CHECKING

from areal_hex.config import ExperimentConfig
from areal_hex.gc_freeze import freeze_startup
from hexctl.profile.devices import LocalDevices, Say, pinned, quiet
from hexctl.profile.receiver import RECEIVE_TIMEOUT_S, WeightReceiver

if TYPE_CHECKING:
    from trainer_service.publish import NetworkSink

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
    publish_sync: str = "disk"  # how the steps published: disk | network
    # over the network: seconds of a version's broadcast as the sender saw it (median)
    broadcast_s: float | None = None
    # ... to two receivers, each on a quota of the node's size (a box node only): rank 0
    # then sends two copies, as gloo's tree has it send to two servers or more, and each
    # copy goes at the pace of a receiver that takes it on its quota
    broadcast_pair_s: float | None = None
    # a publishing step's work after it waited for the last write (its optimizer update,
    # the state dict, the hand-on of its own write), s (median): a send that outlasts
    # the step's passes has the trainer's cycle at the send plus this
    after_send_s: float | None = None
    # tokens/s in rounds whose steps each give the freed heap back to the OS after the
    # publish, as a trainer that shares its devices does (`areal_hex/heap.py`:
    # the trim, and the next step taking the pages again); by default timed on a CPU
    # device, one such round after each of the others. Taken as the plain rate over
    # `trim_step_ratio`, not as a trimmed round's own rate: one round that met a
    # neighbour's load does not move it
    trim_tokens_per_s: float | None = None
    # a trimmed step's CPU seconds (its optimizer step and its trim) over a plain step's,
    # per token: the median over each trimmed round paired with the plain round before
    # it, each round's steps taken at their median after its first (`trim_step_ratio`)
    trim_step_ratio: float | None = None
    # seconds of the trim call alone, per step: the median over the trimmed rounds'
    # steps after each round's first, wall and CPU
    trim_call_s: float | None = None
    trim_call_cpu_s: float | None = None


@dataclass(frozen=True)
class TimedStep:
    """One optimizer step of a timed round: its tokens, its seconds and, in a round
    that trims the heap, the trim's seconds after it (wall and this process's CPU)."""

    tokens: int
    step_s: float
    step_cpu_s: float
    trim_s: float = 0.0
    trim_cpu_s: float = 0.0

    @property
    def cpu_s_per_token(self) -> float:
        return (self.step_cpu_s + self.trim_cpu_s) / max(self.tokens, 1)


def round_cpu_s_per_token(steps: list[TimedStep]) -> float:
    """A round's CPU seconds per token: the median step's, its first step left out (it
    pays for what the round before left in the heap) where there are others. CPU
    seconds: what the step and its trim cost, not what a neighbour held the core for."""
    body = steps[1:] if len(steps) > 1 else steps
    return statistics.median(s.cpu_s_per_token for s in body)


def trim_step_ratio(plain: list[list[TimedStep]], trimmed: list[list[TimedStep]]) -> float:
    """A trimmed step's CPU seconds over a plain step's, per token: each trimmed round
    against the plain round timed right before it (the same state of the machine), the
    median of those ratios. One round slowed by a neighbour moves one ratio only."""
    if not trimmed or len(plain) < len(trimmed):
        raise ValueError(
            f"{len(trimmed)} trimmed round(s) and {len(plain)} plain round(s): expected "
            "at least one trimmed round, each after a plain round"
        )
    ratios = [
        round_cpu_s_per_token(t) / round_cpu_s_per_token(p)
        for p, t in zip(plain, trimmed, strict=False)
    ]
    return statistics.median(ratios)


def measure_training(
    cfg: ExperimentConfig,
    model_dir: Path,
    dev: LocalDevices,
    prompt_len: int,
    response: float,
    say: Say = quiet,
    rounds: tuple[int, int] | None = None,
    network: bool | None = None,
    trim: bool | None = None,
    pair: bool | None = None,
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
    step, which a synchronous run's step does not (its write ends while it waits).
    `network` (None: on a box node whose run syncs over the network): the steps publish
    as such a run's trainer does, broadcasting each version to a receiver of their own
    (`WeightReceiver`, outside the node's quota, as a server on another node is), so the
    broadcast's share of the node is in the rate; with `pair` (None: over the network
    where the node has `receiver_cgroups`), one round more publishes to two receivers,
    each in one of them (`broadcast_pair_s`). `trim` (None: on a CPU device): each
    round is also followed by one whose steps give the freed heap back after their
    publish, as a trainer that shares its devices with generation does (hybrid,
    colocated): `trim_tokens_per_s`, one round more per repeat."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    rounds = rounds or (dev.repeats, TRAIN_STEPS)
    if network is None:
        network = dev.cgroup is not None and cfg.rollout.weight_sync == "network"
    if trim is None:
        trim = dev.device == "cpu"
    if pair is None:
        pair = network and bool(dev.receiver_cgroups)
    quiet_too = ", each followed by one that publishes nothing" if dev.cgroup else ""
    quiet_too += ", each followed by one that trims the heap after every step" if trim else ""
    quiet_too += "; then one that sends to two receivers on quotas" if pair else ""
    say(
        f"training: {rounds[0]} rounds of {rounds[1]} steps and at least "
        f"{dev.min_window_s:g} s each after a warm-up{quiet_too}, in a new process"
    )
    spawn = multiprocessing.get_context("spawn")
    job = _TrainingJob(cfg, model_dir, dev, prompt_len, response, rounds, network, pair, trim)
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
    network: bool = False  # publish over the network to a `WeightReceiver`
    # ... and a round that publishes to two receivers on quotas (`broadcast_pair_s`)
    pair: bool = False
    trim: bool = False  # also rounds whose steps trim the heap (`trim_tokens_per_s`)


def _measure_training(job: _TrainingJob) -> TrainingRates:
    import torch.distributed as dist

    dev = job.dev

    with contextlib.ExitStack() as stack:
        # started before this process joins the node's cgroup: it stays outside the quota
        receiver = stack.enter_context(WeightReceiver()) if job.network else None
        pair = None
        if job.pair:  # two receivers, each in a cgroup of the node's quota where made
            quotas: list[str | None] = list(dev.receiver_cgroups) or [None, None]
            pair = stack.enter_context(WeightReceiver(quotas))
        if dev.cgroup is not None:  # a box node: this process (a spawned one) joins its cgroup
            Path(dev.cgroup, "cgroup.procs").write_text(str(os.getpid()))
        stack.enter_context(pinned(dev.trainer_cores, dev.trainer_threads))
        stack.enter_context(contextlib.redirect_stdout(sys.stderr))
        from trainer_service.engine import init_single_rank

        init_single_rank(dev.device)
        try:
            return _train_rate(job, receiver, pair)
        finally:
            dist.destroy_process_group()


def _train_rate(
    job: _TrainingJob, receiver: WeightReceiver | None = None, pair: WeightReceiver | None = None
) -> TrainingRates:
    import tempfile

    from areal_hex.heap import trim_heap
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
    critic = None  # PPO's step: the critic's passes and update are part of its cost
    if cfg.algo.advantage == "gae":
        from trainer_service.critic import build_critic

        critic = build_critic(job.model_dir, t, cfg.algo, world=1)
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
        critic=critic,
    )
    vocab = model.config.vocab_size
    # answers spread around the measured mean, capped by max_new_tokens, the mean kept:
    # the padded length (the step's cost) and the tokens counted are then the run's
    half = max(0.0, min(0.5 * response, cfg.rollout.max_new_tokens - response))
    lo = max(1, round(response - half))
    hi = max(lo, round(response + half))
    b, g = cfg.buffer.groups_per_step, cfg.rollout.group_size
    # a reference task's records carry π_ref log-probs: the step's KL term reads them
    ref = cfg.algo.kl_coef > 0 and cfg.workflow.task_with_role("reference") is not None
    rounds: list[list[TimedStep]] = []
    alone: list[float] = []
    trimmed: list[list[TimedStep]] = []
    published: list[float] = []
    saved: list[float] = []
    broadcasts: list[float] = []
    after_send: list[float] = []
    pair_broadcasts: list[float] = []
    scratch = Path(tempfile.mkdtemp(prefix="areal-hex-profile-train-"))
    sink = receiver.sink(cfg.rollout.weight_sync_bucket_mb) if receiver is not None else None

    def publisher_to(to: NetworkSink | None) -> AsyncPublisher:
        return AsyncPublisher(scratch / "weights", job.model_dir, 2, lambda v, p: None, to)

    publisher = publisher_to(sink)
    ctx.before_update = publisher.wait  # the next step waits for the write, as the run's

    def publish(version: int, after_fence_s: float | None) -> None:
        t0 = time.perf_counter()
        waited = publisher.submit(version, full_state_dict(engine, t.zero_stage, 0) or {})
        published.append(time.perf_counter() - t0)
        if after_fence_s is not None:  # as the run's trainer counts it (`after_fence_s`)
            after_send.append(after_fence_s + published[-1] - waited)
        if sink is not None and sink.last_sync_s > 0:  # the version before, now sent
            broadcasts.append(sink.last_sync_s)

    freeze_startup()  # as the run's trainer does once it is built (trainer_service/main.py)
    try:
        warm = synthetic_groups(b, g, vocab, prompt_len, (lo, hi), seed=0, with_ref=ref)
        optimize(ctx, warm)  # warm-up
        n_rounds, n_steps = job.rounds
        k = 0

        def timed_round(publishing: bool, trim: bool = False) -> list[TimedStep]:
            """n_steps steps or more, each timed (with `trim`, the heap trim after its
            publish timed with it)."""
            nonlocal k
            steps: list[TimedStep] = []
            busy = 0.0
            while len(steps) < n_steps or busy < dev.min_window_s:
                k += 1
                groups = synthetic_groups(b, g, vocab, prompt_len, (lo, hi), seed=k, with_ref=ref)
                c0, t0 = time.process_time(), time.perf_counter()
                result = optimize(ctx, groups)
                tokens = result.num_tokens
                step_s, step_cpu_s = time.perf_counter() - t0, time.process_time() - c0
                if publishing and k % t.publish_every == 0:
                    publish(k, result.extra.get("after_fence_s"))
                trim_s = trim_cpu_s = 0.0
                if trim:
                    c0, t0 = time.process_time(), time.perf_counter()
                    trim_heap()
                    trim_s, trim_cpu_s = time.perf_counter() - t0, time.process_time() - c0
                steps.append(TimedStep(tokens, step_s, step_cpu_s, trim_s, trim_cpu_s))
                busy += step_s + trim_s
            publisher.wait()  # the last write is not the next round's
            if sink is not None and sink.failures:
                raise RuntimeError(
                    f"the profile's steps could not broadcast their weights: {sink.failures} "
                    f"version(s) not taken by its receiver in {RECEIVE_TIMEOUT_S:.0f} s"
                )
            return steps

        for _ in range(n_rounds):
            rounds.append(timed_round(publishing=True))
            if dev.cgroup is not None:  # a box node: the step alone, right after
                alone.append(_tokens_per_s(timed_round(publishing=False)))
            if job.trim:  # a trainer sharing its devices, right after
                trimmed.append(timed_round(publishing=True, trim=True))
        publisher.wait()
        if pair is not None:  # the same steps, each version sent to two receivers
            kept = publisher, sink, broadcasts, published, after_send
            sink = pair.sink(cfg.rollout.weight_sync_bucket_mb)
            publisher = publisher_to(sink)
            ctx.before_update = publisher.wait
            broadcasts, published, after_send = pair_broadcasts, [], []
            try:
                timed_round(publishing=True)
            finally:
                sink.close()
                publisher, sink, broadcasts, published, after_send = kept
                ctx.before_update = publisher.wait
        for i in range(CHECKPOINTS):
            t0 = time.perf_counter()
            checkpoint.save(engine, scratch / "checkpoints", i + 1, {}, keep=1)
            saved.append(time.perf_counter() - t0)
    finally:
        gc.unfreeze()
        with contextlib.suppress(Exception):
            publisher.wait()
        if sink is not None:
            sink.close()
        shutil.rmtree(scratch, ignore_errors=True)
    tokens_per_s = statistics.median(_tokens_per_s(r) for r in rounds)
    return TrainingRates(
        tokens_per_s=tokens_per_s,
        quiet_tokens_per_s=statistics.median(alone) if alone else None,
        publish_s=statistics.median(published) if published else None,
        checkpoint_s=statistics.median(saved),
        publish_sync="network" if sink is not None else "disk",
        broadcast_s=statistics.median(broadcasts) if broadcasts else None,
        broadcast_pair_s=statistics.median(pair_broadcasts) if pair_broadcasts else None,
        after_send_s=statistics.median(after_send) if after_send else None,
        **_trim_figures(tokens_per_s, rounds, trimmed),
    )


def _tokens_per_s(steps: list[TimedStep]) -> float:
    """A round's tokens over its seconds (with a trim, the trims' seconds in them)."""
    return sum(s.tokens for s in steps) / sum(s.step_s + s.trim_s for s in steps)


def _trim_figures(
    tokens_per_s: float, plain: list[list[TimedStep]], trimmed: list[list[TimedStep]]
) -> dict[str, float | None]:
    """`TrainingRates`' trim fields from the rounds (None each where none trimmed)."""
    if not trimmed:
        return {}
    ratio = trim_step_ratio(plain, trimmed)
    calls = [s for r in trimmed for s in (r[1:] if len(r) > 1 else r)]
    return {
        "trim_tokens_per_s": tokens_per_s / ratio,
        "trim_step_ratio": ratio,
        "trim_call_s": statistics.median(s.trim_s for s in calls),
        "trim_call_cpu_s": statistics.median(s.trim_cpu_s for s in calls),
    }
