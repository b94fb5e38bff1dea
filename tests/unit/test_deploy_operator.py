"""An operator's second day on Kubernetes: many runs in one namespace that share no name
or selector, a namespace the deploy does not own, a delete that takes one run, an
overlay that moves every object, the plan's decisions in the rendered job (GPU kinds,
prediction, per-GPU resources), and the guards operators expect (PDBs, priority,
liveness, egress, image digests)."""

from __future__ import annotations

import shutil
import subprocess
import urllib.request
from itertools import combinations
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from areal_hex.config import ConfigError, ExperimentConfig, load_config
from areal_hex.plan import Baselines, load_plan
from areal_hex.prom import prediction_collectors, registry_with
from hexctl.deploy import render
from hexctl.deploy.config import DeployConfig
from hexctl.deploy.k8s import DELETE_KINDS
from hexctl.deploy.prepare import install_prediction
from hexctl.deploy.quantities import cpu_millis, memory_bytes
from tests.k8s_schema import validate

ROOT = Path(__file__).resolve().parents[2]
PLAN = ROOT / "examples/plans/a100_l40s_l4.yaml"
CONFIG = ROOT / "examples/deploy/qwen3-1.7b.yaml"
HETRL_PLAN = ROOT / "tests/data/planner_hetrl_plan.yaml"  # three rollout kinds, TP 4/2/1
DIGEST = "sha256:" + "ab" * 32
INSTANCE = "app.kubernetes.io/instance"
COMPONENT = "app.kubernetes.io/component"


def _render(out: Path, *overrides: str, plan: Path = PLAN, **dcfg: Any) -> list[dict]:
    cfg = load_config(CONFIG, list(overrides))
    render("k8s", cfg, load_plan(plan), DeployConfig.model_validate(dcfg), out)
    return _objects(out)


def _objects(out: Path) -> list[dict]:
    kust = yaml.safe_load((out / "kustomization.yaml").read_text())
    return [o for f in kust["resources"] for o in yaml.safe_load_all((out / f).read_text()) if o]


def _selectors(node: Any) -> list[dict[str, str]]:
    """Every label selector in an object (Service selectors, matchLabels of workloads,
    policies, budgets and affinities), as label maps; namespace selectors aside."""
    found: list[dict[str, str]] = []
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("selector", "podSelector", "labelSelector") and isinstance(value, dict):
                labels = value.get("matchLabels", value if "matchExpressions" not in value else {})
                if labels:
                    found.append(labels)
            found += _selectors(value)
    elif isinstance(node, list):
        for item in node:
            found += _selectors(item)
    return found


def _kubectl() -> str:
    path = shutil.which("kubectl")
    if path is None:
        pytest.skip("kubectl not installed (its `kubectl kustomize` runs offline)")
    return path


def _kustomize(folder: Path) -> list[dict]:
    r = subprocess.run(
        [_kubectl(), "kustomize", str(folder)], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    return [o for o in yaml.safe_load_all(r.stdout) if o]


def pdb_instance(objs: list[dict]) -> str:
    (inst,) = {o["metadata"]["labels"][INSTANCE] for o in objs}
    return inst


# ---------------------------------------------------------------- many runs, one namespace


def test_run_ids_differing_in_punctuation_share_no_name_or_selector(tmp_path):
    ids = ["exp.1", "exp_1", "EXP-1", "exp-1"]
    runs = {}
    for i, rid in enumerate(ids):
        objs = _render(tmp_path / "runs" / str(i), f"run.run_id={rid}")
        names = {(o["kind"], o["metadata"]["name"]) for o in objs}
        selectors = [s for o in objs for s in _selectors(o)]
        # every selector names this run (by its instance label or a name carrying it)
        assert all(INSTANCE in s or "areal-hex/instance" in s for s in selectors), selectors
        runs[rid] = (names, {frozenset(s.items()) for s in selectors})
    for a, b in combinations(ids, 2):
        assert not runs[a][0] & runs[b][0], (a, b)
        assert not runs[a][1] & runs[b][1], (a, b)
    # a DNS-safe id is its own name; the others carry a hash of the id as typed
    assert ("Job", "exp-1-controller") in runs["exp-1"][0]


@pytest.mark.parametrize("bad", ["..", ".hidden", "a/b", "x" * 129])
def test_run_ids_that_are_paths_or_too_long_are_refused(bad):
    with pytest.raises(ConfigError, match="run.run_id"):
        load_config(CONFIG, [f"run.run_id={bad}"])


def test_the_namespace_is_not_the_runs_unless_asked(tmp_path):
    objs = _render(tmp_path / "a")
    assert not [o for o in objs if o["kind"] == "Namespace"]
    (ns,) = [o for o in _render(tmp_path / "b", create_namespace=True) if o["kind"] == "Namespace"]
    # labelled for Pod Security, not with the run: a delete by the run's label spares it
    assert INSTANCE not in ns["metadata"]["labels"]
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"


def test_the_delete_command_covers_every_kind_of_the_run(tmp_path):
    result_objs = _render(tmp_path)
    plural = {
        "JobSet": "jobsets.jobset.x-k8s.io", "Job": "jobs", "Deployment": "deployments",
        "StatefulSet": "statefulsets", "Service": "services", "ConfigMap": "configmaps",
        "Secret": "secrets", "PersistentVolumeClaim": "persistentvolumeclaims",
        "NetworkPolicy": "networkpolicies", "PodDisruptionBudget": "poddisruptionbudgets",
        "ServiceAccount": "serviceaccounts", "Role": "roles", "RoleBinding": "rolebindings",
    }  # fmt: skip
    assert {plural[o["kind"]] for o in result_objs} <= set(DELETE_KINDS)
    insts = {o["metadata"]["labels"][INSTANCE] for o in result_objs}
    assert len(insts) == 1
    # and the PVC Redis's StatefulSet creates carries the label too
    (sts,) = [o for o in result_objs if o["kind"] == "StatefulSet"]
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    assert claim["metadata"]["labels"][INSTANCE] == insts.pop()


def test_an_overlay_namespace_moves_every_object_and_argument(tmp_path):
    base = tmp_path / "base"
    objs = _render(base, namespace="rl-demo-base")
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text("resources: [../base]\nnamespace: team-b\n")
    moved = _kustomize(overlay)
    assert len(moved) == len(objs)
    assert "rl-demo-base" not in yaml.safe_dump_all(moved)  # no object, argument or subject
    for o in moved:
        assert o["metadata"]["namespace"] == "team-b", o["kind"]
    (binding,) = [o for o in moved if o["kind"] == "RoleBinding"]
    assert binding["subjects"][0]["namespace"] == "team-b"
    (reaper,) = [o for o in moved if o["kind"] == "Job" and "reaper" in o["metadata"]["name"]]
    (c,) = reaper["spec"]["template"]["spec"]["containers"]
    assert "--namespace" not in c["args"]
    env = {e["name"]: e for e in c["env"]}
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"


# ---------------------------------------------------------------- the plan's decisions


def test_mixed_kind_scrape_shows_real_gpu_kinds_and_predicted_rates(tmp_path):
    """The controller's collectors built by its own wiring from the rendered config, and
    the trainer's predicted-rate collectors from the prediction the prepare job puts in
    the run directory."""
    from rollout_service.client import InferenceClient
    from rollout_service.controller.dispatch import Dispatcher
    from rollout_service.controller.wiring import serve_metrics

    plan = load_plan(HETRL_PLAN)
    objs = _render(tmp_path / "out", plan=HETRL_PLAN)
    (cm,) = [o for o in objs if o["kind"] == "ConfigMap"]
    cfg = ExperimentConfig.model_validate(yaml.safe_load(cm["data"]["config.yaml"]))
    kinds = [i.gpu_kind for i in plan.rollout]
    assert cfg.inference.gpu_kinds == kinds and len(set(kinds)) == 3

    cfg.rollout.metrics_port = 0  # a free port here (the pod's is fixed)
    dispatcher = Dispatcher([InferenceClient(u) for u in cfg.inference.urls()])
    for s in dispatcher.servers:
        s.healthy, s.tokens_total = True, 100 * (s.index + 1)
    ctl = SimpleNamespace(dispatcher=dispatcher, row_observers=[], gate_wait_observers=[])
    server = serve_metrics(cfg, ctl)
    assert server is not None
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics") as resp:
            text = resp.read().decode()
    finally:
        server.stop()
    tokens = [
        s
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "areal_hex_rollout_server_tokens_total"
    ]
    by_kind: dict[str, float] = {}
    for s in tokens:
        by_kind[s.labels["gpu_kind"]] = by_kind.get(s.labels["gpu_kind"], 0) + s.value
    assert set(by_kind) == set(kinds) and "unknown" not in by_kind
    assert sum(by_kind.values()) == sum(100 * (i + 1) for i in range(len(kinds)))

    # the prepare job copies the ConfigMap's prediction.json into the run directory
    (prep,) = [o for o in objs if o["metadata"]["labels"][COMPONENT] == "prepare"]
    args = prep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--prediction") + 1] == "/etc/areal-hex/prediction.json"
    shipped = tmp_path / "prediction.json"
    shipped.write_text(cm["data"]["prediction.json"])
    cfg.run.output_dir = str(tmp_path / "runs")
    install_prediction(cfg, shipped)
    reg = registry_with(*prediction_collectors(cfg.run.run_dir(), cfg.run.mode))
    from prometheus_client import generate_latest

    scraped = {
        s.name: s.value
        for f in text_string_to_metric_families(generate_latest(reg).decode())
        for s in f.samples
    }
    assert scraped == {
        "areal_hex_predicted_samples_per_second": plan.predicted.samples_per_s,
        "areal_hex_predicted_generation_samples_per_second": (
            plan.predicted.generation_samples_per_s
        ),
        "areal_hex_predicted_training_samples_per_second": plan.predicted.training_samples_per_s,
        "areal_hex_predicted_weight_sync_seconds": plan.predicted.weight_sync_s,
    }


def test_pod_resources_follow_the_gpus_with_shm_on_top(tmp_path):
    plan = load_plan(HETRL_PLAN)
    objs = _render(tmp_path, plan=HETRL_PLAN)
    res = DeployConfig().resources.inference
    tps = {}
    for o in objs:
        if o["kind"] != "Deployment":
            continue
        spec = o["spec"]["template"]["spec"]
        (c,) = spec["containers"]
        gpus = int(c["resources"]["limits"]["nvidia.com/gpu"])
        tps[gpus] = c["resources"]
        (shm,) = [v for v in spec["volumes"] if v["name"] == "shm"]
        assert memory_bytes(shm["emptyDir"]["sizeLimit"]) == gpus * memory_bytes(res.shm)
        want_memory = gpus * (memory_bytes(res.memory) + memory_bytes(res.shm))
        assert memory_bytes(c["resources"]["requests"]["memory"]) == want_memory
        assert memory_bytes(c["resources"]["limits"]["memory"]) == want_memory
        assert cpu_millis(c["resources"]["requests"]["cpu"]) == gpus * cpu_millis(res.cpu)
    assert sorted(tps) == sorted({i.tp for i in plan.rollout}) == [1, 2, 4]


def test_a_lost_rack_placement_is_a_loud_warning(tmp_path, capsys):
    from hexctl.cli import main

    plan = load_plan(PLAN)
    metis = Baselines(placement="metis", first_fit_samples_per_s=41.31)
    placed = plan.model_copy(update={"baselines": metis})
    (tmp_path / "plan.yaml").write_text(yaml.safe_dump(placed.model_dump(mode="json")))
    argv = ["deploy", str(tmp_path / "plan.yaml"), str(CONFIG), "--target", "k8s"]
    assert main([*argv, "--out", str(tmp_path / "a")]) == 0
    err = capsys.readouterr().err
    assert "WARNING: the plan places its pools on the cluster's topology" in err
    assert "41.31 first-fit" in err and "placement" in err
    # mapped node by node (here by hostname), the warning goes
    nodes = {i.placement.node for i in plan.rollout} | {p.node for p in plan.trainer.placements}
    mapped = [a for n in sorted(nodes) for a in ("--node", f"{n}={n}")]
    assert main([*argv, "--out", str(tmp_path / "b"), *mapped]) == 0
    assert "topology" not in capsys.readouterr().err


# ---------------------------------------------------------------- what operators expect


def test_budgets_priority_liveness_and_egress(tmp_path):
    objs = _render(tmp_path, priority_class="rl-batch")
    for o in objs:
        validate(o, "1.30.0")
    pdbs = {
        o["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"]: o["spec"]
        for o in objs
        if o["kind"] == "PodDisruptionBudget"
    }
    assert {k: v["maxUnavailable"] for k, v in pdbs.items()} == {
        "trainer": 0,
        "inference": 1,
        "redis": 0,
    }
    pods = [o["spec"]["template"]["spec"] for o in objs if o["kind"] in ("Deployment", "Job")]
    pods += [o["spec"]["template"]["spec"] for o in objs if o["kind"] == "StatefulSet"]
    (jobset,) = [o for o in objs if o["kind"] == "JobSet"]
    trainer_pod = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    pods.append(trainer_pod)
    assert all(p["priorityClassName"] == "rl-batch" for p in pods)
    probe = trainer_pod["containers"][0]["livenessProbe"]["exec"]["command"]
    assert probe[:4] == ["python3", "-m", "hexctl.runtime.probe", "alive"]
    assert probe[4].endswith("/metrics.jsonl") and probe[5] == "1800"

    policies = [o["spec"] for o in objs if o["kind"] == "NetworkPolicy"]
    everyone, downloads, api = [p for p in policies if p["policyTypes"] == ["Egress"]]
    # the run's pods reach each other and DNS only ...
    assert everyone["podSelector"] == {"matchLabels": {INSTANCE: pdb_instance(objs)}}
    to_run, dns = everyone["egress"]
    assert to_run == {"to": [{"podSelector": everyone["podSelector"]}]}
    assert "to" not in dns and {p["port"] for p in dns["ports"]} == {53}
    # ... the prepare job and the controller anything (the model, the dataset) ...
    (expr,) = downloads["podSelector"]["matchExpressions"]
    assert expr["values"] == ["prepare", "controller"] and downloads["egress"] == [{}]
    # ... and the reaper the API server
    assert api["podSelector"]["matchExpressions"][0]["values"] == ["lifecycle"]
    assert {p["port"] for p in api["egress"][0]["ports"]} == {443, 6443}


def test_image_digests_are_kept_and_local_images_warned_about(tmp_path, capsys):
    from hexctl.cli import main

    deploy_yaml = tmp_path / "deploy.yaml"
    images = {
        "inference": f"registry.example.com/areal-hex/inference@{DIGEST}",
        "trainer": f"registry.example.com/areal-hex/trainer:0.1.0@{DIGEST}",
        "controller": "registry.example.com/areal-hex/cpu:0.1.0",
    }
    deploy_yaml.write_text(yaml.safe_dump({"images": images}))
    argv = ["deploy", str(PLAN), str(CONFIG), "--target", "k8s"]
    assert main([*argv, "--out", str(tmp_path / "a"), "--deploy-config", str(deploy_yaml)]) == 0
    assert "local builds" not in capsys.readouterr().err
    text = yaml.safe_dump_all(_kustomize(tmp_path / "a"))
    assert f"image: {images['inference']}\n" in text
    assert f"image: {images['trainer']}\n" in text
    assert main([*argv, "--out", str(tmp_path / "b")]) == 0
    err = capsys.readouterr().err
    assert "WARNING: images.inference localhost/areal-hex/inference:0.1.0" in err
