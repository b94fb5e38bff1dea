"""The traffic besides the weights that crosses the interconnect, and what it costs.

Valkey and the rollout controller run on the head node, which sits on the spine of the
trainer's zone, outside every rack (a box's launcher namespace). Three flows reach it:

- HTTP requests, head -> each inference server: the prompt's ids once per sample;
- HTTP responses, server -> head: output ids, log-probs and versions per sample;
- trajectories, head -> the trainer's first machine: the group records its rank 0 reads
  from Valkey at the start of every step (the controller writes them beside Valkey).

`sample_bytes` sizes each per sample from the workload's lengths and the wire constants
(`CostConstants.http_*`, `record_*`, measured on the real server, client and codec).
Their cost on each shared resource (a NIC, a rack uplink; `topology.Topology`), at the
rate the pipeline can run:

- generation: an instance's responses and requests must fit what its links have left;
  where they do not, its rate falls to what does (`TrafficCost.gen_factors`). The weight
  copies take the same links during the update pauses, when the instances they reach do
  not generate: the pause's share of the time is already out of their rate
  (`costmodel.pipeline_rate`), and outside it the links are the requests' and responses';
- training: rank 0 reads the step's B·G records before it trains, so the read adds to
  the step (`read_s`);
- over the network (`rollout.weight_sync=network`), every version reaches every server
  by the trainer's broadcast (a binomial tree: `Topology.copies_s`) and the next
  optimizer update waits for the send: a trainer step is no shorter than the broadcast
  (`broadcast_s`, per publish).

Only a cluster that declares racks or NICs places the head anywhere that matters; on any
other the flows are not priced (a zone's links are GB/s against KB per sample).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

from scheduler.cluster import Cluster
from scheduler.costmodel import GB
from scheduler.model_shape import ModelShape
from scheduler.sync_cost import sync_terms
from scheduler.topology import Resource, Topology
from scheduler.workload import Workload


@dataclass(frozen=True)
class SampleBytes:
    """Bytes per generated sample on each flow."""

    request: float  # head -> server
    response: float  # server -> head
    record: float  # head -> the trainer's rank 0


def sample_bytes(w: Workload) -> SampleBytes:
    c = w.constants
    p, t, g = w.prompt_tokens, w.response_tokens, w.group_size
    return SampleBytes(
        request=c.http_request_bytes_per_sample + c.http_request_bytes_per_prompt_token * p,
        response=c.http_response_bytes_per_sample + c.http_response_bytes_per_token * t,
        record=c.record_bytes_per_sample
        + c.record_bytes_per_prompt_token * p / g
        + c.record_bytes_per_token * t,
    )


@dataclass(frozen=True)
class TrafficCost:
    gen_factors: list[float]  # per instance: the share of its rate its links carry
    read_s: float  # per trainer step: rank 0's read of the step's records
    broadcast_s: float  # per publish over the network: rank 0's send, the slowest copy

    def step_s(self, step: float, publish_every: int, blocks: bool = True) -> float:
        """A trainer step of `step` seconds with its read, and (`blocks`: asynchronous,
        where the next update waits for the send while the trainer runs on) no shorter
        than its share of a send; a synchronous run's send is in its update pause."""
        step += self.read_s
        return max(step, self.broadcast_s / publish_every) if blocks else step


@dataclass(frozen=True)
class _Flow:
    cls: str  # "gen" | "read": the two kinds of flow a resource serves
    owner: int  # the instance for "gen", else -1
    bytes_per_s: float
    res: list[tuple[Resource, float]]


def share_left(bw: float, own: float, total: float) -> float:
    """Bytes/s a class of flows with load `own` gets on a resource of `bw` carrying
    `total` in all: what the others leave, and never less than its share by load."""
    if own <= 0:
        return bw
    return max(bw * own / max(total, own), bw - (total - own))


def traffic_on_topology(
    cl: Cluster,
    m: ModelShape,
    w: Workload,
    writer: str,
    rollout_nodes: list[str],
    gen_rates: list[float],
    train_rate: float,
    topo: Topology | None = None,
) -> TrafficCost:
    """The flows of instances on `rollout_nodes` (generating `gen_rates` samples/s each
    at full speed) and of a trainer on `writer` (at `train_rate`), priced on the links."""
    topo = topo or Topology(cl)
    n = len(rollout_nodes)
    if not topo.declared or n == 0:
        return TrafficCost([1.0] * n, 0.0, 0.0)
    head = topo.add_head(topo.machines[writer].zone)
    b = sample_bytes(w)
    # the pipeline runs at the slower side: every flow at that rate, shared as generated
    rate = min(sum(gen_rates), train_rate)
    flows = [
        _Flow("gen", i, h * size, topo.path(src, dst)[1])
        for i, (node, h) in enumerate(zip(rollout_nodes, gen_rates, strict=True))
        for src, dst, size in ((head, node, b.request), (node, head, b.response))
    ]
    flows.append(_Flow("read", -1, rate * b.record, topo.path(head, writer)[1]))
    return TrafficCost(
        _gen_factors(flows, gen_rates, rate, n),
        _read_s(flows, topo, head, writer, w.samples_per_step * b.record, gen_rates, rate),
        _broadcast_s(topo, m, w, writer, rollout_nodes),
    )


def _loads(flows: list[_Flow], gen_scale: float) -> tuple[dict, dict]:
    """(total bytes/s on each resource, its bytes/s per class), generation at `gen_scale`
    times its full-speed load."""
    total: dict[Resource, float] = defaultdict(float)
    per: dict[tuple[Resource, str], float] = defaultdict(float)
    for f in flows:
        load = f.bytes_per_s * (gen_scale if f.cls == "gen" else 1.0)
        for r, _ in f.res:
            total[r] += load
            per[(r, f.cls)] += load
    return total, per


def _gen_factors(flows: list[_Flow], gen_rates: list[float], rate: float, n: int) -> list[float]:
    """Each instance's full rate, scaled down where a resource it crosses cannot carry
    every instance's requests and responses at full speed beside the other flows (those
    at the pipeline's rate)."""
    total, per = _loads(flows, 1.0)
    out = [1.0] * n
    for f in flows:
        if f.cls != "gen" or f.bytes_per_s <= 0:
            continue
        for r, bw in f.res:
            own = per[(r, "gen")]
            left = share_left(bw * GB, own, total[r])
            out[f.owner] = min(out[f.owner], left / own)
    return out


def _read_s(
    flows: list[_Flow],
    topo: Topology,
    head: str,
    writer: str,
    step_bytes: float,
    gen_rates: list[float],
    rate: float,
) -> float:
    """Seconds rank 0 reads a step's records: over its path from the head, each shared
    resource at what the other flows (generation at the pipeline's rate) leave it."""
    lone, res = topo.path(head, writer)
    full = sum(gen_rates)
    total, per = _loads(flows, rate / full if full > 0 else 0.0)
    bw = lone * GB
    for r, rbw in res:
        bw = min(bw, share_left(rbw * GB, per[(r, "read")], total[r]))
    return step_bytes / bw


def _broadcast_s(
    topo: Topology, m: ModelShape, w: Workload, writer: str, rollout_nodes: list[str]
) -> float:
    """Over the network: rank 0's send of one version to every rollout instance as its
    broadcast sends it (`Topology.copies_s`), until the last copy has arrived, and each
    bucket's call; 0 from disk."""
    if w.weight_sync != "network":
        return 0.0
    c = w.constants
    nbytes = sync_terms(m, w, 0.0)[0]
    done = topo.copies_s(writer, rollout_nodes, nbytes, tree=True)
    buckets = math.ceil(nbytes / (c.weight_sync_bucket_mb * 2**20))
    return max(done, default=0.0) + buckets * c.weight_sync_bucket_overhead_ms / 1e3
