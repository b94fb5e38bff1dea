"""The head node's traffic on the links (scheduler/traffic.py): its byte counts against the
real codec and wire, and what a thin uplink to the trainer or to the servers costs."""

from __future__ import annotations

import json

import numpy as np
import pytest
from fastapi.responses import JSONResponse

from areal_hex.api import SamplingParams
from areal_hex.buffer.codec import encode_group
from areal_hex.record import Completion, GroupRecord
from rollout_service import wire
from scheduler.cluster import Cluster, ClusterSpec, make_cluster
from scheduler.model_shape import ModelShape
from scheduler.predict import LayoutNodes, TrainerLayout, predict_layout
from scheduler.sync_cost import sync_terms
from scheduler.topology import Topology
from scheduler.traffic import sample_bytes, share_left, traffic_on_topology
from scheduler.workload import Workload

# the box's tiny job: a 2-layer model, 8 groups of 8 a step, ~34 prompt tokens, 15 answer
TINY = ModelShape("tiny", 2, 64, 4, 2, 16, 128, 96, True)
W = Workload(
    groups_per_step=8,
    group_size=8,
    prompt_tokens=34,
    response_tokens=15,
    max_response_tokens=16,
    max_staleness=4,
)
MBIT = 1 / 8000  # GB/s


def _cluster(up_a: float | None, up_b: float | None, mem: int = 2) -> Cluster:
    """fast-0 in rack a, `mem` nodes mem-0, mem-1, ... in rack b, 1000 Mbit/s NICs;
    uplinks in Mbit/s (None: no racks)."""
    group = {"gpus_per_node": 1, "zone": "box", "intra_node": {"kind": "pcie", "bandwidth_gbs": 10}}
    spec = {
        "name": "t",
        "zones": [{"name": "box", "region": "box", "inter_node_bandwidth_gbs": 1000 * MBIT}],
        "node_groups": [
            {**group, "name": "fast", "gpu": "l4", "nodes": 1, "usd_per_gpu_hour": 3.0},
            {**group, "name": "mem", "gpu": "l4", "nodes": mem, "usd_per_gpu_hour": 1.0},
        ],
    }
    if up_a is not None and up_b is not None:
        for g in spec["node_groups"]:
            g["nic_gbs"] = 1000 * MBIT
        spec["racks"] = [
            {"name": "a", "uplink_gbs": up_a * MBIT, "members": [{"group": "fast", "count": 1}]},
            {"name": "b", "uplink_gbs": up_b * MBIT, "members": [{"group": "mem", "count": mem}]},
        ]
    return make_cluster(ClusterSpec.model_validate(spec))


def _group(w: Workload) -> GroupRecord:
    """A group as the controller writes it, at the workload's lengths."""
    rng = np.random.default_rng(0)
    t = w.response_tokens
    comps = [
        Completion(
            rng.integers(3, 96, t).astype(np.int32),
            rng.uniform(-4, 0, t).astype(np.float32),
            np.full(t, 3, np.int32),
            "stop",
            1.0,
            "13 + 4 = 17\n#### 17"[:t],
            "http://10.77.0.3:30001",
            "mem",
        )
        for _ in range(w.group_size)
    ]
    return GroupRecord(
        prompt_id="arith-train-00042",
        prompt_ids=rng.integers(3, 96, w.prompt_tokens).astype(np.int32),
        completions=comps,
        temperature=1.2,
        created_at=1.7e9,
        finished_at=1.7e9 + 1.5,
        metadata={"seq": "42", "epoch": "0", "put_token": "ctl-1a2b3c-42", "answer": "17"},
    )


def test_byte_counts_are_the_codecs_and_the_wires() -> None:
    """Each flow's bytes per sample within 15 % of what the codec and the wire models
    write for a group at the workload's lengths (the constants were fitted to a real run
    of the tiny job: docs/fidelity.md, "The traffic priced")."""
    b, g = sample_bytes(W), _group(W)
    assert len(encode_group(g)) / W.group_size == pytest.approx(b.record, rel=0.15)
    outs = []
    for c in g.completions:
        ids = c.token_ids.tolist()
        meta = wire.MetaInfo(
            id="ctl-1a2b3c-g42_0",
            finish_reason={"type": "length", "length": len(ids)},
            prompt_tokens=W.prompt_tokens,
            completion_tokens=len(ids),
            weight_version="3",
            e2e_latency=1.2345678,
            output_token_logprobs=[
                [float(p), i, None] for p, i in zip(c.logprobs, ids, strict=True)
            ],
            input_token_logprobs=[],
            output_token_versions=[3] * len(ids),
        )
        outs.append(wire.GenerateOutput(text=c.text, output_ids=ids, meta_info=meta).to_wire())
    response = len(JSONResponse(outs).body) / W.group_size
    assert response == pytest.approx(b.response, rel=0.15)
    request = {  # as rollout_service/client.py sends a group
        "input_ids": [g.prompt_ids.tolist()] * W.group_size,
        "sampling_params": SamplingParams(max_new_tokens=16, temperature=1.2).to_wire(),
        "return_logprob": True,
        "rid": [f"ctl-1a2b3c-g42_{j}" for j in range(W.group_size)],
    }
    assert len(json.dumps(request)) / W.group_size == pytest.approx(b.request, rel=0.15)


def test_share_left_is_what_the_others_leave_or_the_share_by_load() -> None:
    assert share_left(10.0, 2.0, 5.0) == 7.0  # room: what the others leave
    assert share_left(10.0, 4.0, 20.0) == 2.0  # full: its share by load
    assert share_left(10.0, 0.0, 20.0) == 10.0


def test_no_racks_or_nics_price_no_traffic() -> None:
    cl = _cluster(None, None)
    tc = traffic_on_topology(cl, TINY, W, "fast-0", ["mem-0", "mem-1"], [50.0, 50.0], 80.0)
    assert tc.gen_factors == [1.0, 1.0] and tc.read_s == 0.0 and tc.broadcast_s == 0.0


def _predict(cl: Cluster, w: Workload, rollout: tuple[str, ...] = ("mem-0", "mem-1")):
    groups = [n.rsplit("-", 1)[0] for n in rollout]
    return predict_layout(
        cl,
        TINY,
        w,
        None,
        [(g, 1) for g in groups],
        TrainerLayout((("fast", 1),), 1),
        nodes=LayoutNodes("fast-0", rollout),
    ).asynchronous


def test_a_thin_uplink_to_the_trainer_slows_training_by_its_read() -> None:
    """The trainer's rank 0 reads each step's records from the head over its rack's
    uplink before it trains: the step grows by B·G records over that uplink."""
    fat, thin = _predict(_cluster(1000, 1000), W), _predict(_cluster(2, 1000), W)
    rec = W.samples_per_step * sample_bytes(W).record / 1e9
    grown = W.samples_per_step / thin.training_samples_per_s
    grown -= W.samples_per_step / fat.training_samples_per_s
    assert grown == pytest.approx(rec / (2 * MBIT) - rec / (1000 * MBIT), rel=1e-6)
    rates = [thin.generation_samples_per_s / 2] * 2  # the servers' links carry them all
    tc = traffic_on_topology(_cluster(2, 1000), TINY, W, "fast-0", ["mem-0", "mem-1"], rates, 1e4)
    assert tc.gen_factors == [1.0, 1.0]


def test_a_thin_uplink_to_the_servers_caps_their_generation() -> None:
    """Two servers behind one uplink send their responses up it: at most its bandwidth
    of responses a second between them, whatever their own speed."""
    cl, b = _cluster(1000, 1), sample_bytes(W)
    w = W.model_copy(update={"weight_sync": "network"})  # copies: in the pauses, not here
    full = [500.0, 300.0]
    tc = traffic_on_topology(cl, TINY, w, "fast-0", ["mem-0", "mem-1"], full, 1e4)
    carried = sum(f * h for f, h in zip(tc.gen_factors, full, strict=True)) * b.response
    assert carried == pytest.approx(1 * MBIT * 1e9, rel=1e-6)
    assert tc.gen_factors[0] == pytest.approx(tc.gen_factors[1])  # shared by load
    roomy = traffic_on_topology(cl, TINY, w, "fast-0", ["mem-0", "mem-1"], [1.0, 1.0], 1e4)
    assert roomy.gen_factors == [1.0, 1.0]


def test_a_network_send_over_thin_uplinks_binds_the_trainer() -> None:
    """Over the network rank 0 sends every version to both servers across its rack's
    uplink, and its next update waits for the send: its rate is at most a step's samples
    per send. From disk the trainer does not send, and in one rack the NICs carry it."""
    net = W.model_copy(update={"weight_sync": "network"})
    cl = _cluster(4, 4)
    nbytes = sync_terms(TINY, net, 0.0)[0]
    tc = traffic_on_topology(cl, TINY, net, "fast-0", ["mem-0", "mem-1"], [50.0, 50.0], 1e4)
    overhead = net.constants.weight_sync_bucket_overhead_ms / 1e3
    assert tc.broadcast_s == pytest.approx(2 * nbytes / (4 * MBIT * 1e9) + overhead)
    got = _predict(cl, net)
    assert got.training_samples_per_s == pytest.approx(W.samples_per_step / tc.broadcast_s)
    assert _predict(cl, W).training_samples_per_s > 2 * got.training_samples_per_s
    topo = Topology(cl)
    assert topo.path("fast-0", "mem-0")[0] == pytest.approx(4 * MBIT)


def test_the_head_sits_outside_every_rack() -> None:
    topo = Topology(_cluster(4, 6))
    head = topo.add_head("box")
    bw, res = topo.path(head, "mem-1")
    assert bw == pytest.approx(6 * MBIT)
    assert {r for r, _ in res} == {("in", "mem-1"), ("down", "b")}


def test_the_placed_plan_charges_the_same_send_and_read() -> None:
    """The planner's pricing of a placement (`partition.evaluate`) takes the same
    traffic as the run's prediction: the trainer's step no shorter than its send."""
    from scheduler.costmodel import rollout_configs
    from scheduler.partition import evaluate, first_fit
    from scheduler.trainers import cost_trainer

    net = W.model_copy(update={"weight_sync": "network"})
    cl = _cluster(4, 4)
    tr = cost_trainer(cl, TINY, net, (("fast", 1),), 1, None)
    assert tr is not None
    mem = next(r for r in rollout_configs(cl, TINY, net) if r.group == "mem")
    pl = first_fit(cl, tr, [(mem, 2)])
    assert [node for _, node, _ in pl.rollout] == ["mem-0", "mem-1"]
    tc = traffic_on_topology(cl, TINY, net, "fast-0", ["mem-0", "mem-1"], [1.0, 1.0], 1.0)
    assert evaluate(cl, TINY, net, tr, pl).train_step_s == pytest.approx(tc.broadcast_s)
    assert evaluate(cl, TINY, W, tr, pl).train_step_s < tc.broadcast_s / 2


def test_a_capped_instance_is_slower_in_both_modes() -> None:
    """An instance its links cap generates as if its steps were longer: the asynchronous
    rate and the synchronous replay both see it (weights kept off the links here)."""
    local = W.constants.model_copy(update={"storage_on_links": False})
    w = W.model_copy(update={"constants": local})

    def both(up_b: float):
        return predict_layout(
            _cluster(1000, up_b),
            TINY,
            w,
            None,
            [("mem", 1), ("mem", 1)],
            TrainerLayout((("fast", 1),), 1),
            nodes=LayoutNodes("fast-0", ("mem-0", "mem-1")),
        )

    fat, thin = both(1000), both(1)
    cap = 1 * MBIT * 1e9 / sample_bytes(w).response  # responses a second up the uplink
    assert thin.asynchronous.generation_samples_per_s <= cap * (1 + 1e-6)
    assert fat.asynchronous.generation_samples_per_s > 3 * cap
    assert thin.synchronous.pipeline_samples_per_s < fat.synchronous.pipeline_samples_per_s / 2


def test_broadcast_tree_is_gloos_binomial_tree() -> None:
    from scheduler.topology import broadcast_tree

    assert broadcast_tree(1) == []
    assert broadcast_tree(2) == [(0, 0, 1)]
    assert broadcast_tree(4) == [(0, 0, 1), (1, 0, 2), (1, 1, 3)]
    five = broadcast_tree(5)
    assert five == [(0, 0, 1), (1, 0, 2), (1, 1, 3), (2, 0, 4)]
    # every rank gets the copy once, rank 0 sends ceil(log2(ranks)) of them
    for n in range(2, 17):
        pairs = broadcast_tree(n)
        assert sorted(dst for _, _, dst in pairs) == list(range(1, n))
        assert sum(src == 0 for _, src, _ in pairs) == (n - 1).bit_length()


def test_a_broadcast_to_three_servers_sends_two_copies_over_a_thin_uplink() -> None:
    """Rank 0 behind a thin uplink, three servers in the other rack: gloo's tree sends
    ranks 1 and 2 their copies over the uplink and rank 1 forwards rank 3's inside its
    rack, so the last copy arrives after two copies' time, not three."""
    from scheduler.topology import Transfer

    topo = Topology(_cluster(4, 100, mem=3))
    nodes = ["mem-0", "mem-1", "mem-2"]
    nbytes = 500_000.0
    one = topo.finish_s([Transfer("fast-0", "mem-0", nbytes)])[0]  # a copy alone
    tree = topo.copies_s("fast-0", nodes, nbytes, tree=True)
    flat = topo.copies_s("fast-0", nodes, nbytes, tree=False)
    assert max(flat) == pytest.approx(3 * one)
    assert tree[0] == pytest.approx(2 * one) and tree[1] == pytest.approx(2 * one)
    assert 2 * one < tree[2] < 2.2 * one  # then a hop inside rack b at 1000 Mbit/s
    # the trainer's send over the network is the tree's
    net = W.model_copy(update={"weight_sync": "network"})
    tc = traffic_on_topology(topo.cl, TINY, net, "fast-0", nodes, [10.0] * 3, 1e4, topo)
    buckets_s = net.constants.weight_sync_bucket_overhead_ms / 1e3
    sent = sync_terms(TINY, net, 0.0)[0]
    assert tc.broadcast_s == pytest.approx(
        max(topo.copies_s("fast-0", nodes, sent, True)) + buckets_s
    )


def test_the_plan_orders_its_servers_for_the_tree() -> None:
    """Servers grouped by rack, the trainer's rack first: a server in another rack goes
    after those beside the trainer, which take the root's cheap copies; the test suite's
    thin-box plan b (tests/unit/test_task_scoring.py) is the planner's case."""
    topo = Topology(_cluster(8, 8))  # fast-0 in rack a; mem-0, mem-1 in rack b
    assert topo.tree_order("fast-0", ["mem-1", "mem-0"]) == [0, 1]
    assert topo.tree_order("mem-0", ["fast-0", "mem-1"]) == [1, 0]  # own rack first
    assert topo.tree_order("mem-0", ["fast-0", "mem-1", "fast-0"]) == [1, 0, 2]
