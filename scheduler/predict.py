"""The cost model's rates for one given layout, in the mode it runs.

`make_plan` searches layouts; this module prices a layout that is already fixed — the one
a plan chose, or the one a local run starts without a plan — so that every run can be
held against a prediction made with the same cost model:

- generation: Σ h_ψ of the instances (samples/s while they generate, no pauses);
- training: B·G / the trainer's step (compute + all-reduce + publish);
- weight sync: the pause of the slowest instance per publish;
- pipeline, asynchronous: `milp.evaluate` (min of training and generation with the pauses
  at the rate reached), the figure a plan reports;
- pipeline, synchronous (η = 0): the discrete-event replay, because a synchronous step is
  generation of one batch (down to its longest answer) + training + sync, never overlapped.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from scheduler.cluster import Cluster
from scheduler.costmodel import (
    GB,
    RolloutOption,
    TrainerOption,
    decode_step_s,
    generating_groups,
    rollout_config,
    scaled,
)
from scheduler.lending import first_group_s, lent_options
from scheduler.model_shape import ModelShape
from scheduler.partition import copies_arrive_s, sync_on_topology
from scheduler.profile import Profile
from scheduler.simulator import SimInstance, simulate
from scheduler.sync_cost import (
    busy_sender_syncs,
    one_update,
    sender_bound_rate,
    sync_terms,
    update_latency_s,
    weight_sync_s,
)
from scheduler.task_costs import placed_tasks_rate
from scheduler.topology import Topology
from scheduler.traffic import traffic_on_topology
from scheduler.trainers import cost_trainer
from scheduler.workload import Workload


@dataclass(frozen=True)
class TrainerLayout:
    parts: tuple[tuple[str, int], ...]  # (node group, ranks taken) in rank order
    per_node: int


@dataclass(frozen=True)
class LayoutNodes:
    """The machines a layout runs on (a plan's placement): the trainer's first machine,
    which sends the weights, and each rollout instance's machine, in instance order."""

    writer: str
    rollout: tuple[str, ...]


@dataclass(frozen=True)
class LayoutRates:
    pipeline_samples_per_s: float
    generation_samples_per_s: float
    training_samples_per_s: float
    weight_sync_s: float

    def as_dict(self) -> dict[str, float]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class LayoutPrediction:
    asynchronous: LayoutRates
    synchronous: LayoutRates
    lent_samples_per_s: float = 0.0  # hybrid: the lent instances' rate while they generate
    # hybrid: seconds from a lend's continue to the end of a lent instance's first group
    lent_first_group_s: float = 0.0

    def for_mode(self, mode: str) -> LayoutRates:
        return self.synchronous if mode == "sync" else self.asynchronous


class LayoutError(ValueError):
    """The layout does not fit the cluster or the model (what and where in the message)."""


def _rollouts(
    cl: Cluster,
    m: ModelShape,
    w: Workload,
    prof: Profile | None,
    instances: list[tuple[str, int]],
    synchronous: bool = False,
    max_inflight_groups: int | None = None,
) -> list[RolloutOption]:
    """Each instance at its full batch; asynchronous with `max_inflight_groups` (the
    run's controller's cap), at the batch the controller holds it at (`held_batches`)."""
    groups = {g.name: g for g in cl.spec.node_groups}
    out = []
    for name, tp in instances:
        if name not in groups:
            raise LayoutError(f"rollout instance on node group {name!r}: not in {cl.name!r}")
        opt = rollout_config(cl, groups[name], tp, m, w, prof, synchronous=synchronous)
        if opt is None:
            raise LayoutError(f"rollout instance (TP {tp}) on {name!r}: the model does not fit")
        out.append(opt)
    if synchronous or max_inflight_groups is None:
        return out
    held = held_batches(w, [o.batch for o in out], max_inflight_groups)
    for i, ((name, tp), b) in enumerate(zip(instances, held, strict=True)):
        if b < out[i].batch:
            out[i] = rollout_config(cl, groups[name], tp, m, w, prof, at_batch=b) or out[i]
    return out


def held_batches(w: Workload, batches: list[int], max_inflight_groups: int) -> list[int]:
    """The requests an asynchronous run's controller keeps on each server of full batch
    `batches`: its groups in flight (`max_inflight_groups`, no more than the staleness gate
    lets generate, `generating_groups`) spread evenly, as the dispatcher sends each
    request to the server with the least outstanding work, none above its own batch
    (what a server cannot take goes to the others)."""
    left = min(max_inflight_groups, generating_groups(w)) * w.group_size
    held = list(batches)
    order = sorted(range(len(batches)), key=lambda i: batches[i])
    for n, i in enumerate(order):
        held[i] = max(1, min(batches[i], int(left / (len(order) - n))))
        left -= held[i]
    return held


def predict_layout(
    cl: Cluster,
    m: ModelShape,
    w: Workload,
    prof: Profile | None,
    instances: list[tuple[str, int]],
    trainer: TrainerLayout,
    max_inflight_groups: int | None = None,
    nodes: LayoutNodes | None = None,
    task_groups: dict[str, str] | None = None,
    lent: int = 0,
) -> LayoutPrediction:
    """Rates of `instances` ((node group, TP) each) and `trainer` in both modes; `w` holds
    the asynchronous run's η (the synchronous one runs at η = 0, publishing every step).
    With `nodes` on a cluster that declares racks or NICs, each instance's weight sync
    is priced over the links its copy crosses (`partition.sync_on_topology`); otherwise
    over its zone's link. `task_groups` (task -> node group): where the workflow's
    reference and reward-model tasks run; the pipeline runs no faster than the slowest
    scores (`task_costs.placed_tasks_rate`), in either mode. `lent` (hybrid): the last
    instances sit on the trainer's devices (`lending.lent_options`)."""
    if not instances:
        raise LayoutError("a layout needs at least one rollout instance")
    if lent >= len(instances):
        raise LayoutError(
            f"{lent} lent of {len(instances)} rollout instances: a hybrid keeps at least one "
            "of its own"
        )
    if nodes is not None and len(nodes.rollout) != len(instances):
        raise LayoutError(f"{len(instances)} rollout instances but {len(nodes.rollout)} nodes")
    own = _rollouts(cl, m, w, prof, instances, max_inflight_groups=max_inflight_groups)
    opts = lent_options(cl, m, w, prof, instances, own, lent)
    tr = cost_trainer(cl, m, w, trainer.parts, trainer.per_node, prof)
    if tr is None:
        raise LayoutError(f"trainer {trainer.parts}: the model's states do not fit its devices")
    links = _syncs(cl, m, w, opts, tr, nodes)
    arrive = _arrivals(cl, m, w, opts, tr, nodes)
    busy = one_update(busy_sender_syncs(w, links, arrive, tr.broadcast_s))
    a_opts, a_tr = _with_traffic(cl, m, w, opts, tr, nodes, blocks=True)
    idle = _idle_syncs(cl, w, prof, opts, tr, links)
    asyn = _asynchronous(w, prof, a_opts, a_tr, one_update(links), idle, busy)
    sync_w = w.model_copy(update={"max_staleness": 0, "publish_every": 1})
    # each instance's batch as a synchronous step fills it: the whole batch admitted at once
    sync_opts = _rollouts(cl, m, sync_w, prof, instances, synchronous=True)
    sync_opts = lent_options(cl, m, sync_w, prof, instances, sync_opts, lent, synchronous=True)
    s_opts, s_tr = _with_traffic(cl, m, sync_w, sync_opts, tr, nodes, blocks=False)
    syn = _synchronous(
        cl, m, sync_w, prof, s_opts, s_tr, max_inflight_groups,
        _syncs(cl, m, sync_w, sync_opts, tr, nodes),
    )  # fmt: skip
    bound = placed_tasks_rate(cl, m, w, prof, task_groups or {})
    if bound is not None:
        asyn, syn = (
            replace(r, pipeline_samples_per_s=min(r.pipeline_samples_per_s, bound[0]))
            for r in (asyn, syn)
        )
    lent_opts = opts[len(opts) - lent :] if lent else []
    lent_rate = sum(o.samples_per_s for o in lent_opts)
    first = max((first_group_s(w, o) for o in lent_opts), default=0.0)
    return LayoutPrediction(asyn, syn, lent_rate, first)


def _with_traffic(
    cl: Cluster,
    m: ModelShape,
    w: Workload,
    opts: list[RolloutOption],
    tr: TrainerOption,
    nodes: LayoutNodes | None,
    blocks: bool,
) -> tuple[list[RolloutOption], TrainerOption]:
    """The instances and trainer with the head node's traffic on the plan's machines
    (`traffic.traffic_on_topology`): each instance at the rate its links carry, the
    trainer's step with its read of the records and, with `blocks`, its network send
    (`TrafficCost.step_s`)."""
    if nodes is None or not Topology(cl).declared:
        return opts, tr
    rates = [o.samples_per_s for o in opts]
    tc = traffic_on_topology(cl, m, w, nodes.writer, list(nodes.rollout), rates, tr.samples_per_s)
    step = tc.step_s(tr.step_s, w.publish_every, blocks)
    new_tr = replace(tr, step_s=step, samples_per_s=w.samples_per_step / step)
    return [scaled(o, f) for o, f in zip(opts, tc.gen_factors, strict=True)], new_tr


def _syncs(
    cl: Cluster,
    m: ModelShape,
    w: Workload,
    opts: list[RolloutOption],
    tr: TrainerOption,
    nodes: LayoutNodes | None,
) -> list[float]:
    """Each instance's weight-sync pause per publish over the links, with its kind's own
    update pause where profiled (`sync_cost.update_latency_s`)."""
    if nodes is not None and Topology(cl).declared:
        pauses = [o.update_pause_s for o in opts]
        return sync_on_topology(cl, m, w, nodes.writer, list(nodes.rollout), pauses=pauses)
    return [weight_sync_s(cl, m, w, tr.zones[0], o.zone, o.update_pause_s) for o in opts]


def _arrivals(
    cl: Cluster,
    m: ModelShape,
    w: Workload,
    opts: list[RolloutOption],
    tr: TrainerOption,
    at: LayoutNodes | None,
) -> list[float]:
    """The bytes part of each of `_syncs`' pauses: seconds until the instance's copy
    of the weights arrived."""
    if at is not None and Topology(cl).declared:
        return copies_arrive_s(Topology(cl), m, w, at.writer, list(at.rollout))
    nbytes = sync_terms(m, w, 0.0)[0]
    return [nbytes / (cl.link(tr.zones[0], o.zone).bandwidth_gbs * GB) for o in opts]


def _idle_syncs(
    cl: Cluster,
    w: Workload,
    prof: Profile | None,
    opts: list[RolloutOption],
    tr: TrainerOption,
    link_syncs: list[float],
) -> list[float | None]:
    """Each instance's update with nothing in flight, where its kind's profile timed one
    (None where not): from disk, the idle reload as measured; over the network, its copy's
    bytes over the links as in `link_syncs`, with the in-flight latency in them replaced by
    the kind's idle update (the network round's where timed, else the idle reload). A
    server that is idle takes an update sooner, but its copy crosses the same links."""
    out: list[float | None] = []
    for o, link in zip(opts, link_syncs, strict=True):
        idle = prof.reload_idle_s(o.kind) if prof is not None else None
        own = prof.update_pause_idle_s(o.kind, w.weight_sync) if prof is not None else None
        if idle is not None and w.weight_sync == "disk":
            out.append(idle)
        elif own is not None or idle is not None:
            busy_latency = update_latency_s(cl, tr.zones[0], o.zone, o.update_pause_s)
            out.append(link + (idle if own is None else own) - busy_latency)
        else:
            out.append(None)
    return out


def _asynchronous(
    w: Workload,
    prof: Profile | None,
    opts: list[RolloutOption],
    tr: TrainerOption,
    syncs: list[float],
    idle: list[float | None],
    busy: list[float] | None = None,
) -> LayoutRates:
    """`busy`: each instance's pause when the trainer trains while it sends
    (`sync_cost.busy_sender_syncs`; None: `syncs`)."""
    if w.host_work == "rollout" and prof is not None and w.weight_sync == "disk":
        # the controller beside the servers: their reloads as the profile measured them
        measured = [prof.reload_shared_s(o.kind) for o in opts]
        syncs = [s if r is None else r for s, r in zip(syncs, measured, strict=True)]
    # no pause shorter than the trainer's broadcast (over the network, where profiled)
    syncs = [max(s, tr.broadcast_s) for s in syncs]
    # generation with the weight-sync pauses at the rate reached: a pause holds requests
    # in flight, so it counts as time the servers have work; where training binds, the
    # trainer trains while it sends and each pause is its `busy` one
    items = [(o, s, 1) for o, s in zip(opts, syncs, strict=True)]
    rate, gen_at, syncs = sender_bound_rate(
        w, tr.samples_per_s, items, busy or syncs, tr.broadcast_s, tr.after_send_s
    )
    train = w.samples_per_step / tr.step_s
    pause = max(_async_pause(syncs, idle, gen_at / train), tr.broadcast_s)
    return LayoutRates(rate, gen_at, train, pause)


IDLE_AT_SLACK = 0.25  # generation this much above training: every update finds idle servers


def _async_pause(syncs: list[float], idle: list[float | None], slack: float) -> float:
    """The weight-sync pause an asynchronous run sees. Servers that generate faster than
    the trainer consumes finish the work the staleness gate admitted before the trainer
    publishes, so its update finds them idle (`idle`: `_idle_syncs`, over the same
    links); at or below the trainer's rate they are mid-batch (the in-flight reload).
    Between the two, the share of updates that find them busy falls with the slack (the
    tiny example here: 0.006-0.007 s at 1.22-1.31 x, 0.012-0.019 s at 1.03-1.15 x, 0.029 s
    at 0.91 x). The pipeline rate does not depend on it: with slack, training binds."""
    busy = max(syncs, default=0.0)
    if not idle or None in idle or slack <= 1.0:
        return busy
    share_idle = min(1.0, (slack - 1.0) / IDLE_AT_SLACK)
    return busy - (busy - max(i for i in idle if i is not None)) * share_idle


def _synchronous(
    cl: Cluster,
    m: ModelShape,
    w: Workload,
    prof: Profile | None,
    opts: list[RolloutOption],
    tr: TrainerOption,
    max_inflight: int | None,
    link_syncs: list[float],
) -> LayoutRates:
    bg = w.samples_per_step
    idle_syncs = _idle_syncs(cl, w, prof, opts, tr, link_syncs)
    ctx = w.prompt_tokens + w.response_tokens / 2
    sim_insts = []
    syncs = []
    for i, o in enumerate(opts):
        g = next(g for g in cl.spec.node_groups if g.name == o.group)
        kind = cl.kinds[o.group]

        # a box kind's steps at the share of its timings its continuous load reached
        eff = prof.replay_efficiency(o.kind, o.batch) if prof is not None else 1.0

        def step_fn(n: int, o: RolloutOption = o, g=g, kind=kind, eff=eff) -> float:
            def at(b: int) -> float:
                return decode_step_s(
                    m, kind.hbm_gbs, kind.bf16_tflops, o.tp, b, ctx,
                    g.intra_node.bandwidth_gbs, w.constants,
                )  # fmt: skip

            return at(n) * o.step_s / at(o.batch) / eff

        # nothing is generating when a synchronous run updates: the idle update
        idle = idle_syncs[i]
        sync = link_syncs[i] if idle is None else idle
        own = prof.update_pause_idle_s(o.kind, w.weight_sync) if prof is not None else None
        if own is None:  # no shorter than the trainer's broadcast, timed while it trained;
            sync = max(sync, tr.broadcast_s)  # the idle update's held an idle sender's
        syncs.append(sync)
        sim_insts.append((f"{o.group}-{i}", o.batch, o.prefill_s / eff, step_fn))
    # the servers resume together, once the slowest has its copy
    sim_insts = [
        SimInstance(name, batch, prefill, sync, fn)
        for (name, batch, prefill, fn), sync in zip(sim_insts, one_update(syncs), strict=True)
    ]
    # the controller works while the trainer waits for the batch: no host-CPU share;
    # nor does the weight write share the step (it ends in the wait)
    step = tr.step_s - tr.host_s
    if tr.sync_compute_s is not None:
        step += tr.sync_compute_s - tr.compute_s
    res = simulate(
        sim_insts,
        groups_per_step=w.groups_per_step,
        group_size=w.group_size,
        max_staleness=0,
        publish_every=1,
        train_step_s=step,
        mean_len=w.response_tokens,
        max_len=w.max_response_tokens,
        steps=12,
        max_inflight_groups=max_inflight,
    )
    # per second of server work: a synchronous batch ends in a tail of few requests
    gen = res.generation_samples_per_s / max(1e-9, res.rollout_busy_frac)
    # the profile's cycle over the replay's, measured with the whole batch on one
    # instance of the kind: it stretches the replay of any number of them (its hand-offs
    # are there too; docs/fidelity.md, "A box node's decode step over 2 s"). A layout of
    # several kinds has no such measure: there the replay alone
    factor = 1.0
    if prof is not None and len({o.kind for o in opts}) == 1:
        factor = prof.sync_cycle_factor(opts[0].kind)
    cycle = factor * max(0.0, bg / res.samples_per_s - step)
    return LayoutRates(bg / (cycle + step), gen, bg / step, max(syncs, default=0.0))
