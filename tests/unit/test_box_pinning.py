"""The box's CPU pinning (`hexctl/box/pinning.py`): the nodes a run uses spread over the
machine's CPUs by quota, heaviest first, each on its least-loaded CPUs; nothing pinned
where a CPU would carry more than a core, or where there is one CPU."""

from __future__ import annotations

from dataclasses import dataclass

from hexctl.box.pinning import MAX_CPU_LOAD, cpu_list, pack


@dataclass
class Node:
    name: str
    cpu: float


def _load(nodes: list[Node], got: dict[str, list[int]]) -> dict[int, float]:
    load: dict[int, float] = {}
    for n in nodes:
        for c in got[n.name]:
            load[c] = load.get(c, 0.0) + n.cpu / len(got[n.name])
    return load


def test_a_trainer_and_two_servers_spread_over_two_cpus() -> None:
    # r41's plan a: the trainer k2-0 and servers k1-2, k2-1
    nodes = [Node("k2-0", 0.25), Node("k1-2", 0.28), Node("k2-1", 0.25)]
    got = pack(nodes, [0, 1])
    assert got == {"k1-2": [0], "k2-0": [1], "k2-1": [1]}
    assert max(_load(nodes, got).values()) <= MAX_CPU_LOAD


def test_the_heaviest_go_first_and_each_cpu_stays_under_a_core() -> None:
    nodes = [Node(f"n{i}", q) for i, q in enumerate([0.1, 0.6, 0.3, 0.45, 0.2, 0.3])]
    got = pack(nodes, [0, 1, 2])
    assert set(got) == {n.name for n in nodes} and all(len(v) == 1 for v in got.values())
    load = _load(nodes, got)
    assert max(load.values()) <= MAX_CPU_LOAD and max(load.values()) - min(load.values()) <= 0.3
    assert got["n1"] == [0]  # the heaviest first, on the lowest-numbered CPU


def test_a_node_of_more_than_a_core_spans_as_many_cpus() -> None:
    got = pack([Node("big", 1.5), Node("small", 0.2)], [0, 1, 2])
    assert len(got["big"]) == 2 and got["small"] == [2]
    assert got == pack([Node("small", 0.2), Node("big", 1.5)], [0, 1, 2])  # order-free


def test_nothing_is_pinned_where_a_cpu_would_carry_more_than_a_core() -> None:
    # three nodes of 0.6 on two CPUs: two would share one CPU at 1.2 cores
    assert pack([Node(f"n{i}", 0.6) for i in range(3)], [0, 1]) == {}
    assert pack([Node("a", 0.3)], [0]) == {}  # one CPU: nothing to choose
    assert pack([], [0, 1]) == {}


def test_a_node_named_twice_is_placed_once() -> None:
    got = pack([Node("a", 0.4), Node("a", 0.4), Node("b", 0.4)], [0, 1])
    assert got == {"a": [0], "b": [1]}


def test_taskset_form() -> None:
    assert cpu_list([0, 1]) == "0,1" and cpu_list([3]) == "3" and cpu_list([]) == ""


def test_a_profiled_node_runs_on_its_cpu_and_its_record_is_json() -> None:
    import json

    from hexctl.box.emulate import BoxState, NodeState
    from hexctl.box.profile import node_devices
    from hexctl.profile.local import devices_record

    node = NodeState(
        name="k0-0", kind="k0", rack="a", netns="ahx-t-k0-0", address="10.0.0.2",
        iface="ahx-t-n0", cgroup="/sys/fs/cgroup/cpu/x", cpu=0.3, max_running_requests=8,
    )  # fmt: skip
    state = BoxState(name="t", host_address="10.0.0.254", prefix_len=24,
                     nodes={"k0-0": node}, cpu_check={})  # fmt: skip
    dev = node_devices(state, "k0-0", memory_gb=8.0)
    expected = pack([node])
    assert dev.node_cpus == (set(expected["k0-0"]) if expected else None)
    assert dev.node_prefix[7] == cpu_list(expected.get("k0-0", []))
    assert dev.inference_cores is None and dev.trainer_cores is None  # the driver floats
    record = json.loads(json.dumps(devices_record(dev)))
    assert record["node_cpus"] == sorted(dev.node_cpus or [])
