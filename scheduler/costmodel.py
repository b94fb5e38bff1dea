"""Analytic speed and memory of rollout instances and trainer configurations.

Rollout instance ψ = (node group, TP degree): decode is bound by HBM bandwidth (weights /
TP + the batch's KV cache read per step) unless compute-bound, the batch is limited by KV
memory, prefill by compute. Trainer configuration c = (GPU kind, node groups, DP size,
ZeRO stage): FLOPs per token at an MFU, ZeRO memory per stage, the DP gradient all-reduce
over the slowest link of the group. Weight sync: `scheduler/sync_cost.py`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace

from scheduler.catalogue import GpuKind
from scheduler.cluster import Cluster, NodeGroup
from scheduler.model_shape import ModelShape
from scheduler.profile import Profile
from scheduler.workload import CostConstants, Workload

GB = 1e9
BATCH_DIVISORS = (1, 2, 4)


@dataclass(frozen=True)
class RolloutOption:
    group: str  # node-group name
    kind: str
    zone: str
    tp: int
    batch: int  # concurrent requests the KV memory admits
    step_s: float  # decode step time at that batch
    prefill_s: float  # per sample (prompt share when the group shares a prefix)
    samples_per_s: float  # h_ψ
    tokens_per_s: float
    usd_per_h: float
    # seconds of each weight-sync pause that still generate (`Profile.reload_overlap_s`)
    pause_overlap_s: float = 0.0
    # the kind's own update pause in the workload's mode (`Profile.update_pause_s`): the
    # latency of a link within its zone when placed on nodes; None: the link's
    update_pause_s: float | None = None


@dataclass(frozen=True)
class TrainerOption:
    kind: str
    parts: tuple[tuple[str, int], ...]  # (node group, GPUs taken) in rank order
    per_node: int  # ranks per node (equal on every node)
    dp: int
    zero: int
    step_s: float  # one optimizer step of B·G samples, weight publish included
    compute_s: float
    comm_s: float
    publish_s: float
    mem_gb: float  # per GPU
    samples_per_s: float  # t_c
    usd_per_h: float
    zones: tuple[str, ...] = field(default=())
    # Of step_s: the controller's CPU work on the trainer's own cores (a CPU trainer beside
    # the controller, asynchronous runs only; 0 on GPUs).
    host_s: float = 0.0
    # A trainer across GPU kinds (heterogeneous data parallelism): the kind of each part
    # and the samples/s one of its ranks trains, which set the ranks' shares of a step
    # (`trainer.rank_speeds`). `kind` is then a label, the kinds joined by "+".
    part_kinds: tuple[str, ...] = field(default=())
    part_speeds: tuple[float, ...] = field(default=())
    # Of a synchronous run's step, the compute: its weight write is not beside it (the
    # profile's rate for that where measured; None: `compute_s`).
    sync_compute_s: float | None = None
    # Over the network: the seconds rank 0's kind was measured to take sending a version
    # (`Profile.train_broadcast_s`), the shortest any update pause can be; 0: unmeasured.
    broadcast_s: float = 0.0
    # ... and the step's work after its wait for the last send (`Profile.
    # train_after_send_s`): a send that outlasts the step's passes sets a cycle of the
    # send plus this per publish (`sender_bound_rate`); 0: unmeasured.
    after_send_s: float = 0.0

    @property
    def kinds(self) -> tuple[str, ...]:
        """The GPU kinds the trainer runs on, fastest first (one for a one-kind trainer)."""
        return tuple(dict.fromkeys(self.part_kinds)) or (self.kind,)

    @property
    def mixed(self) -> bool:
        return len(self.kinds) > 1


def decode_step_s(
    m: ModelShape,
    kind_bw: float,
    kind_tflops: float,
    tp: int,
    batch: int,
    ctx: float,
    intra_gbs: float,
    k: CostConstants,
) -> float:
    """One decode step of `batch` sequences with mean context `ctx` on a TP-`tp` instance."""
    weight_b = 2.0 * m.params / tp
    kv_b = batch * ctx * m.kv_bytes_per_token / min(tp, m.kv_heads)
    mem_s = (weight_b + kv_b) / (kind_bw * GB * k.decode_bw_efficiency)
    flop_s = 2.0 * m.params * batch / tp / (kind_tflops * 1e12 * k.prefill_mfu)
    # Two all-reduces of (batch, hidden) bf16 activations per layer when tp > 1.
    comm_s = 0.0
    if tp > 1:
        vol = 2 * (tp - 1) / tp * batch * m.hidden * 2
        comm_s = 2 * m.layers * (k.tp_allreduce_latency_ms / 1e3 + vol / (intra_gbs * GB))
    return max(mem_s, flop_s) + comm_s + k.decode_step_overhead_ms / 1e3


def rollout_config(
    cl: Cluster,
    g: NodeGroup,
    tp: int,
    m: ModelShape,
    w: Workload,
    prof: Profile | None,
    batch_div: int = 1,
    synchronous: bool = False,
    at_batch: int | None = None,
) -> RolloutOption | None:
    """The instance's throughput, or None when the weights or one request do not fit.
    `synchronous`: its batch as a synchronous step's gate admits it (`synchronous_cap`),
    not the asynchronous gate's steady state (`inflight_cap`). `at_batch`: at that
    batch instead (within its memory), as a profile's load held it."""
    kind = cl.kinds[g.name]
    k = kind_constants(w.constants, kind)
    usable = kind.hbm_gb * GB * k.hbm_utilization - k.runtime_reserve_gb * GB
    free = usable - 2.0 * m.params / tp
    per_req = (w.prompt_tokens + w.max_response_tokens) * m.kv_bytes_per_token / min(tp, m.kv_heads)
    if free < per_req:
        return None
    # no instance ever holds more requests than the staleness gate lets run in all
    gate = synchronous_cap(w) if synchronous else inflight_cap(w)
    batch = int(min(k.max_running_requests, free // per_req, gate)) // batch_div
    if at_batch is not None:
        batch = int(min(at_batch, free // per_req))
    if batch < 1:
        return None
    ctx = w.prompt_tokens + w.response_tokens / 2  # mean context over a response
    args = (kind.hbm_gbs, kind.bf16_tflops, tp, batch, ctx, g.intra_node.bandwidth_gbs, k)
    step = decode_step_s(m, *args)
    if prof is not None and prof.has(kind.name):
        step = (
            prof.decode_step_s(kind.name, batch)
            * step
            / decode_step_s(
                m, kind.hbm_gbs, kind.bf16_tflops, 1, batch, ctx, g.intra_node.bandwidth_gbs, k
            )
        )
    share = 1 / w.group_size if k.prefix_cache else 1.0
    prefill_flops = 2.0 * m.params * w.prompt_tokens * share
    prefill = prefill_flops / tp / (kind.bf16_tflops * 1e12 * k.prefill_mfu)
    if prof is not None and prof.has(kind.name):
        prefill = w.prompt_tokens * share / prof.prefill_tokens_per_s(kind.name) / tp
    # Continuous batching: `batch` sequences advance one token per step; prefill steals
    # compute from the same GPUs, so per sample it adds serially.
    per_sample = w.response_tokens * step / batch + prefill
    if prof is not None and prof.has(kind.name):
        shared = prof.generation_efficiency_shared(kind.name)
        if w.host_work == "rollout" and shared is not None:  # measured sharing its cores
            per_sample /= shared
        else:
            per_sample /= prof.generation_efficiency(kind.name, batch)
            if w.host_work == "rollout":  # the controller's CPU comes out of the instance's
                per_sample += prof.host_cpu_s_per_sample(kind.name)
    return RolloutOption(
        group=g.name,
        kind=kind.name,
        zone=g.zone,
        tp=tp,
        batch=batch,
        step_s=step,
        prefill_s=prefill,
        samples_per_s=1.0 / per_sample,
        tokens_per_s=w.response_tokens / per_sample,
        usd_per_h=tp * g.usd_per_gpu_hour,
        # measured in one mode: a pause of the other is charged whole
        pause_overlap_s=0.0 if prof is None else prof.reload_overlap_s(kind.name, w.weight_sync),
        update_pause_s=None if prof is None else prof.update_pause_s(kind.name, w.weight_sync),
    )


def scaled(r: RolloutOption, factor: float) -> RolloutOption:
    """`r` generating `factor` times as fast (what its links carry: scheduler/traffic.py),
    as if each decode step and prefill took 1/`factor` as long: the rate, and the groups'
    latency the staleness window and the synchronous replay read."""
    if factor >= 1.0:
        return r
    return replace(
        r,
        samples_per_s=r.samples_per_s * factor,
        tokens_per_s=r.tokens_per_s * factor,
        step_s=r.step_s / factor,
        prefill_s=r.prefill_s / factor,
    )


def kind_constants(k: CostConstants, kind: GpuKind) -> CostConstants:
    """The workload's constants with the efficiencies this GPU kind sets."""
    own = {
        f: getattr(kind, f)
        for f in ("train_mfu", "prefill_mfu", "decode_bw_efficiency")
        if getattr(kind, f) is not None
    }
    return k.model_copy(update=own) if own else k


WINDOW_LAG = 0.5  # steps a group waits for a slot after the gate opens, on average


def inflight_cap(w: Workload) -> int:
    """Requests the staleness gate lets run at once. submitted ≤ (v + η + 1)·B with B groups
    in the trainer's step leaves η·B groups admitted; about B of them have finished and wait
    for the next step (the trainer takes B at a time), so (η - 1)·B generate (at least B/2).
    A generating group holds its admission until its longest answer ends while its shorter
    answers have already freed their slots: mean length / expected longest of G run."""
    return max(1, int(generating_groups(w) * w.group_size * group_occupancy(w)))


def generating_groups(w: Workload) -> float:
    """Groups the staleness gate lets generate at once (`inflight_cap`): (η - 1)·B, at
    least B/2."""
    return max(0.5, max(1, w.max_staleness) - 1) * w.groups_per_step


def synchronous_cap(w: Workload) -> int:
    """Requests a synchronous step (η = 0) has running at its start: the gate admits the
    whole batch at once (submitted ≤ (v + 1)·B, none of it trained or waiting), so every
    answer of its B groups generates together until the first ends. The controller's cap
    on groups in flight is the replay's (`simulator.simulate`), not the instance's."""
    return w.samples_per_step


def pipeline_rate(
    w: Workload, train: float, instances: list[tuple[RolloutOption, float, int]]
) -> tuple[float, float]:
    """(rate, useful generation rate) of a plan with training rate `train` and rollout
    instances (option, s seconds paused per publish, count).

    Publishes come every k·B·G trained samples, so at rate R an instance pauses a share
    s·R/(kBG) and generates h·(1 − s·R/(kBG)). A group is useful when it lands inside
    the staleness window (`window_fraction`); the rest come back too stale and are
    dropped. R is the largest rate the useful generation sustains, capped by training:
    the root of Σ h·(1 − s·R/(kBG))·fraction(R) = R (the left side falls as R grows),
    by bisection."""
    at_train = generation_at(w, instances, train)
    if at_train >= train:
        return train, at_train
    lo, hi = 0.0, train
    for _ in range(50):
        mid = (lo + hi) / 2
        if generation_at(w, instances, mid) >= mid:
            lo = mid
        else:
            hi = mid
    return lo, generation_at(w, instances, lo)


def generation_at(
    w: Workload,
    instances: list[tuple[RolloutOption, float, int]],
    rate: float,
    window: bool = True,
) -> float:
    """Samples/s the instances (option, pause per publish, count) generate at pipeline
    rate `rate`, less their pauses (but the seconds of each that still generate,
    `pause_overlap_s`) and (with `window`) the groups that miss the staleness window."""
    k = w.publish_every * w.samples_per_step
    return sum(
        n
        * r.samples_per_s
        * max(0.0, 1 - max(0.0, s - r.pause_overlap_s) * rate / k)
        * (window_fraction(w, r, s, rate) if window else 1.0)
        for r, s, n in instances
    )


def window_fraction(w: Workload, r: RolloutOption, sync_s: float, rate: float) -> float:
    """Share of instance `r`'s groups that finish inside the staleness window at `rate`.

    A group admitted as the gate opens for step s must have finished when the trainer
    starts step s, η steps of B·G/R seconds later, less `WINDOW_LAG` steps spent waiting
    for a slot; meanwhile the instance pauses s seconds per k steps. The group's longest
    answer, decoded at the instance's full batch, must fit what is left: ℓ* tokens.
    Answers are L·U(0.5, 1.5) (capped at the maximum), so the longest of G fits with
    probability (ℓ*/L − 0.5)^G."""
    if rate <= 0:
        return 1.0
    window = max(0.5, w.max_staleness - WINDOW_LAG)
    left = window * w.samples_per_step / rate - window * sync_s / w.publish_every
    tokens = (left - r.prefill_s) / r.step_s
    if tokens >= w.max_response_tokens:
        return 1.0
    x = tokens / w.response_tokens - 0.5
    return min(1.0, max(0.0, x)) ** w.group_size


def group_occupancy(w: Workload) -> float:
    """A group's mean answer over its longest (`_occupancy`): the share of its longest
    answer's decode the group's slots hold on average."""
    return _occupancy(w.max_response_tokens, w.response_tokens, w.group_size)


@functools.lru_cache(maxsize=256)
def _occupancy(cap: int, mean: int, g: int, points: int = 400) -> float:
    """E[length] / E[max of G lengths], lengths L·U(0.5, 1.5) capped at the maximum (the
    simulator's spread); the max of G uniforms has density G·u^(G-1)."""
    us = [(j + 0.5) / points for j in range(points)]
    one = sum(min(cap, mean * (0.5 + u)) for u in us) / points
    top = sum(min(cap, mean * (0.5 + u)) * g * u ** (g - 1) for u in us) / points
    return one / max(1e-9, top)


def tp_degrees(g: NodeGroup, m: ModelShape) -> list[int]:
    """TP stays inside a machine and divides the attention heads."""
    out, t = [], 1
    while t <= g.gpus_per_node:
        if g.gpus_per_node % t == 0 and m.heads % t == 0:
            out.append(t)
        t *= 2
    return out


def rollout_configs(
    cl: Cluster, m: ModelShape, w: Workload, prof: Profile | None = None
) -> list[RolloutOption]:
    out: list[RolloutOption] = []
    for g in cl.spec.node_groups:
        for tp in tp_degrees(g, m):
            if w.rollout_tp is not None and tp != w.rollout_tp:
                continue
            # Variants at 1/2 and 1/4 of the memory-limited batch: the staleness gate caps
            # requests in flight, and a smaller batch is how an instance lives with it.
            seen: set[int] = set()
            for div in BATCH_DIVISORS:
                rc = rollout_config(cl, g, tp, m, w, prof, div)
                if rc is not None and rc.batch not in seen:
                    seen.add(rc.batch)
                    out.append(rc)
    return out


def reference_in_trainer(w: Workload) -> bool:
    """The reference forward runs in the trainer: KL is on and no task of role reference
    computes the reference's log-probs for it."""
    return w.reference_model and not any(t.role == "reference" for t in w.tasks)


def trained_models(w: Workload) -> int:
    """Models whose gradients each step all-reduces: the actor, and PPO's critic."""
    return 2 if w.critic else 1


def train_passes(w: Workload) -> int:
    """Forward-equivalents per token of a step (a backward counts as two): the actor's
    forward + backward (3) and proximal log-prob recompute (1), the reference forward (1)
    where the trainer computes it, and the critic's values forward (1) and its own
    forward + backward (3)."""
    return 4 + (1 if reference_in_trainer(w) else 0) + (4 if w.critic else 0)


def train_flops_per_sample(m: ModelShape, w: Workload) -> float:
    """2N per token and forward-equivalent (`train_passes`); attention adds
    4·L·heads·head_dim·ctx per token and pass."""
    toks = w.prompt_tokens + w.response_tokens
    passes = train_passes(w)
    dense = 2.0 * m.params * passes
    attn = 4.0 * m.layers * m.heads * m.head_dim * (toks / 2) * passes
    return toks * (dense + attn)


def train_memory_gb(m: ModelShape, w: Workload, dp: int, zero: int) -> float:
    """Per-GPU memory: ZeRO-sharded model states (the critic's beside the actor's),
    reference weights, activations (one model's at a time)."""
    k, psi = w.constants, float(m.params)
    opt = k.adam_bytes_per_param - 4.0  # optimizer states (fp32 master, m, v)
    states = {
        0: k.adam_bytes_per_param * psi,
        1: 4.0 * psi + opt * psi / dp,
        2: 2.0 * psi + (opt + 2.0) * psi / dp,
        3: k.adam_bytes_per_param * psi / dp,
    }[zero] * trained_models(w)
    ref = (2.0 * psi / (dp if zero == 3 else 1)) if reference_in_trainer(w) else 0.0
    seq = w.prompt_tokens + w.max_response_tokens  # one sequence per micro-batch
    act = seq * m.hidden * (k.act_checkpoint_bytes_per_hidden * m.layers)
    act += seq * m.hidden * k.act_layer_bytes_per_hidden + seq * m.vocab * 4.0
    return (states + ref + act) / GB + k.runtime_reserve_gb


def allreduce_s(
    m: ModelShape, dp: int, nodes: int, zero: int, intra: float, inter: float, latency_ms: float
) -> float:
    """Gradient traffic per step: ring all-reduce moves 2(p-1)/p · M per GPU (M = 2Ψ bf16
    bytes); ZeRO-3 adds the parameter all-gather (3Ψ vs 2Ψ in the ZeRO paper). With several
    nodes the inter-node ring carries 2(n-1)/n · M per node over the slowest link."""
    if dp == 1:
        return 0.0
    mbytes, factor = 2.0 * m.params, (1.5 if zero == 3 else 1.0)
    per_node = dp // nodes
    t = 0.0
    if per_node > 1:
        t += factor * 2 * (per_node - 1) / per_node * mbytes / (intra * GB)
    if nodes > 1:
        t += factor * 2 * (nodes - 1) / nodes * mbytes / (inter * GB)
        t += 2 * (nodes - 1) * latency_ms / 1e3
    return t
