"""What a server lent by the trainer's devices makes, and what lending costs the trainer.

A hybrid run (`rollout_service/controller/lend.py`, `hexctl/launch/run.py`) puts its last
`workflow.lent_servers` servers on the trainer's devices, with as many threads each as a
server of its own gets (the trainer's threads are not reduced), and:

- they generate only while the trainer waits for its batch; on a CPU host the devices
  they then share are the trainer's cores, where the controller, its reward workers and
  Valkey run too (`run.host_cores: trainer`), working for every server's samples;
- once the trainer has its batch the controller pauses the lent servers (their requests
  go on on the servers of their own), and the weight updates leave them out while they
  are paused; where the trainer waits for its next batch they load the version served
  and continue: one lend (a pause, a load and a continue) on the trainer's devices, and
  only where the trainer waits.

So, from what the profile measures:

- a lent server's rate is a server of its kind sharing its devices with the host's work
  (`generation_efficiency_shared`, or its own rate less `host_cpu_s_per_sample` a sample
  where that was not timed), less what the host's work for the servers of their own
  takes there. Asynchronous, they generate throughout and that work takes its share of
  every second: times 1 − h·G_own (h: the host's CPU seconds a sample, G_own: the
  servers of their own's samples/s). Synchronous, the step's groups are spread evenly
  and that work is a fixed h·(their samples) of the step (`lent_synchronous_rate`; the
  README job's hybrid sync, on a shared machine: the lent server made 48 % of the
  tokens, at the CPU a sample of the server of its own). Where the host's work runs
  beside the servers of their own (`host_cores: inference`), a lent server shares
  nothing: its kind's rate.
- each lend takes `lend_s` before the lent servers generate: the profiled switch
  (`context_switch_s`) plus the lent server's weight load with nothing in flight (the
  idle update, as a synchronous run's pause is priced), both on the trainer's devices.
- a lent server counts toward the trainer's batch only in whole groups: the first it
  takes ends `first_group_s` after it continues (the group's prefill and its longest
  answer decoded at the lent server's pace), so a wait shorter than the lend and that
  gains nothing from it.
"""

from __future__ import annotations

from dataclasses import replace

from scheduler.cluster import Cluster
from scheduler.costmodel import RolloutOption, group_occupancy, rollout_config
from scheduler.model_shape import ModelShape
from scheduler.profile import Profile
from scheduler.workload import Workload

MIN_SHARE = 1e-3  # of its devices a lent server keeps at least (its rate stays positive)


def lent_share(w: Workload, prof: Profile | None, kind: str, own_samples_per_s: float) -> float:
    """The share of the trainer's devices the host's work leaves the lent servers while
    the servers of their own make `own_samples_per_s`: 1 − h·G_own where the host's work
    runs on the trainer's side of a CPU host, else 1."""
    if w.host_work != "trainer" or prof is None:
        return 1.0
    h = prof.host_cpu_s_per_sample(kind)
    return max(MIN_SHARE, 1.0 - h * own_samples_per_s)


def lent_synchronous_rate(
    w: Workload, prof: Profile | None, kind: str, shared: float, own: int, lent: int
) -> float:
    """A lent server's rate in a synchronous step, `shared` its rate beside the host's
    work for its own samples, with `own` servers of their own and `lent` lent: the
    dispatcher spreads the batch's groups evenly (the least outstanding work, all
    admitted at once), and the host's work for the servers of their own's samples,
    h·B·own/N, is a fixed amount of the step on the trainer's devices, not a share of
    every second: each lent server's B/N samples take (B/N)/shared + h·B·own/(N·lent)
    s, so it makes 1 / (1/shared + h·own/lent) samples/s. (Asynchronous, the servers
    of their own generate throughout, and their host's work takes its share of every
    second: `lent_share`.)"""
    if w.host_work != "trainer" or prof is None:
        return shared
    h = prof.host_cpu_s_per_sample(kind)
    return 1.0 / (1.0 / shared + h * own / max(1, lent))


def lent_options(
    cl: Cluster,
    m: ModelShape,
    w: Workload,
    prof: Profile | None,
    instances: list[tuple[str, int]],
    opts: list[RolloutOption],
    lent: int,
    synchronous: bool = False,
) -> list[RolloutOption]:
    """`opts` (one per instance of `instances`, (node group, TP) each) with the last
    `lent` priced as lent servers: on the trainer's devices, beside the host's work where
    that runs there (see the module's docstring); `synchronous`: at a synchronous step's
    batch (`costmodel.rollout_config`)."""
    if lent <= 0:
        return opts
    own = opts[: len(opts) - lent]
    g_own = sum(o.samples_per_s for o in own)
    groups = {g.name: g for g in cl.spec.node_groups}
    # the lent servers share their devices with the host's work where it runs on the
    # trainer's side, and with nothing where it runs beside the servers of their own
    beside = w.host_work == "trainer"
    lent_w = w.model_copy(update={"host_work": "rollout" if beside else "trainer"})
    out = list(own)
    for (name, tp), o in zip(instances[len(own) :], opts[len(own) :], strict=True):
        at = rollout_config(cl, groups[name], tp, m, lent_w, prof, synchronous=synchronous)
        rate = (at or o).samples_per_s
        if synchronous:
            rate = lent_synchronous_rate(w, prof, o.kind, rate, len(own), lent)
        else:
            rate *= lent_share(w, prof, o.kind, g_own)
        out.append(at_rate(o, rate))
    return out


def at_rate(o: RolloutOption, samples_per_s: float) -> RolloutOption:
    """`o` making `samples_per_s`, its decode step and prefill as much longer or shorter:
    the synchronous replay times an instance by those, relative to the others'."""
    f = samples_per_s / o.samples_per_s
    return replace(
        o,
        samples_per_s=samples_per_s,
        tokens_per_s=o.tokens_per_s * f,
        step_s=o.step_s / f,
        prefill_s=o.prefill_s / f,
    )


def first_group_s(w: Workload, o: RolloutOption) -> float:
    """Seconds from a lent server's continue to the end of the first group it takes: the
    group's prefill and its longest answer (the expected longest of G,
    `costmodel.group_occupancy`) at `o`'s decode step, both as much slower as `o`
    generates below its decode and prefill timings alone (its efficiency, and the
    host's work where it shares its devices)."""
    alone = w.response_tokens * o.step_s / o.batch + o.prefill_s  # s a sample
    pace = max(1.0, 1.0 / max(o.samples_per_s, 1e-12) / max(alone, 1e-12))
    longest = w.response_tokens / group_occupancy(w)
    return pace * (longest * o.step_s + w.group_size * o.prefill_s)


def lend_s(switch_s: float, idle_update_s: float) -> float:
    """Seconds a lend takes before the lent servers generate: one switch and their weight
    load with nothing in flight (the lent servers load in parallel, each on its own
    devices)."""
    return switch_s + idle_update_s


def heap_trim_s(prof: Profile | None, kind: str, compute_s: float) -> float:
    """Seconds a trainer step of `compute_s` s on `kind` takes longer when it gives its
    heap back after every step, as a trainer sharing its devices does: the step at the
    profile's trimmed rate (`train_trim_tokens_per_s`) over its rate; 0 unmeasured."""
    rates = prof.kinds.get(kind) if prof is not None else None
    if rates is None or rates.train_trim_tokens_per_s is None:
        return 0.0
    return max(0.0, compute_s * (rates.train_tokens_per_s / rates.train_trim_tokens_per_s - 1))
