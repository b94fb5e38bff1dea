"""The workflow contract: a task beyond generate and train (`workflow.tasks`) is planned,
laid out, rendered for compose, k8s and Slurm and placed on a box through the generic
path; and `run.mode: sync` means η = 0, k = 1 on every target.

The task here does nothing useful (it sleeps): what is tested is that no layer needs a
code path of its own for it. `tests/e2e/test_tiny_run.py` launches one locally."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from areal_hex.config import ConfigError, ExperimentConfig, TaskSpec, load_config
from areal_hex.plan import Decisions, Plan, load_plan, save_plan
from hexctl.deploy import render
from hexctl.deploy.config import DeployConfig
from hexctl.deploy.slurm import render_slurm
from hexctl.deploy.slurm_site import load_site
from hexctl.job.layout import build_layout
from scheduler.cluster import load_cluster
from scheduler.model_shape import load_model_shape
from scheduler.planner import make_plan
from scheduler.workload import load_workload

ROOT = Path(__file__).resolve().parents[2]
NOOP = TaskSpec(
    name="noop", command=["python", "-c", "import time; time.sleep(3600)"], instances=2, gpus=1
)
CONFIG = ROOT / "examples/deploy/qwen3-8b.yaml"


@pytest.fixture(scope="module")
def planned(tmp_path_factory: pytest.TempPathFactory) -> Plan:
    cluster = load_cluster(ROOT / "examples/clusters/h800_h20.yaml")
    w = load_workload(ROOT / "examples/workloads/math_grpo.yaml")
    w = w.model_copy(
        update={"tasks": [NOOP], "rollout_tp": 1, "zero_stage": 3, "mixed_trainer": False}
    )
    res = make_plan(
        cluster,
        load_model_shape("qwen3-8b"),
        w,
        budget=60.0,
        time_limit_s=20,
        simulate_plan=False,
        baselines=False,
    )
    path = save_plan(res.plan, tmp_path_factory.mktemp("plan") / "plan.yaml")
    return load_plan(path)


def _with_task(mode: str = "async") -> ExperimentConfig:
    cfg = load_config(CONFIG, [f"run.mode={mode}"])
    data = cfg.model_dump(mode="json")
    data["workflow"]["tasks"] = [NOOP.model_dump(mode="json")]
    return ExperimentConfig.model_validate(data)


def test_the_planner_places_every_instance_apart_from_the_pools(planned: Plan) -> None:
    task = planned.decisions.task("noop")
    assert task is not None and len(task.slots) == NOOP.instances
    assert all(len(s.gpu_ids) == NOOP.gpus for s in task.slots)
    pools = {
        (s.node, g) for w, _, s in planned.device_slots() if "noop" not in w for g in s.gpu_ids
    }
    mine = {(s.node, g) for s in task.slots for g in s.gpu_ids}
    assert mine and not mine & pools
    # the task's GPUs are paid from the same budget
    assert planned.predicted.cost_usd_per_h <= planned.budget_usd_per_h


def test_a_plan_that_places_one_gpu_twice_is_refused(planned: Plan) -> None:
    data = planned.model_dump(mode="json")
    data["decisions"]["tasks"][0]["slots"][0] = data["trainer"]["placements"][0] | {
        "gpu_ids": data["trainer"]["placements"][0]["gpu_ids"][:1]
    }
    with pytest.raises(
        ValueError, match=r"placed for both 'trainer' and 'decisions.tasks\[0\] \(noop\)"
    ):
        Plan.model_validate(data)


def test_the_layout_has_one_worker_per_instance_on_its_slot(planned: Plan) -> None:
    layout = build_layout(_with_task(), planned)
    workers = layout.by_role("worker")
    task = planned.decisions.task("noop")
    assert task is not None
    assert [w.name for w in workers] == ["noop-0", "noop-1"]
    assert [w.node_names[0] for w in workers] == [s.node for s in task.slots]
    assert all(w.gpu_kind == task.gpu_kind and w.gpus == 1 for w in workers)
    # a config whose task the plan does not place is refused, naming the task
    bare = planned.model_copy(update={"decisions": Decisions()})
    with pytest.raises(ConfigError, match="task 'noop' needs 1 GPU"):
        build_layout(_with_task(), bare)


def test_k8s_renders_the_task_on_its_kind(planned: Plan, tmp_path: Path) -> None:
    render("k8s", _with_task(), planned, DeployConfig(), tmp_path / "k8s")
    task = planned.decisions.task("noop")
    assert task is not None and task.gpu_kind is not None
    for i in range(2):
        objs = list(yaml.safe_load_all((tmp_path / f"k8s/25-task-noop-{i}.yaml").read_text()))
        (dep,) = [o for o in objs if o["kind"] == "Deployment"]
        pod = dep["spec"]["template"]["spec"]
        assert pod["containers"][0]["args"][:2] == ["python", "-c"]
        assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert task.gpu_kind.lower() in yaml.safe_dump(pod["nodeSelector"]).lower()


def test_compose_renders_a_cpu_task(tmp_path: Path) -> None:
    """A GPU task takes machines of its own (scheduler/tasks.py), which a one-host compose
    file cannot hold; a CPU task runs beside the controller."""
    cpu_task = NOOP.model_copy(update={"gpus": 0})
    cfg = load_config(ROOT / "examples/gsm8k_gpu.yaml")
    data = cfg.model_dump(mode="json")
    data["workflow"]["tasks"] = [cpu_task.model_dump(mode="json")]
    cfg = ExperimentConfig.model_validate(data)
    plan = load_plan(ROOT / "examples/plans/one_node_8gpu.yaml")
    render("compose", cfg, plan, DeployConfig(), tmp_path / "compose")
    compose = yaml.safe_load((tmp_path / "compose/docker-compose.yaml").read_text())
    for name in ("noop-0", "noop-1"):
        svc = compose["services"][name]
        assert svc["command"][:2] == ["python", "-c"] and "deploy" not in svc


def test_slurm_renders_the_task_as_its_own_pool(planned: Plan, tmp_path: Path) -> None:
    site = load_site(ROOT / "examples/slurm/site_cluster.yaml")
    site = site.model_copy(update={"shared_dir": str(tmp_path / "shared")})
    render_slurm(_with_task(), planned, site, tmp_path / "out", "site.yaml")
    script = (tmp_path / "out/job.sbatch").read_text()
    assert "WORKERS=('noop-0' 'noop-1')" in script or "WORKERS=(noop-0 noop-1)" in script
    assert "noop-0) launch noop-0" in script and "noop-1) launch noop-1" in script


def test_the_box_starts_each_instance_in_its_planned_node(
    planned: Plan, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hexctl.box.place import place_on_box
    from hexctl.launch.run import process_specs

    class Node:
        def __init__(self, name: str) -> None:
            self.name, self.cpu, self.iface = name, 1.0, "eth0"
            self.address, self.max_running_requests = "10.9.0.2", 8

    class State:
        def node(self, name: str) -> Node:
            return Node(name)

    monkeypatch.setattr("hexctl.box.place.load_state", lambda name: State())
    monkeypatch.setattr(
        "hexctl.box.place.node_argv", lambda node, argv: ["in-node", node.name, *argv]
    )
    cfg = _with_task().model_copy(deep=True)
    cfg.run.box, cfg.run.run_id, cfg.run.output_dir = "t", "r", str(tmp_path)
    layout = build_layout(cfg, planned)
    specs = process_specs(cfg, layout, tmp_path / "config.yaml")
    place_on_box(cfg, layout, specs)
    by_name = {s.name: s for s in specs}
    task = planned.decisions.task("noop")
    assert task is not None
    for i, slot in enumerate(task.slots):
        assert by_name[f"noop-{i}"].command[:2] == ["in-node", slot.node]
    assert by_name["controller"].command[0] != "in-node"


@pytest.mark.parametrize("target", ["compose", "k8s", "slurm", "local"])
def test_every_target_runs_a_sync_config_synchronously(
    planned: Plan, tmp_path: Path, target: str
) -> None:
    """A plan tuned for an async run (η, k) and a config that says sync: every target's
    resolved config is η = 0, k = 1."""
    if target == "compose":
        planned = load_plan(ROOT / "examples/plans/one_node_8gpu.yaml")
        cfg = load_config(ROOT / "examples/gsm8k_gpu.yaml", ["run.mode=sync"])
    else:
        cfg = _with_task("sync")
    tuned = planned.model_copy(
        update={"decisions": planned.decisions.model_copy(update={"max_staleness": 6})}
    )
    tuned.decisions.publish_every = 2
    out = tmp_path / target
    if target == "slurm":
        site = load_site(ROOT / "examples/slurm/site_cluster.yaml")
        site = site.model_copy(update={"shared_dir": str(tmp_path / "shared")})
        render_slurm(cfg, tuned, site, out, "site.yaml")
        written = yaml.safe_load((out / "config.yaml").read_text())
    elif target == "local":
        from hexctl.job.prepare import apply_plan

        written = apply_plan(cfg, tuned, lambda line: None).model_dump(mode="json")
    else:
        render(target, cfg, tuned, DeployConfig(), out)
        (found,) = [p for p in out.rglob("config.yaml") if "secrets" not in p.parts]
        written = yaml.safe_load(found.read_text())
    assert written["run"]["mode"] == "sync"
    assert written["buffer"]["max_staleness"] == 0
    assert written["trainer"]["publish_every"] == 1


def test_a_sync_config_is_synchronous_whatever_it_says_of_eta() -> None:
    cfg = load_config(ROOT / "examples/tiny_cpu.yaml", ["run.mode=sync", "buffer.max_staleness=8"])
    assert (cfg.buffer.max_staleness, cfg.trainer.publish_every) == (0, 1)
    again = ExperimentConfig.model_validate(cfg.model_dump(mode="json"))
    assert again == cfg


def test_a_task_on_taken_ports_moves_and_its_command_follows() -> None:
    import socket

    from hexctl.job.prepare import choose_ports

    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    taken = held.getsockname()[1]
    try:
        cfg = ExperimentConfig.model_validate(
            {
                "workflow": {
                    "tasks": [
                        {
                            "name": "ref",
                            "role": "reference",
                            "command": ["areal-hex", "serve", "{config}", "--port", "{port}"],
                            "port": taken,
                            "instances": 2,
                        }
                    ]
                },
                "algo": {"kl_coef": 0.02},
            }
        )
        said: list[str] = []
        choose_ports(cfg, said.append)
    finally:
        held.close()
    task = cfg.workflow.tasks[0]
    assert task.port != taken and any("'ref'" in s and str(taken) in s for s in said)
    workers = build_layout(cfg).by_role("worker")
    assert [w.command[-1] for w in workers] == [str(task.port), str(task.port + 1)]
    assert [w.port for w in workers] == [task.port, task.port + 1]
    assert task.instance_urls()[1] == f"http://127.0.0.1:{task.port + 1}"


def test_a_port_placeholder_without_a_port_is_refused() -> None:
    with pytest.raises(ValueError, match=r"\{port\} but it has no port"):
        TaskSpec(name="w", command=["x", "--port", "{port}"])
