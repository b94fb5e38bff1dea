"""What a weight update costs: the pause of a rollout instance per publish (its fixed
seconds and its bytes over the link between the pools, for the sync mode in use), every
server paused as long as the slowest (one controller updates them as one,
`one_update`), and the pipeline's rate when the trainer's send is what bounds it (a
trainer that trains while it sends, `busy_sender_syncs`, and one whose send outlasts its
step, `sender_bound_rate`). The rollout and trainer options are `scheduler/costmodel.py`'s.
"""

from __future__ import annotations

import math

from scheduler.cluster import Cluster
from scheduler.costmodel import GB, RolloutOption, generation_at, pipeline_rate
from scheduler.model_shape import ModelShape
from scheduler.workload import Workload


def update_latency_s(cl: Cluster, from_zone: str, to_zone: str, own: float | None) -> float:
    """The latency in an instance's update: its kind's own update pause (`own`,
    `RolloutOption.update_pause_s`) on a link within one zone where profiled, else the
    link's."""
    if own is not None and from_zone == to_zone:
        return own
    return cl.link(from_zone, to_zone).latency_ms / 1e3


def weight_sync_s(
    cl: Cluster,
    m: ModelShape,
    w: Workload,
    from_zone: str,
    to_zone: str,
    own: float | None = None,
) -> float:
    """Pause of a rollout instance per publish, over the link between the two zones:
    `sync_terms`' fixed seconds (at `update_latency_s`) plus its bytes over the link."""
    ln = cl.link(from_zone, to_zone)
    nbytes, fixed = sync_terms(m, w, update_latency_s(cl, from_zone, to_zone, own))
    return fixed + nbytes / (ln.bandwidth_gbs * GB)


def one_update(pauses: list[float]) -> list[float]:
    """Each instance's pause when its controller updates its servers as one: it pauses
    every server, has each take its copy (from disk, or bucket after bucket of the
    trainer's broadcast) and resumes them all once the last has it
    (rollout_service/controller/weight_sync.py, steps 3-5), so a server whose copy came
    early waits, paused, for the slowest (a server beside the trainer and one behind a
    thin uplink both pause the uplink's copy)."""
    return [max(pauses, default=0.0)] * len(pauses)


def busy_sender_syncs(
    w: Workload, syncs: list[float], arrive: list[float], send_s: float
) -> list[float]:
    """Each instance's pause per publish (`syncs`: fixed seconds, then its copy's
    `arrive` seconds on the links) when rank 0 trains while it sends (an asynchronous
    run that training binds: the next batch is there when it publishes). Its send then
    takes `send_s` (the profile's broadcast timed while training,
    `TrainerOption.broadcast_s`), and the copy arrives no sooner; the server's own part
    of the update (the pause, its receive under its quota, the continue: the profile's
    `update_pause_s`, timed with a rank 0 that did nothing else) comes on top of it, not
    within it. Over the network only."""
    if w.weight_sync != "network":
        return list(syncs)
    return [s + max(0.0, send_s - a) for s, a in zip(syncs, arrive, strict=True)]


def sender_bound_rate(
    w: Workload,
    train: float,
    instances: list[tuple[RolloutOption, float, int]],
    busy: list[float],
    send_s: float,
    after_send_s: float = 0.0,
) -> tuple[float, float, list[float]]:
    """`pipeline_rate` with each instance's pause as the trainer's state sets it. At rate
    R the trainer waits k·(1/R − 1/t) for its batches per publish (k = publish_every·B·G
    samples a publish, t its rate); the part of its `send_s` that this wait does not
    cover it trains through, and each pause goes that share of the way from its free one
    (in `instances`) to its `busy` one (`busy_sender_syncs`). The trainer's send lasts
    as long as the longest pause in effect (it announces, the servers pause, every bucket
    goes), and its update waits for it (the live weights are being sent), then takes
    `after_send_s` before the next send starts: R is no more than k over the two. R: the
    largest rate the useful generation and the sends sustain with the pauses it sets
    (they grow with R), by bisection, capped by training. (rate, useful generation rate,
    the pauses in effect)."""
    if send_s <= 0.0:
        rate, gen = pipeline_rate(w, train, instances)
        return rate, gen, [s for _, s, _ in instances]
    k = w.publish_every * w.samples_per_step

    def at(rate: float) -> list[tuple[RolloutOption, float, int]]:
        wait = k * (1.0 / rate - 1.0 / train) if rate > 0 else send_s
        share = min(1.0, max(0.0, 1.0 - wait / send_s))
        pairs = zip(instances, busy, strict=True)
        return [(o, s + share * max(0.0, b - s), n) for (o, s, n), b in pairs]

    def holds(rate: float) -> bool:
        items = at(rate)
        cycle = max((s for _, s, _ in items), default=0.0) + after_send_s
        return generation_at(w, items, rate) >= rate and rate * cycle <= k

    lo, hi = 0.0, train
    if holds(train):
        lo = train
    else:
        for _ in range(50):
            mid = (lo + hi) / 2
            if holds(mid):
                lo = mid
            else:
                hi = mid
    items = at(lo)
    return lo, generation_at(w, items, lo), [s for _, s, _ in items]


def sync_terms(m: ModelShape, w: Workload, latency_s: float) -> tuple[float, float]:
    """(bytes each rollout machine receives per publish, fixed seconds) for the mode in use.
    disk: latency + factor · 2N bytes (AReaL-Hex's calibrated figure; no bytes where the
    storage is beside every node, `storage_on_links`). network (the trainer
    broadcasts buckets): the bytes as sent, the pause once and each bucket's fixed cost (its
    call to the server and the load between two decode steps): latency + buckets · overhead.
    The zone's latency is the pause of an update with requests in flight, once per update,
    not per bucket: the server pauses once and takes every bucket in that pause."""
    c = w.constants
    if w.weight_sync == "network":
        nbytes = c.weight_sync_bytes_per_param * m.params
        buckets = math.ceil(nbytes / (c.weight_sync_bucket_mb * 2**20))
        return nbytes, latency_s + buckets * c.weight_sync_bucket_overhead_ms / 1e3
    if not c.storage_on_links:  # the read is in the latency (a profiled pause)
        return 0.0, latency_s
    return c.weight_sync_factor * 2.0 * m.params, latency_s
