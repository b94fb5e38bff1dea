"""`profile --local`, the parts measured with the run's own controller: the server kept
full as an asynchronous run keeps it (samples/s and the controller's CPU per sample), and
a synchronous step's batch timed from the trainer's publish; and the ratios of those to
what the cost model composes from the engine's timings (`generation_efficiency`,
`sync_cycle_factor` in the profile).
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from areal_hex.config import ExperimentConfig
from areal_hex.net import wait_event
from hexctl.job.predict import LocalProfileFiles
from hexctl.profile.host_cpu import TreeCpu, uncounted

LOCAL_GROUP = "local"  # the node group `profile --local` writes


@contextlib.asynccontextmanager
async def _controller(
    url: str,
    cfg: ExperimentConfig,
    model_dir: Path,
    eta: int,
    groups: int,
    network: Any = None,
) -> AsyncIterator[tuple[Any, Any, int | None]]:
    """The run's controller (`RolloutController`, the run's rewards and sampling) against
    the server at `url`, producing `groups` groups into a Valkey of its own at staleness
    `eta`: (controller, the buffer's endpoint, Valkey's pid). `network`: where versions
    sent over the network are described (a `NetworkSource`), None: from disk."""
    from areal_hex.buffer import RedisTrajectoryProducer, open_redis
    from rollout_service.client import InferenceClient
    from rollout_service.controller.rollout import RolloutController
    from rollout_service.controller.wiring import load_prompt_set, load_rollout_tokenizer

    cfg = cfg.model_copy(deep=True)
    cfg.model.path, cfg.model.tokenizer_path = str(model_dir), None
    cfg.buffer.max_staleness = eta
    # no trainer consumes here: the buffer holds every group the load makes
    cfg.buffer.max_pending = max(cfg.buffer.max_pending, groups + 1)
    cfg.redis.url, cfg.redis.data_dir, cfg.redis.port = None, None, None
    tok = load_rollout_tokenizer(cfg)
    endpoint = open_redis(cfg.redis)
    inflight = 2 * cfg.inference.max_running_requests  # as `run_rollout` sets it
    client = InferenceClient(url, timeout_s=None, max_inflight=inflight)
    redis = endpoint.async_client()
    eos = tok.eos_token_id
    ctl = RolloutController(
        [client],
        RedisTrajectoryProducer(redis, PROFILE_RUN, cfg.buffer),
        load_prompt_set(cfg, tok).prompts,
        lambda ids: tok.decode(ids, skip_special_tokens=True),
        cfg.rollout,
        max_groups=groups,
        stop_token_ids=[eos] if eos is not None else [],
        seed=cfg.data.seed,
        weights_dir=str(model_dir.parent),
        network=network,
    )
    try:
        yield ctl, endpoint, endpoint.server.pid if endpoint.server is not None else None
    finally:
        await client.close()
        await redis.aclose()
        endpoint.close()


PROFILE_RUN = "profile"  # the buffer's run id inside the profile's own Valkey


async def continuous_load(
    url: str,
    cfg: ExperimentConfig,
    model_dir: Path,
    exclude: set[int],
    reloads: Reloads | None = None,
    min_window_s: float = 1.0,
    rank0: Rank0 | None = None,
) -> tuple[float, float, float | None]:
    """The run's controller with its gate wide open, so that the server stays as full as
    an asynchronous run keeps it. Over the middle of it (from a quarter to nine tenths of
    the groups: no start-up, no drain): samples/s, and the CPU seconds per sample of this
    process and its children but the server (`exclude`): the controller, its rewards and,
    where the run starts its own Valkey beside the controller (no `redis.url`), Valkey's
    share for the records (without the trainer's reads, which the profile does not
    make); a Valkey the run reaches elsewhere is left out. With `reloads`, a
    weight update made by the controller itself (`rollout.update_pause`, as in a run) every
    `RELOAD_EVERY_S`, from disk or over the network as `reloads` says: the median pause
    is the third figure (else None), and samples/s are those between pauses. A load
    whose middle lasts under `min_window_s` (short answers, a fast device) is run again,
    long enough (`min_window_s`). Over the network, `rank0` (from `broadcaster`) is
    the broadcasting rank 0 to use (None: one for this load alone)."""
    groups = CONTINUOUS_ROUNDS * cfg.rollout.max_concurrent_groups
    for _ in range(2):
        got, window_s = await _load_once(url, cfg, model_dir, exclude, reloads, groups, rank0)
        if window_s >= min_window_s:
            break
        groups = int(groups * min(20.0, 1.5 * min_window_s / max(window_s, 1e-3))) + 1
    return got


def load_batch(cfg: ExperimentConfig) -> int:
    """The batch `continuous_load` holds the server at: the requests of its groups in
    flight (`rollout.max_concurrent_groups` of `rollout.group_size`), at most the
    server's batch limit."""
    groups = cfg.rollout.max_concurrent_groups * cfg.rollout.group_size
    return min(cfg.inference.max_running_requests, groups)


def filled(cfg: ExperimentConfig) -> ExperimentConfig | None:
    """`cfg` with `rollout.max_concurrent_groups` raised to the groups that fill the
    server's batch limit, as a plan raises it for an instance it runs at that batch
    (`plan_config.groups_to_fill`); None where `cfg`'s groups fill it already."""
    fill = -(-cfg.inference.max_running_requests // cfg.rollout.group_size)
    if fill <= cfg.rollout.max_concurrent_groups:
        return None
    rollout = cfg.rollout.model_copy(update={"max_concurrent_groups": fill})
    return cfg.model_copy(update={"rollout": rollout})


@dataclass(frozen=True)
class Reloads:
    """How `continuous_load` updates the server: "disk" (`update_weights_from_disk` of
    the initial model) or "network": a trainer's rank 0 on its own
    (`trainer_service.publish.broadcast_versions`) in `netns` (None: this machine's),
    master address `address` (the server's own: the bytes cross no shaped link, and the
    cost model adds them over the run's links), broadcasting in buckets of `bucket_mb`;
    the controller asks the server for each bucket, as a run's does."""

    sync: str = "disk"
    netns: str | None = None
    address: str = "127.0.0.1"
    bucket_mb: float = 512.0


def pause_overlap_s(plain: float, paused: float, pause_s: float | None) -> float | None:
    """Seconds of an update's pause in which generation went on: `plain` samples/s
    without updates, `paused` those between updates of `pause_s` each, one every
    `RELOAD_EVERY_S` (as `continuous_load` reports them). Over one cycle of a wait and a
    pause the load made `paused`·wait samples where `plain` makes them in
    made/`plain` seconds: the rest of the cycle was lost; the pause less that, within
    [0, pause]. None without an update."""
    if not pause_s or plain <= 0:
        return None
    made = paused * RELOAD_EVERY_S
    lost_s = RELOAD_EVERY_S + pause_s - made / plain
    return min(pause_s, max(0.0, pause_s - lost_s))


def round_overlaps(plain: list[float], updated: list[tuple[float, float | None]]) -> list[float]:
    """Each round's `pause_overlap_s`: its load with updates (samples/s, median pause)
    against the median of every round's load without them: one plain load is a sample
    of a few seconds, their median the steadier reference for every round."""
    if not plain:
        return []
    ref = statistics.median(plain)
    got = (pause_overlap_s(ref, rate, pause) for rate, pause in updated)
    return [o for o in got if o is not None]


CONTINUOUS_ROUNDS = 5  # groups produced: at least this many times the in-flight groups
FIRST_VERSION = 1001  # of the updates: above the versions the reload timings used
RELOAD_EVERY_S = 0.2  # between weight updates of `continuous_load(..., reloads=...)`
TICK_S = 0.1  # how often the load's progress and CPU are read
STALL_S = 120.0  # a load without a new sample this long fails the profile


class ProfileFailed(RuntimeError):
    """The profile cannot go on: a load made no progress, or its server is stuck or gone."""


async def _load_once(
    url: str,
    cfg: ExperimentConfig,
    model_dir: Path,
    exclude: set[int],
    reloads: Reloads | None,
    groups: int,
    rank0: Rank0 | None = None,
) -> tuple[tuple[float, float, float | None], float]:
    """`continuous_load` with `groups` groups: its figures and the measured window, s.
    Over the network, `rank0` (None: one for this load alone) leaves its group first:
    a new controller has the server join a group of its own."""
    with contextlib.ExitStack() as stack:
        if reloads is None or reloads.sync != "network":
            rank0 = None
        elif rank0 is None:
            rank0 = stack.enter_context(broadcaster(model_dir, reloads))
        else:
            rank0.regroup()
        total = groups * cfg.rollout.group_size
        marks: list[tuple[float, int, float]] = []
        network = rank0.source() if rank0 is not None else None
        # no trainer here: nothing may wait on the gate
        async with _controller(url, cfg, model_dir, 1 << 20, groups, network) as (ctl, _, valkey):
            skip = uncounted(exclude, valkey, cfg.redis.url is not None)
            tree_cpu = TreeCpu()

            async def watch() -> None:
                # a load that makes no sample for STALL_S is stuck: an error, not a wait
                moved, seen = time.perf_counter(), -1
                while True:
                    now, n = time.perf_counter(), ctl.stats["samples_total"]
                    marks.append((now, n, tree_cpu(skip)))
                    if n != seen:
                        moved, seen = now, n
                    elif now - moved > STALL_S:
                        raise ProfileFailed(
                            f"the run's controller made no sample in {STALL_S:.0f} s against "
                            f"the server at {url} ({n} of {total} samples made)"
                        )
                    await asyncio.sleep(TICK_S)

            pauses: list[float] = []
            stop = asyncio.Event()

            async def reload_loop() -> None:
                # the controller's own update (gate closed, pause, load, resume), as in a run
                # (over the network once its manifest is left, as a run's trainer announces
                # it); RELOAD_EVERY_S between the end of a pause and the start of the next,
                # the announcement's round trip (`lead`, as last measured) inside it. Told to
                # stop, it ends between updates: one announced is always taken (its rank 0
                # waits in the broadcast until the server takes it)
                version, ended, lead = FIRST_VERSION, time.perf_counter(), 0.0
                while not stop.is_set():
                    wait = RELOAD_EVERY_S - (time.perf_counter() - ended) - lead
                    if await wait_event(stop, wait):
                        return
                    if rank0 is None:
                        t0 = time.perf_counter()
                        await ctl.update_weights(version, str(model_dir))
                    else:
                        t = time.perf_counter()
                        await rank0.publish(version)
                        t0 = time.perf_counter()
                        lead = t0 - t
                        await ctl.update_weights(version, "")
                        await rank0.sent()
                    ended = time.perf_counter()
                    pauses.append(ended - t0)
                    version += 1

            if rank0 is not None:  # the group forms first, as a run forms it once at its start
                await ctl.dispatcher.probe_all()
                await ctl.weights.start(cfg.rollout.update_pause)
                await rank0.publish(FIRST_VERSION - 1)
                await ctl.update_weights(FIRST_VERSION - 1, "")
                await rank0.sent()
            watcher = asyncio.create_task(watch())
            reloader = asyncio.create_task(reload_loop()) if reloads is not None else None
            running = asyncio.create_task(ctl.run())
            try:
                watched = {running, watcher} | ({reloader} if reloader is not None else set())
                await asyncio.wait(watched, return_when=asyncio.FIRST_COMPLETED)
                if reloader is not None and reloader.done():
                    reloader.result()  # raises ProfileFailed (a broadcast that failed)
                if not running.done():
                    running.cancel()
                    watcher.result()  # raises ProfileFailed
                running.result()
            finally:
                stop.set()
                for task in (watcher, running):
                    task.cancel()
                ends = [watcher, running] + ([reloader] if reloader is not None else [])
                await asyncio.gather(*ends, return_exceptions=True)
    inside = [m for m in marks if total / 4 <= m[1] <= 0.9 * total]
    if len(inside) < 2 or inside[-1][1] == inside[0][1]:
        # too short to sample its middle: from the last mark before the first sample to
        # the first mark after the last one (not the start-up or the shutdown around them)
        first = next((i for i, m in enumerate(marks) if m[1] > marks[0][1]), len(marks) - 1)
        last = next(i for i, m in enumerate(marks) if m[1] == marks[-1][1])
        inside = [marks[max(0, first - 1)], marks[max(last, first)]]
    (t0, n0, c0), (t1, n1, c1) = inside[0], inside[-1]
    n = max(1, n1 - n0)
    rate = n / max(1e-9, t1 - t0)
    reload_s = statistics.median(pauses) if pauses else None
    if reload_s is not None:  # the rate while generating: a cycle is the wait + a pause
        rate *= (RELOAD_EVERY_S + reload_s) / RELOAD_EVERY_S
    return (rate, max(0.0, c1 - c0) / n, reload_s), t1 - t0


class Rank0:
    """A spawned `broadcast_versions` process and the manifests it left."""

    def __init__(self, proc: Any, go: Any, out: Any) -> None:
        self.proc, self.go, self.out = proc, go, out
        self.manifests: dict[int, Any] = {}

    def source(self) -> Any:
        from rollout_service.controller.weight_sync import NetworkSource

        async def read(version: int) -> Any:
            return self.manifests.get(version)

        return NetworkSource(read, timeout_s=RANK0_TIMEOUT_S)

    async def _next(self, what: str) -> tuple[Any, ...]:
        import queue

        try:
            got = await asyncio.to_thread(self.out.get, True, RANK0_TIMEOUT_S)
        except queue.Empty:
            raise ProfileFailed(
                f"the profile's broadcasting rank 0 gave no {what} in {RANK0_TIMEOUT_S:.0f} s"
                f" (alive: {self.proc.is_alive()})"
            ) from None
        if got[0] != what:
            raise ProfileFailed(f"the profile's broadcasting rank 0 said {got[0]}, not {what}")
        return tuple(got)

    async def publish(self, version: int) -> None:
        from areal_hex.weight_net import Manifest

        self.go.put(version)
        _, text, _ = await self._next("manifest")
        self.manifests[version] = Manifest.from_json(text)

    def regroup(self) -> None:
        """Leave the group: the next version forms a new one (a new name)."""
        self.go.put("regroup")

    async def sent(self) -> None:
        _, _, failures = await self._next("sent")
        if failures:
            raise ProfileFailed("a weight broadcast of the profile's update rounds failed")


RANK0_TIMEOUT_S = 120.0


@contextlib.contextmanager
def broadcaster(model_dir: Path, reloads: Reloads) -> Iterator[Rank0]:
    """A trainer's rank 0 broadcasting `model_dir` (`Reloads`), for as long as the block;
    its groups named anew each time (a server keeps the groups it joined before)."""
    import multiprocessing as mp

    from trainer_service.publish import broadcast_versions

    ctx = mp.get_context("spawn")
    go, out = ctx.Queue(), ctx.Queue()
    epoch = time.monotonic_ns() % 10**9
    args = (str(model_dir), reloads.address, None, reloads.bucket_mb, go, out)
    proc = ctx.Process(target=broadcast_versions, args=args, daemon=True,
                       kwargs={"netns": reloads.netns, "epoch": epoch})  # fmt: skip
    proc.start()
    try:
        yield Rank0(proc, go, out)
    finally:
        go.put(None)
        proc.join(10)
        if proc.is_alive():  # stuck in a broadcast nobody takes
            proc.kill()
            proc.join(5)


SYNC_CYCLES = 6  # timed, after one that includes the controller's start


async def idle_updates(
    url: str, cfg: ExperimentConfig, model_dir: Path, rank0: Rank0, n: int
) -> list[float]:
    """A synchronous run's update over the network: the run's controller pausing the
    server with nothing in flight, asking for each bucket `rank0` broadcasts, resuming.
    Each of `n` updates' seconds, after one that forms the group (as a run's first)."""
    rank0.regroup()
    pauses = []
    async with _controller(url, cfg, model_dir, 0, 1, rank0.source()) as (ctl, _, _):
        await ctl.dispatcher.probe_all()
        await ctl.weights.start(cfg.rollout.update_pause)
        for i in range(n + 1):
            version = FIRST_VERSION - 1 + i
            await rank0.publish(version)
            t0 = time.perf_counter()
            await ctl.update_weights(version, "")
            await rank0.sent()
            if i:
                pauses.append(time.perf_counter() - t0)
    return pauses


async def sync_cycle(url: str, cfg: ExperimentConfig, model_dir: Path) -> float:
    """The run's controller at η = 0, and in this process a trainer that trains nothing:
    it takes each batch from the buffer and publishes the next version (the same
    weights), as a synchronous run's trainer does after its step. The median of the
    seconds from a publish to the whole next batch: generation of a batch down to its
    longest answer, the weight reload and every hand-off between them."""
    from areal_hex.buffer.consumer import RedisTrajectoryConsumer, RedisWeightPublisher

    b = cfg.buffer.groups_per_step
    async with _controller(url, cfg, model_dir, 0, (SYNC_CYCLES + 2) * b) as (ctl, ep, _):
        sync_client = ep.sync_client()
        consumer = RedisTrajectoryConsumer(sync_client, PROFILE_RUN, cfg.buffer)
        publisher = RedisWeightPublisher(sync_client, PROFILE_RUN, cfg.buffer)

        stopped = threading.Event()  # the controller ended: no batch will come

        def next_batch() -> Any:
            t0 = time.perf_counter()
            while True:
                try:
                    return consumer.get_batch(b, timeout_s=1.0)
                except TimeoutError:
                    if stopped.is_set() or time.perf_counter() - t0 > STALL_S:
                        raise ProfileFailed(
                            f"a synchronous step's batch did not come from the server at "
                            f"{url} in {time.perf_counter() - t0:.0f} s"
                        ) from None

        def trainer() -> list[float]:
            waits = []
            for version in range(1, SYNC_CYCLES + 2):
                t0 = time.perf_counter()
                batch = next_batch()
                waits.append(time.perf_counter() - t0)
                consumer.ack(batch.entry_ids)
                publisher.set_version(version, str(model_dir))
            return waits[1:]

        producing = asyncio.create_task(ctl.run())
        producing.add_done_callback(lambda _: stopped.set())
        try:
            waits = await asyncio.to_thread(trainer)
        finally:
            ctl.request_stop()
            await asyncio.gather(producing, return_exceptions=True)
            consumer.close()
            sync_client.close()
    return statistics.median(waits)


def composed_rate(files: LocalProfileFiles, prof: Any, batch: int | None = None) -> float:
    """Samples/s of one instance of the local kind from the decode and prefill timings
    alone (the cost model's h_psi before `generation_efficiency`), at its plans' full
    batch or at `batch`."""
    from scheduler.cluster import load_cluster
    from scheduler.costmodel import rollout_config
    from scheduler.model_shape import load_model_shape
    from scheduler.workload import load_workload

    cl = load_cluster(files.cluster)
    m = load_model_shape(str(files.model))
    w = load_workload(files.workload).model_copy(update={"weight_sync": "disk"})
    opt = rollout_config(cl, cl.spec.node_groups[0], 1, m, w, prof, at_batch=batch)
    if opt is None:
        raise RuntimeError("the profiled model does not fit the local device's memory")
    return opt.samples_per_s


def replayed_cycle_s(files: LocalProfileFiles, prof: Any) -> float:
    """A synchronous step's generation and reload (its training step left out) as the
    cost model's replay has them for one instance and one trainer rank here, with the
    update `sync_cycle` timed: a reload from disk. A run that updates over the network
    measured its cycle from disk too; priced over the network here, the replay would
    charge the factor an update the cycle never made (on a box kind, 0.08 s against a
    0.01-s reload), and every synchronous plan of the kind would be priced that much
    short."""
    from scheduler.workload import load_workload

    w = load_workload(files.workload).model_copy(update={"weight_sync": "disk"})
    return cycle_s_replayed(files, prof, w)


def cycle_s_replayed(files: LocalProfileFiles, prof: Any, w: Any) -> float:
    """The replay's synchronous cycle (generation and update, the training step left
    out) of one instance and one trainer rank here, for workload `w`."""
    from scheduler.cluster import load_cluster
    from scheduler.model_shape import load_model_shape
    from scheduler.predict import TrainerLayout, predict_layout

    cl = load_cluster(files.cluster)
    trainer = TrainerLayout(((LOCAL_GROUP, 1),), 1)
    rates = predict_layout(
        cl, load_model_shape(str(files.model)), w, prof, [(LOCAL_GROUP, 1)], trainer
    ).synchronous
    bg = w.samples_per_step
    return bg / rates.pipeline_samples_per_s - bg / rates.training_samples_per_s
