"""The box as the planner sees it (`profile --box` output) and a plan's services placed on
its nodes, without bringing a box up: the state file `box up` writes stands in."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest
import yaml

from areal_hex.errors import UsageError
from hexctl.box import emulate as box_mod
from hexctl.box.profile import inventory
from hexctl.box.spec import load_box
from scheduler.cluster import ClusterSpec, make_cluster
from scheduler.profile import DeviceRates, Profile

BOX = {
    "name": "inv",
    "kinds": {
        "fast": {"cpu": 0.6, "max_running_requests": 4, "usd_per_hour": 3.0, "nic_mbit": 800},
        "mem": {"cpu": 0.2, "max_running_requests": 64, "usd_per_hour": 1.0, "nic_mbit": 400},
    },
    "racks": [
        {
            "name": "a",
            "uplink_mbit": 16,
            "members": [{"kind": "fast", "count": 1}, {"kind": "mem", "first": 2, "count": 2}],
        },
        {
            "name": "b",
            "uplink_mbit": 16,
            "members": [{"kind": "fast", "count": 1}, {"kind": "mem", "first": 0, "count": 2}],
        },
    ],
}
FIGURES = {"bf16_tflops": 0.01, "hbm_gb": 2.5, "hbm_gbs": 0.04}


def _box(tmp: Path):
    p = tmp / "box.yaml"
    p.write_text(yaml.safe_dump(BOX))
    return load_box(p)


def test_the_inventory_is_a_cluster_with_the_box_racks_and_links(tmp_path: Path) -> None:
    box = _box(tmp_path)
    spec = inventory(box, {"fast": FIGURES, "mem": FIGURES}, reload_ms=12.0)
    cl = make_cluster(ClusterSpec.model_validate(spec))
    groups = {g.name: g for g in cl.spec.node_groups}
    assert groups["fast"].nodes == 2 and groups["mem"].nodes == 4
    assert groups["fast"].nic_gbs == pytest.approx(0.1) and groups["mem"].nic_gbs == pytest.approx(
        0.05
    )
    assert groups["mem"].usd_per_gpu_hour == 1.0
    # machine names are the box's node names, in the racks the box put them
    assert cl.rack_of == {
        "fast-0": "a",
        "mem-2": "a",
        "mem-3": "a",
        "fast-1": "b",
        "mem-0": "b",
        "mem-1": "b",
    }
    assert {r.uplink_gbs for r in cl.spec.racks} == {0.002}
    assert cl.spec.zones[0].inter_node_latency_ms == 12.0


def _state(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> box_mod.BoxState:
    monkeypatch.setattr(box_mod, "STATE_ROOT", tmp / "run")
    box = _box(tmp)
    nodes = {
        n.name: box_mod.NodeState(
            n.name,
            n.kind,
            box.spec.racks[n.rack].name,
            box_mod.netns_name("inv", n.name),
            box.address(n),
            "eth0",
            f"/cg/{n.name}",
            box.spec.kinds[n.kind].cpu,
            box.spec.kinds[n.kind].max_running_requests,
        )
        for n in box.nodes
    }
    state = box_mod.BoxState("inv", box.host_address, 24, nodes, {})
    box_mod.state_dir("inv").mkdir(parents=True)
    (box_mod.state_dir("inv") / "state.json").write_text(json.dumps(asdict(state)))
    return state


def _plan(trainer: list[str], rollout: list[str]):
    from areal_hex.plan import Plan

    slot = lambda n: {"node": n, "gpu_ids": [0]}  # noqa: E731
    return Plan.model_validate({
        "cluster": "box-inv", "model": "m", "objective": "throughput", "decisions": {},
        "rollout": [{"id": f"rollout-{n}", "gpu_kind": n.split("-")[0], "tp": 1, "zone": "box",
                     "region": "box", "placement": slot(n), "predicted_tokens_per_s": 1.0}
                    for n in rollout],
        "trainer": {"gpu_kind": "fast", "world_size": len(trainer), "dp": len(trainer),
                    "zero_stage": 0, "placements": [slot(n) for n in trainer],
                    "predicted_tokens_per_s": 1.0},
        "predicted": {"samples_per_s": 1, "generation_samples_per_s": 1,
                      "training_samples_per_s": 1, "weight_sync_s": 0, "cost_usd_per_h": 1},
    })  # fmt: skip


def test_a_plan_runs_on_its_nodes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from areal_hex.config import load_config
    from hexctl.box.place import place_on_box
    from hexctl.box.run_config import apply_box
    from hexctl.job.layout import build_layout
    from hexctl.launch.run import process_specs

    state = _state(tmp_path, monkeypatch)
    plan = _plan(["fast-1"], ["mem-0", "mem-3"])
    root = Path(__file__).resolve().parents[2]
    cfg = load_config(
        root / "examples/box/tiny_box.yaml",
        ["run.box=inv", "run.run_id=r", f"run.output_dir={tmp_path}"],
    )
    cfg.run.embedded_redis, cfg.redis.port = True, 6399
    cfg.inference.num_servers = 2
    apply_box(cfg, plan)
    mem0, mem3, fast1 = (state.node(n) for n in ("mem-0", "mem-3", "fast-1"))
    assert cfg.redis.url == f"redis://{state.host_address}:6399/0"
    assert cfg.redis.bind == state.host_address
    assert cfg.inference.server_urls == [
        f"http://{mem0.address}:{cfg.inference.base_port}",
        f"http://{mem3.address}:{cfg.inference.base_port + 1}",
    ]
    layout = build_layout(cfg, plan)
    specs = process_specs(cfg, layout, tmp_path / "config.yaml")
    place_on_box(cfg, layout, specs)
    by_name = {s.name: s for s in specs}
    server = by_name["rollout-mem-3"].command
    assert server[:5] == ["sh", "-c", server[2], "sh", mem3.cgroup]
    assert server[5] == mem3.netns
    assert (
        f"inference.host={mem3.address}" in server and "inference.max_running_requests=64" in server
    )
    assert server.index(f"inference.host={mem3.address}") < server.index("--index")
    assert by_name["trainer"].command[5] == fast1.netns
    assert by_name["trainer"].env["GLOO_SOCKET_IFNAME"] == "eth0"
    # the head node: Valkey and the controller stay in the launcher's namespace
    assert by_name["controller"].command[0] != "sh" and by_name["redis"].command[0] != "sh"


def test_a_plan_the_box_cannot_run_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from areal_hex.config import load_config
    from hexctl.box.run_config import box_state

    _state(tmp_path, monkeypatch)
    root = Path(__file__).resolve().parents[2]
    cfg = load_config(root / "examples/box/tiny_box.yaml", ["run.box=inv"])
    with pytest.raises(UsageError, match="needs --plan"):
        box_state(cfg, None)
    with pytest.raises(UsageError, match="must use one node"):
        box_state(cfg, _plan(["fast-0", "fast-1"], ["mem-0"]))
    with pytest.raises(UsageError, match="no node 'mem-9'"):
        box_state(cfg, _plan(["fast-0"], ["mem-9"]))
    cfg.run.pin_cores = True
    with pytest.raises(UsageError, match="pin_cores=false"):
        box_state(cfg, _plan(["fast-0"], ["mem-0"]))
    other = load_config(root / "examples/box/tiny_box.yaml", ["run.box=gone"])
    with pytest.raises(UsageError, match="is not up"):
        box_state(other, _plan(["fast-0"], ["mem-0"]))


def test_a_run_on_a_box_needs_the_boxs_placement(tmp_path: Path) -> None:
    """A command that does not hand the box's addresses to `prepare_run` refuses
    `run.box` before it writes anything, rather than running beside the box."""
    from areal_hex.config import load_config
    from hexctl.job.prepare import prepare_run

    root = Path(__file__).resolve().parents[2]
    cfg = load_config(
        root / "examples/box/tiny_box.yaml", ["run.box=inv", f"run.output_dir={tmp_path}"]
    )
    with pytest.raises(UsageError, match="only `areal-hex run`, `bench hetero`, `bench tasks`"):
        prepare_run(cfg, _plan(["fast-0"], ["mem-0"]))
    assert list(tmp_path.iterdir()) == []


def test_max_trainer_nodes_keeps_the_trainer_on_one_machine() -> None:
    from scheduler.model_shape import load_model_shape
    from scheduler.trainers import trainer_configs, trainer_nodes
    from scheduler.workload import load_workload

    root = Path(__file__).resolve().parents[2]
    cl = make_cluster(
        ClusterSpec.model_validate(
            yaml.safe_load((root / "examples/clusters/mixed_trainer_h800_h20.yaml").read_text())
        )
    )
    m = load_model_shape("qwen3-8b")
    w = load_workload(root / "examples/workloads/long_cot.yaml")
    assert max(trainer_nodes(c) for c in trainer_configs(cl, m, w)) > 1
    one = w.model_copy(update={"max_trainer_nodes": 1})
    assert {trainer_nodes(c) for c in trainer_configs(cl, m, one)} == {1}


def _priced(tmp: Path, reload_ms: float, sync: str) -> tuple:
    """The box's inventory as a cluster (its kinds as one GPU), qwen3-0.6b, and the math
    workload at `sync` with a small batch."""
    from scheduler.model_shape import load_model_shape
    from scheduler.workload import load_workload

    root = Path(__file__).resolve().parents[2]
    gpu = {"bf16_tflops": 100.0, "hbm_gb": 80.0, "hbm_gbs": 2000.0}
    spec = inventory(_box(tmp), {"fast": gpu, "mem": gpu}, reload_ms=reload_ms)
    w = load_workload(root / "examples/workloads/math_grpo.yaml").model_copy(
        update={"weight_sync": sync, "groups_per_step": 4, "group_size": 8}
    )
    return make_cluster(ClusterSpec.model_validate(spec)), load_model_shape("qwen3-0.6b"), w


def test_a_run_on_a_box_prices_each_copy_of_the_weights_over_the_links_it_crosses(
    tmp_path: Path,
) -> None:
    """Network sync on racks: two servers behind one rack's uplink share it (each gets its
    own copy), so they wait for two copies' bytes over it; two servers beside the trainer
    wait for its NIC to send both. The run's prediction prices the plan's machines."""
    from scheduler.costmodel import GB
    from scheduler.partition import sync_on_topology
    from scheduler.predict import LayoutNodes, TrainerLayout, predict_layout
    from scheduler.sync_cost import sync_terms

    cl, m, w = _priced(tmp_path, 12.0, "network")
    nbytes, fixed = sync_terms(m, w, 0.012)
    assert nbytes == pytest.approx(w.constants.weight_sync_bytes_per_param * m.params)
    near = sync_on_topology(cl, m, w, "fast-0", ["mem-2", "mem-3"])
    far = sync_on_topology(cl, m, w, "fast-0", ["mem-0", "mem-1"])
    # fast-0's 800 Mbit/s NIC sends both copies; behind rack b, its 16 Mbit/s uplinks do
    assert near == pytest.approx([fixed + 2 * nbytes / (0.1 * GB)] * 2)
    assert far == pytest.approx([fixed + 2 * nbytes / (0.002 * GB)] * 2)

    layout = [("mem", 1), ("mem", 1)], TrainerLayout((("fast", 1),), 1)
    a = predict_layout(cl, m, w, None, *layout, nodes=LayoutNodes("fast-0", ("mem-2", "mem-3")))
    c = predict_layout(cl, m, w, None, *layout, nodes=LayoutNodes("fast-0", ("mem-0", "mem-1")))
    assert c.asynchronous.weight_sync_s == pytest.approx(far[0])
    assert a.asynchronous.weight_sync_s == pytest.approx(near[0])
    assert c.asynchronous.pipeline_samples_per_s < a.asynchronous.pipeline_samples_per_s
    assert c.synchronous.pipeline_samples_per_s < a.synchronous.pipeline_samples_per_s


def _profile(params: int, **own: dict) -> Profile:
    """A box profile of kinds fast and mem with the same rates, plus each kind's `own`."""
    rates = {
        "device": "box",
        "train_tokens_per_s": 1e4,
        "prefill_tokens_per_s": 1e5,
        "decode_context": 128,
        "decode_step_s": {1: 0.01, 8: 0.02},
    }
    kinds = {k: DeviceRates(**{**rates, **own.get(k, {})}) for k in ("fast", "mem")}
    return Profile(model="m", params=params, kinds=kinds)


def test_each_kinds_own_update_pause_stands_for_the_zones_latency(tmp_path: Path) -> None:
    """The box's zone latency is its slowest kind's pause; an instance of a kind whose
    rounds measured a pause of its own in the run's mode pays that one instead, on the
    plan's nodes (`update_pause_s` into `sync_on_topology`, which prices both the plan's
    placement and the run's prediction). Measured in the other mode, the zone's stands."""
    from scheduler.partition import sync_on_topology
    from scheduler.predict import LayoutNodes, TrainerLayout, predict_layout
    from scheduler.sync_cost import sync_terms

    cl, m, w = _priced(tmp_path, 60.0, "disk")
    zone = sync_on_topology(cl, m, w, "fast-0", ["fast-1", "mem-2"])
    own = sync_on_topology(cl, m, w, "fast-0", ["fast-1", "mem-2"], pauses=[0.015, None])
    assert own[0] == pytest.approx(zone[0] - 0.060 + 0.015)  # its own 15 ms, not 60
    assert own[1] == pytest.approx(zone[1])  # unmeasured: the zone's
    assert sync_terms(m, w, 0.015)[1] == pytest.approx(0.015)

    prof = _profile(m.params, fast={"update_pause_s": 0.015, "reload_overlap_sync": "disk"})
    assert prof.update_pause_s("fast", "disk") == 0.015
    assert prof.update_pause_s("fast", "network") is None  # measured from disk only
    assert prof.update_pause_s("mem", "disk") is None
    layout = [("fast", 1)], TrainerLayout((("fast", 1),), 1)
    nodes = LayoutNodes("fast-0", ("fast-1",))
    with_own = predict_layout(cl, m, w, prof, *layout, nodes=nodes)
    assert with_own.asynchronous.weight_sync_s == pytest.approx(own[0])
    net = w.model_copy(update={"weight_sync": "network"})
    whole = predict_layout(cl, m, net, prof, *layout, nodes=nodes).asynchronous.weight_sync_s
    assert whole == pytest.approx(sync_on_topology(cl, m, net, "fast-0", ["fast-1"])[0])


def test_no_network_pause_ends_before_the_trainers_broadcast(tmp_path: Path) -> None:
    """Over the network a server takes its version as fast as rank 0 sends it: a
    trainer's kind measured to take `train_broadcast_s` sending one while it trains
    sets the shortest pause (`TrainerOption.broadcast_s`), in either mode's
    prediction; from disk it plays no part."""
    from scheduler.partition import sync_on_topology
    from scheduler.predict import LayoutNodes, TrainerLayout, predict_layout
    from scheduler.trainers import cost_trainer

    cl, m, w = _priced(tmp_path, 20.0, "network")
    prof = _profile(m.params, mem={"train_broadcast_s": 100.0, "train_after_send_s": 0.5})
    links = sync_on_topology(cl, m, w, "mem-0", ["mem-1"])[0]
    assert links < 100.0
    tr = cost_trainer(cl, m, w, (("mem", 1),), 1, prof)
    assert tr is not None and (tr.broadcast_s, tr.after_send_s) == (100.0, 0.5)
    layout = [("mem", 1)], TrainerLayout((("mem", 1),), 1)
    got = predict_layout(cl, m, w, prof, *layout, nodes=LayoutNodes("mem-0", ("mem-1",)))
    assert got.asynchronous.weight_sync_s == pytest.approx(100.0)
    assert got.synchronous.weight_sync_s == pytest.approx(100.0)
    # a trainer of the other kind, or weights from disk: no floor
    fast = cost_trainer(cl, m, w, (("fast", 1),), 1, prof)
    assert fast is not None and fast.broadcast_s == 0.0
    disk = cost_trainer(cl, m, w.model_copy(update={"weight_sync": "disk"}), (("mem", 1),), 1, prof)
    assert disk is not None and (disk.broadcast_s, disk.after_send_s) == (0.0, 0.0)


def test_a_synchronous_network_update_is_priced_at_the_idle_network_pause(
    tmp_path: Path,
) -> None:
    """A synchronous run's update over the network finds its servers idle: the pause is
    the kind's update with nothing in flight as measured over the network
    (`update_pause_idle_s`), plus the bytes over the links, in place of the idle reload
    from disk; measured in the other mode, or not at all, the disk's stands in."""
    from scheduler.partition import sync_on_topology
    from scheduler.predict import LayoutNodes, TrainerLayout, predict_layout

    cl, m, w = _priced(tmp_path, 20.0, "network")
    links = sync_on_topology(cl, m, w, "fast-0", ["mem-2"])[0]
    layout = [("mem", 1)], TrainerLayout((("fast", 1),), 1)
    nodes = LayoutNodes("fast-0", ("mem-2",))

    def sync_pause(fast: dict | None = None, **mem: float | str) -> float:
        prof = _profile(m.params, fast=fast or {}, mem={"reload_idle_s": 0.005, **mem})
        return predict_layout(cl, m, w, prof, *layout, nodes=nodes).synchronous.weight_sync_s

    disk = sync_pause()
    assert disk == pytest.approx(links - 0.020 + 0.005)  # the link's latency, then disk's
    net = {"update_pause_idle_s": 0.045, "reload_overlap_sync": "network"}
    assert sync_pause(**net) == pytest.approx(disk - 0.005 + 0.045)
    # the trainer's broadcast, timed while it trained, floors the disk's stand-in only:
    # the idle update over the network was timed with an idle sender
    slow = {"train_broadcast_s": 100.0}
    assert sync_pause(slow) == pytest.approx(100.0)
    assert sync_pause(slow, **net) == pytest.approx(disk - 0.005 + 0.045)
    assert sync_pause(**{**net, "reload_overlap_sync": "disk"}) == pytest.approx(disk)
    prof = _profile(m.params, mem=net)
    assert prof.update_pause_idle_s("mem", "network") == 0.045
    assert prof.update_pause_idle_s("mem", "disk") is None
    assert prof.update_pause_idle_s("fast", "network") is None


def test_an_idle_asynchronous_update_still_waits_for_its_copy_over_the_links(
    tmp_path: Path,
) -> None:
    """Servers that generate well ahead of the trainer take an update idle: the pause is
    the kind's idle update in place of the link's in-flight latency, but each copy still
    crosses its links, so an instance behind a thin uplink pauses for its bytes over it
    (a one-kind plan with its trainer in rack a and an instance in rack b)."""
    from scheduler.costmodel import GB
    from scheduler.partition import sync_on_topology
    from scheduler.predict import IDLE_AT_SLACK, LayoutNodes, TrainerLayout, predict_layout
    from scheduler.sync_cost import sync_terms

    cl, m, w = _priced(tmp_path, 20.0, "network")
    nodes = LayoutNodes("mem-2", ("mem-0", "mem-3"))
    far, near = sync_on_topology(cl, m, w, nodes.writer, list(nodes.rollout))
    nbytes, _ = sync_terms(m, w, 0.0)
    assert far > nbytes / (0.002 * GB) > near  # the 16 Mbit/s uplink of rack b
    prof = _profile(m.params, mem={"reload_idle_s": 0.005, "train_tokens_per_s": 50.0})
    layout = [("mem", 1), ("mem", 1)], TrainerLayout((("mem", 1),), 1)
    got = predict_layout(cl, m, w, prof, *layout, nodes=nodes).asynchronous
    assert got.generation_samples_per_s > (1 + IDLE_AT_SLACK) * got.training_samples_per_s
    assert got.weight_sync_s == pytest.approx(far - 0.020 + 0.005)
    # both beside the trainer: the idle update and the near copy's bytes only
    close = LayoutNodes("mem-2", ("mem-3", "mem-3"))
    both = sync_on_topology(cl, m, w, close.writer, list(close.rollout))
    got = predict_layout(cl, m, w, prof, *layout, nodes=close).asynchronous
    assert got.weight_sync_s == pytest.approx(max(both) - 0.020 + 0.005)
    assert got.weight_sync_s < nbytes / (0.002 * GB)


def test_the_links_latency_is_the_update_rounds_pause_in_the_runs_mode(tmp_path: Path) -> None:
    """A kind's update rounds (`reload_under_load_s`) price its pause: their median, less
    the fixed seconds the cost model adds for the mode (a bucket's call over the
    network), so the link's latency plus them is the pause measured. Rounds made in the
    other mode than the workload's, or none, leave the in-flight reload (None)."""
    from hexctl.box.profile import _pause_ms
    from hexctl.job.predict import LocalProfileFiles
    from scheduler.model_shape import load_model_shape
    from scheduler.sync_cost import sync_terms
    from scheduler.workload import load_workload

    root = Path(__file__).resolve().parents[2]
    files = LocalProfileFiles(tmp_path)
    files.model.mkdir(parents=True)
    files.model.joinpath("config.json").write_text(
        json.dumps(
            {
                "model_type": "qwen3",
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 16,
                "vocab_size": 1000,
                "tie_word_embeddings": True,
            }
        )  # fmt: skip
    )
    work = yaml.safe_load((root / "examples/workloads/math_grpo.yaml").read_text())
    gen = {"reload_under_load_s": [0.070, 0.060, 0.065], "reload_under_load_sync": "disk"}
    for sync in ("disk", "network"):
        files.workload.write_text(yaml.safe_dump({**work, "weight_sync": sync}))
        w = load_workload(files.workload)
        _, fixed = sync_terms(load_model_shape(str(files.model)), w, 0.0)
        gen["reload_under_load_sync"] = sync
        assert _pause_ms(files, gen) == pytest.approx((0.065 - fixed) * 1e3, abs=1e-3)
        assert (fixed > 0) == (sync == "network")
    files.workload.write_text(yaml.safe_dump({**work, "weight_sync": "disk"}))
    assert _pause_ms(files, {**gen, "reload_under_load_sync": "network"}) is None
    assert _pause_ms(files, {"reload_under_load_s": None}) is None
    # the same updates with nothing in flight (a synchronous run's), priced alike
    files.workload.write_text(yaml.safe_dump({**work, "weight_sync": "network"}))
    _, fixed = sync_terms(load_model_shape(str(files.model)), load_workload(files.workload), 0.0)
    idle = {**gen, "reload_under_load_sync": "network", "reload_idle_network_s": [0.04, 0.05]}
    assert _pause_ms(files, idle, "reload_idle_network_s") == pytest.approx(
        (0.045 - fixed) * 1e3, abs=1e-3
    )
    assert _pause_ms(files, gen, "reload_idle_network_s") is None


def test_disk_sync_on_a_box_crosses_no_link(tmp_path: Path) -> None:
    """A box's files are on the host's own disk (`storage_on_links: false`, which
    `profile --box` writes): a disk update costs the link's latency, the profiled pause
    with the read in it, wherever the servers sit; shared storage charges the bytes over
    the links as before."""
    from scheduler.model_shape import load_model_shape
    from scheduler.partition import sync_on_topology
    from scheduler.sync_cost import sync_terms
    from scheduler.workload import load_workload

    root = Path(__file__).resolve().parents[2]
    gpu = {"bf16_tflops": 100.0, "hbm_gb": 80.0, "hbm_gbs": 2000.0}
    spec = inventory(_box(tmp_path), {"fast": gpu, "mem": gpu}, reload_ms=12.0)
    cl = make_cluster(ClusterSpec.model_validate(spec))
    m = load_model_shape("qwen3-0.6b")
    shared = load_workload(root / "examples/workloads/math_grpo.yaml")
    assert shared.weight_sync == "disk" and shared.constants.storage_on_links
    local = shared.model_copy(
        update={"constants": shared.constants.model_copy(update={"storage_on_links": False})}
    )
    assert sync_terms(m, local, 0.012) == (0.0, 0.012)
    assert sync_terms(m, shared, 0.012)[0] > 0
    far = sync_on_topology(cl, m, local, "fast-0", ["mem-0", "mem-1"])
    near = sync_on_topology(cl, m, local, "fast-0", ["mem-2", "mem-3"])
    assert far == pytest.approx([0.012, 0.012]) and near == far
    assert sync_on_topology(cl, m, shared, "fast-0", ["mem-0", "mem-1"])[0] > 0.012
