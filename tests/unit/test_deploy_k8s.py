"""Kubernetes rendering of the example plans: schema-valid objects (kubernetes-validate,
strict, offline) whose GPUs, placement, rendezvous and secrets match the plan."""

from __future__ import annotations

import base64
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from areal_hex.config import ExperimentConfig, load_config
from areal_hex.plan import Plan, load_plan
from hexctl.deploy import render
from hexctl.deploy.config import DeployConfig
from hexctl.deploy.names import GPU_PRODUCT_LABELS
from tests.k8s_schema import job_of, validate

ROOT = Path(__file__).resolve().parents[2]
K8S_VERSION = "1.30.0"
CASES = [
    ("examples/plans/h800_h20.yaml", "qwen3-8b.yaml"),
    ("examples/plans/a100_l40s_l4.yaml", "qwen3-1.7b.yaml"),
    ("examples/plans/workstation_l40s_l4.yaml", "qwen3-0.6b.yaml"),
    # real planner output: mixed TP degrees, three GPU kinds
    ("tests/data/planner_hetrl_plan.yaml", "qwen3-1.7b.yaml"),
]


def _load(plan_file: str, cfg_file: str) -> tuple[Plan, ExperimentConfig]:
    plan = load_plan(ROOT / plan_file)
    return plan, load_config(ROOT / "examples/deploy" / cfg_file)


def _objects(out: Path) -> list[dict]:
    """The objects `kubectl apply -k out` applies: the kustomization's resources."""
    kust = yaml.safe_load((out / "kustomization.yaml").read_text())
    return [
        o
        for f in kust["resources"]
        for o in yaml.safe_load_all((out / f).read_text())
        if o is not None
    ]


def _kind(objs: list[dict], kind: str) -> list[dict]:
    return [o for o in objs if o["kind"] == kind]


@pytest.fixture(params=CASES, ids=[Path(c[0]).stem for c in CASES])
def rendered(request, tmp_path):
    plan, cfg = _load(*request.param)
    render("k8s", cfg, plan, DeployConfig(), tmp_path)
    return plan, cfg, tmp_path, _objects(tmp_path)


def test_every_object_passes_strict_schema_validation(rendered):
    _, _, _, objs = rendered
    kinds = {o["kind"] for o in objs}
    assert {"Secret", "ConfigMap", "PersistentVolumeClaim", "StatefulSet"} <= kinds
    assert {"Deployment", "Service", "Job", "JobSet", "NetworkPolicy"} <= kinds
    assert "PodDisruptionBudget" in kinds and "Namespace" not in kinds  # not the run's own
    for o in objs:
        # raises on any schema violation, and SchemaNotFoundError on an unknown kind
        assert validate(o, K8S_VERSION) == "1.30"


@pytest.mark.parametrize("version", ["1.27.0", "1.33.0"])
def test_objects_valid_for_older_and_newer_kubernetes(tmp_path, version):
    plan, cfg = _load(*CASES[0])
    render("k8s", cfg, plan, DeployConfig(), tmp_path)
    for o in _objects(tmp_path):
        assert validate(o, version) == version[:4]


def test_strict_validation_catches_a_typo(rendered):
    _, _, _, objs = rendered
    job = _trainer_job(objs)
    job["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(job, K8S_VERSION, strict=True)


def _gpus(pod_spec: dict) -> int:
    return sum(
        int(c["resources"]["limits"].get("nvidia.com/gpu", 0)) for c in pod_spec["containers"]
    )


def test_gpu_requests_add_up_to_the_plan(rendered):
    plan, _, _, objs = rendered
    inference = [o for o in _kind(objs, "Deployment") if _component(o) == "inference"]
    assert len(inference) == len(plan.rollout)
    assert sum(_gpus(o["spec"]["template"]["spec"]) for o in inference) == sum(
        i.tp for i in plan.rollout
    )
    job = _trainer_job(objs)
    per_pod = _gpus(job["spec"]["template"]["spec"])
    assert per_pod * job["spec"]["completions"] == plan.trainer.world_size
    for o in objs:
        spec = o.get("spec", {}).get("template", {}).get("spec")
        if spec:  # requests equal limits for GPUs
            for c in spec["containers"]:
                r = c["resources"]
                assert r["requests"].get("nvidia.com/gpu") == r["limits"].get("nvidia.com/gpu")
    controller = [o for o in _kind(objs, "Job") if _component(o) == "controller"]
    assert _gpus(controller[0]["spec"]["template"]["spec"]) == 0


def _component(o: dict) -> str:
    return o["metadata"]["labels"]["app.kubernetes.io/component"]


def _trainer_job(objs: list[dict]) -> dict:
    """The trainer's Indexed Job: the JobSet's job template, or the fallback Job."""
    (job,) = [o for o in objs if _component(o) == "trainer" and o["kind"] in {"Job", "JobSet"}]
    return job_of(job) if job["kind"] == "JobSet" else job


def test_each_inference_deployment_lands_only_on_its_gpu_kind(rendered):
    plan, cfg, _, objs = rendered
    by_name = {
        o["metadata"]["name"]: o for o in _kind(objs, "Deployment") if _component(o) == "inference"
    }
    for i, inst in enumerate(plan.rollout):
        (dep,) = [o for n, o in by_name.items() if n.endswith(inst.id)]
        spec = dep["spec"]["template"]["spec"]
        assert spec["nodeSelector"] == {"nvidia.com/gpu.product": GPU_PRODUCT_LABELS[inst.gpu_kind]}
        c = spec["containers"][0]
        # rendered from the layout: the real CLI entry point, behind the secret wrapper
        # (the config leaves inference.sglang.tp_size at 1: other degrees are overrides)
        tp = [] if inst.tp == 1 else [f"inference.sglang.tp_size={inst.tp}"]
        assert c["args"] == ["areal-hex", "serve", "{config}", *tp, "--index", str(i)]
        assert c["command"][:3] == ["python3", "-m", "hexctl.runtime.entry"]
        port = cfg.inference.base_port + i
        assert c["ports"][0]["containerPort"] == port
        assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": port}
        assert c["livenessProbe"]["httpGet"]["path"] == "/health"
        labels = dep["spec"]["template"]["metadata"]["labels"]
        assert labels["areal-hex/gpu-kind"] == inst.gpu_kind.lower()
        sel = dep["spec"]["selector"]["matchLabels"]
        assert sel.items() <= labels.items()
        (svc,) = [
            o for o in _kind(objs, "Service") if o["metadata"]["name"] == dep["metadata"]["name"]
        ]
        assert svc["spec"]["selector"] == sel and svc["spec"]["ports"][0]["port"] == port


def _rendezvous(objs: list[dict], plan: Plan) -> tuple[dict, dict]:
    """Check the trainer's pods against the plan; returns (Job, env of its container)."""
    job = _trainer_job(objs)
    nodes = len(plan.trainer.placements)
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"] == nodes
    pod = spec["template"]["spec"]
    c = pod["containers"][0]
    env = {e["name"]: e.get("value") for e in c["env"]}
    for prefix in ("", "PET_"):  # PET_*: torchrun's environment form of its flags
        assert env[f"{prefix}MASTER_ADDR"] == env["MASTER_ADDR"]
        assert env[f"{prefix}NNODES"] == str(nodes)
        rank = [e for e in c["env"] if e["name"] == f"{prefix}NODE_RANK"][0]
        assert "job-completion-index" in rank["valueFrom"]["fieldRef"]["fieldPath"]
    assert int(env["PET_MASTER_PORT"]) == c["ports"][0]["containerPort"]
    assert int(env["NNODES"]) * int(env["NPROC_PER_NODE"]) == plan.trainer.world_size
    assert (
        pod["nodeSelector"]["nvidia.com/gpu.product"] == GPU_PRODUCT_LABELS[plan.trainer.gpu_kind]
    )
    assert pod["restartPolicy"] == "Never"
    return job, env


def test_trainer_is_a_jobset_that_restarts_all_ranks_together(rendered):
    plan, _, _, objs = rendered
    (js,) = _kind(objs, "JobSet")
    job, env = _rendezvous(objs, plan)
    assert js["spec"]["failurePolicy"] == {"maxRestarts": 3}
    assert job["spec"]["backoffLimit"] == 0  # one failed rank fails the group
    sub = js["spec"]["network"]["subdomain"]
    assert js["spec"]["network"]["enableDNSHostnames"] is True
    # JobSet pod hostnames: <jobset>-<replicated job>-<job index>-<pod index>
    (rj,) = js["spec"]["replicatedJobs"]
    assert env["MASTER_ADDR"] == f"{js['metadata']['name']}-{rj['name']}-0-0.{sub}"
    assert rj["replicas"] == 1
    # no headless Service of ours: the JobSet controller creates `sub`
    assert not [o for o in _kind(objs, "Service") if o["metadata"]["name"] == sub]
    (cm,) = _kind(objs, "ConfigMap")
    deployed = ExperimentConfig.model_validate(yaml.safe_load(cm["data"]["config.yaml"]))
    assert deployed.trainer.resume == "auto" and deployed.trainer.checkpoint_dir is None


def test_indexed_job_fallback_with_its_own_headless_service(tmp_path):
    plan, cfg = _load(*CASES[0])
    dcfg = DeployConfig.model_validate({"trainer": {"gang": "indexed-job", "backoff_limit": 1}})
    render("k8s", cfg, plan, dcfg, tmp_path)
    objs = _objects(tmp_path)
    assert not _kind(objs, "JobSet")
    for o in objs:
        validate(o, K8S_VERSION)
    job, env = _rendezvous(objs, plan)
    assert job["kind"] == "Job" and job["spec"]["backoffLimit"] == 1
    pod = job["spec"]["template"]["spec"]
    (headless,) = [o for o in _kind(objs, "Service") if o["metadata"]["name"] == pod["subdomain"]]
    assert headless["spec"]["clusterIP"] == "None"
    assert (
        headless["spec"]["selector"].items()
        <= job["spec"]["template"]["metadata"]["labels"].items()
    )
    assert env["MASTER_ADDR"] == f"{job['metadata']['name']}-0.{pod['subdomain']}"
    assert headless["spec"]["ports"][0]["port"] == int(env["MASTER_PORT"])


def test_jobset_schema_catches_a_typo(rendered):
    _, _, _, objs = rendered
    (js,) = _kind(objs, "JobSet")
    js["spec"]["failurePolicy"]["maxRestart"] = 3
    with pytest.raises(Exception, match="maxRestart"):
        validate(js, K8S_VERSION)


def test_configmap_holds_resolved_config_and_no_secret(rendered):
    plan, _, out, objs = rendered
    (secret,) = _kind(objs, "Secret")
    values = {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
    assert set(values) == {"redis-password", "api-token"}
    assert all(len(v) >= 32 for v in values.values())
    for key, value in values.items():
        assert (out / "secrets" / key).read_text().strip() == value
        assert (out / "secrets" / key).stat().st_mode & 0o077 == 0
    assert (out / "secrets/secret.yaml").stat().st_mode & 0o077 == 0
    (cm,) = _kind(objs, "ConfigMap")
    cfg = ExperimentConfig.model_validate(yaml.safe_load(cm["data"]["config.yaml"]))
    assert cfg.redis.password is None and cfg.inference.api_key is None
    assert cfg.inference.num_servers == len(plan.rollout)
    # ranks per node: the launcher on each trainer node starts that many
    assert cfg.trainer.num_ranks * len(plan.trainer.placements) == plan.trainer.world_size
    assert cfg.trainer.master_port == 29500
    assert Plan.model_validate(yaml.safe_load(cm["data"]["plan.yaml"])) == plan
    redis_svc = [o for o in _kind(objs, "Service") if _component(o) == "redis"][0]
    assert cfg.redis.url == f"redis://{redis_svc['metadata']['name']}:6379/0"
    sts = _kind(objs, "StatefulSet")[0]
    assert "--appendonly yes" in sts["spec"]["template"]["spec"]["containers"][0]["command"][2]
    # no secret value anywhere but the Secret itself (plain or base64)
    for f in out.rglob("*"):
        if f.is_file() and f.parent.name != "secrets":
            text = f.read_text()
            for v in values.values():
                assert v not in text, f
                assert base64.b64encode(v.encode()).decode() not in text, f


def test_pods_are_non_root_and_network_policies_cover_them(rendered):
    _, cfg, _, objs = rendered
    pods = [o["spec"]["template"] for o in objs if "template" in o.get("spec", {})]
    pods.append(_trainer_job(objs)["spec"]["template"])  # inside the JobSet
    instance = objs[0]["metadata"]["labels"]["app.kubernetes.io/instance"]
    allowed_volumes = {"configMap", "secret", "emptyDir", "persistentVolumeClaim"}
    for t in pods:  # the "restricted" Pod Security Standard, as the Namespace enforces
        spec = t["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["runAsUser"] > 0
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert not {"hostNetwork", "hostPID", "hostIPC"} & set(spec)
        for v in spec.get("volumes", []):
            assert set(v) - {"name"} <= allowed_volumes, v
        assert t["metadata"]["labels"]["app.kubernetes.io/instance"] == instance
        for c in spec["containers"] + spec.get("initContainers", []):
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
            assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
            assert c["resources"]["requests"]["memory"] == c["resources"]["limits"]["memory"]
            # nothing writes to the image: /tmp and /dev/shm are emptyDirs
            assert c["securityContext"]["readOnlyRootFilesystem"] is True
            assert c["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
            mounts = {m["mountPath"] for m in c.get("volumeMounts", [])}
            if "hexctl.runtime.entry" in c["command"]:  # it writes the runtime config
                assert {"/tmp", "/dev/shm"} <= mounts, c["name"]
    assert len(pods) == len([o for o in objs if o["kind"] == "Deployment"]) + 5
    deployed = ExperimentConfig.model_validate(
        yaml.safe_load(_kind(objs, "ConfigMap")[0]["data"]["config.yaml"])
    )
    scraped = {}
    for t in pods:
        notes = t["metadata"].get("annotations", {})
        if notes.get("prometheus.io/scrape") == "true":
            scraped.setdefault(t["metadata"]["labels"]["app.kubernetes.io/component"], set()).add(
                int(notes["prometheus.io/port"])
            )
    assert scraped["trainer"] == {deployed.trainer.metrics_port}
    assert scraped["controller"] == {deployed.rollout.metrics_port}
    assert scraped["inference"] == {int(u.rsplit(":", 1)[1]) for u in deployed.inference.urls()}
    policies = {o["metadata"]["name"].split("-")[-1]: o for o in _kind(objs, "NetworkPolicy")}
    # servers: the controller on their ports (weights come over the shared volume, so the
    # trainer needs no route to them), Prometheus' namespace for /metrics
    ctl, prom = policies["inference"]["spec"]["ingress"][:2]
    assert ctl["from"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == (
        "controller"
    )
    assert prom["from"] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    ]
    (peers, _) = policies["trainer"]["spec"]["ingress"]
    assert [
        f["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for f in peers["from"]
    ] == ["trainer"]
    assert policies["ingress"]["spec"]["ingress"] == []  # default deny for the job's pods
    (rule,) = policies["redis"]["spec"]["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": 6379}]
    assert rule["from"] == [
        {"podSelector": {"matchLabels": {"app.kubernetes.io/instance": instance}}}
    ]
    (pvc,) = _kind(objs, "PersistentVolumeClaim")
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]


def test_controller_is_told_where_each_server_listens(rendered):
    plan, cfg, _, objs = rendered
    (job,) = [o for o in objs if _component(o) == "controller"]
    assert job["kind"] == "Job"  # it exits when done: never restarted after success
    assert job["spec"]["template"]["spec"]["restartPolicy"] == "OnFailure"
    c = job["spec"]["template"]["spec"]["containers"][0]
    assert c["args"] == ["areal-hex", "rollout", "{config}"]
    (cm,) = _kind(objs, "ConfigMap")
    deployed = ExperimentConfig.model_validate(yaml.safe_load(cm["data"]["config.yaml"]))
    urls = deployed.inference.urls()  # inference.server_urls, read by the controller
    services = {o["metadata"]["name"]: o for o in _kind(objs, "Service")}
    assert len(urls) == len(plan.rollout)
    for i, url in enumerate(urls):
        host, port = url.removeprefix("http://").split(":")
        assert (
            services[host]["spec"]["ports"][0]["port"] == int(port) == cfg.inference.base_port + i
        )
        assert host.endswith(plan.rollout[i].id)


def test_existing_secret_external_redis_and_options(tmp_path):
    plan, cfg = _load(*CASES[1])
    dcfg = DeployConfig.model_validate(
        {
            "namespace": "rl-team",
            "existing_secret": "team-secrets",
            "redis": {"mode": "external", "url": "redis://:hunter2-secret@redis.infra:6380/2"},
            "storage": {"storage_class": "cephfs", "existing_claim": None},
            "gpu_label_key": "areal-hex/gpu-kind",
            "pin_nodes": True,
            "create_namespace": False,
        }
    )
    render("k8s", cfg, plan, dcfg, tmp_path)
    objs = _objects(tmp_path)
    assert not _kind(objs, "Secret") and not _kind(objs, "StatefulSet")
    assert not _kind(objs, "Namespace")
    assert not (tmp_path / "secrets").exists()
    assert all(o["metadata"]["namespace"] == "rl-team" for o in objs)
    (cm,) = _kind(objs, "ConfigMap")
    assert "hunter2" not in cm["data"]["config.yaml"]
    assert "redis://redis.infra:6380/2" in cm["data"]["config.yaml"]
    assert _kind(objs, "PersistentVolumeClaim")[0]["spec"]["storageClassName"] == "cephfs"
    for dep in _kind(objs, "Deployment"):
        spec = dep["spec"]["template"]["spec"]
        vols = {v["name"]: v for v in spec["volumes"]}
        assert vols["secrets"]["secret"]["secretName"] == "team-secrets"
        if _component(dep) == "inference":
            assert spec["nodeSelector"]["areal-hex/gpu-kind"] in {"l40s", "l4"}
            (term,) = _node_terms(spec)  # pin_nodes: plan node names are hostnames
            assert term == [_host(dep_node(dep))]
    for o in objs:
        validate(o, K8S_VERSION)


def test_rerender_keeps_secrets_and_drops_stale_files(tmp_path):
    plan, cfg = _load(*CASES[0])
    render("k8s", cfg, plan, DeployConfig(), tmp_path)
    before = (tmp_path / "secrets" / "redis-password").read_text()
    assert (tmp_path / "15-inference-rollout-h800-3.yaml").is_file()
    smaller = plan.model_copy(update={"rollout": plan.rollout[:8]})
    render("k8s", cfg, smaller, DeployConfig(), tmp_path, force=True)
    assert (tmp_path / "secrets" / "redis-password").read_text() == before
    assert not (tmp_path / "15-inference-rollout-h800-3.yaml").exists()
    assert len(list(tmp_path.glob("15-inference-*.yaml"))) == 8


def test_initial_weights_are_prepared_once_and_awaited(rendered):
    plan, experiment, _, objs = rendered
    (cm,) = _kind(objs, "ConfigMap")
    cfg = ExperimentConfig.model_validate(yaml.safe_load(cm["data"]["config.yaml"]))
    assert cfg.model.path == f"/data/runs/{cfg.run.run_id}/weights/v0"
    assert cfg.model.path.startswith(cfg.inference.weights_dir)
    (prep,) = [o for o in _kind(objs, "Job") if _component(o) == "prepare"]
    pod = prep["spec"]["template"]["spec"]
    c = pod["containers"][0]
    # the experiment's model (a hub name here) becomes v0 of the run
    source = experiment.model.path
    assert c["args"] == [
        "python3",
        "-m",
        "hexctl.deploy.prepare",
        "{config}",
        "--prediction",
        "/etc/areal-hex/prediction.json",
        "--source",
        source,
    ]
    assert "initContainers" not in pod and "nvidia.com/gpu" not in c["resources"]["limits"]
    waiting = [o for o in objs if _component(o) in {"inference", "controller"}]
    waiting = [o for o in waiting if o["kind"] in {"Deployment", "Job"}] + [_trainer_job(objs)]
    assert len(waiting) == len(plan.rollout) + 2
    for o in waiting:
        (init,) = o["spec"]["template"]["spec"]["initContainers"]
        assert init["command"][-1] == "wait"
        assert init["args"][0] == f"{cfg.model.path}/config.json"


def _node_terms(pod: dict) -> list[list[dict]]:
    req = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    return [t["matchExpressions"] for t in req["nodeSelectorTerms"]]


def _host(name: str) -> dict:
    return {"key": "kubernetes.io/hostname", "operator": "In", "values": [name]}


def dep_node(dep: dict) -> str:
    """The plan node of an inference Deployment (from the plan it was rendered for)."""
    plan = load_plan(ROOT / CASES[1][0])
    (inst,) = [i for i in plan.rollout if dep["metadata"]["name"].endswith(i.id)]
    return inst.placement.node


def test_placement_maps_plan_nodes_to_cluster_nodes(tmp_path):
    plan, cfg = _load(*CASES[0])  # h800_h20: trainer on h800-0 and h800-1
    assert [p.node for p in plan.trainer.placements] == ["h800-0", "h800-1"]
    nodes = sorted({i.placement.node for i in plan.rollout} | {"h800-0", "h800-1"})
    placement = {n: {"hostname": f"gpu-{n}"} for n in nodes}
    placement["h800-1"] = {"hostname": "gpu-h800-1", "labels": {"example.com/rack": "r7"}}
    dcfg = DeployConfig.model_validate({"placement": placement, "kueue_queue": "team-a"})
    render("k8s", cfg, plan, dcfg, tmp_path)
    objs = _objects(tmp_path)
    for o in objs:
        validate(o, K8S_VERSION)
    (js,) = _kind(objs, "JobSet")
    assert js["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    pod = job_of(js)["spec"]["template"]["spec"]
    rack = {"key": "example.com/rack", "operator": "In", "values": ["r7"]}
    # any of the planned machines, each matched by all it is mapped to ...
    assert _node_terms(pod) == [[_host("gpu-h800-0")], [_host("gpu-h800-1"), rack]]
    # ... and one trainer pod per machine
    (anti,) = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert anti["topologyKey"] == "kubernetes.io/hostname"
    assert anti["labelSelector"]["matchLabels"].items() <= js["metadata"]["labels"].items()
    for dep in [o for o in _kind(objs, "Deployment") if _component(o) == "inference"]:
        (inst,) = [i for i in plan.rollout if dep["metadata"]["name"].endswith(i.id)]
        spec = dep["spec"]["template"]["spec"]
        assert _node_terms(spec) == [[_host(f"gpu-{inst.placement.node}")]]
        assert "podAntiAffinity" not in spec["affinity"]


def test_placement_must_cover_the_plan(tmp_path):
    from areal_hex.config import ConfigError

    plan, cfg = _load(*CASES[0])
    dcfg = DeployConfig.model_validate(
        {"placement": {"h800-1": {"hostname": "a"}, "h900-9": {"labels": {"rack": "r1"}}}}
    )
    with pytest.raises(ConfigError) as exc:
        render("k8s", cfg, plan, dcfg, tmp_path)
    msg = str(exc.value)
    assert "placement maps no Kubernetes node for plan node(s) h20-0, h800-0, h800-2" in msg
    assert "placement names h900-9, which the plan does not use" in msg
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


def test_a_trainer_that_cannot_resume_is_refused(tmp_path):
    from areal_hex.config import ConfigError

    plan, cfg = _load(*CASES[0])
    bad = cfg.model_copy(deep=True)
    bad.trainer.resume = "none"
    bad.trainer.checkpoint_dir = "/scratch/ckpt"
    with pytest.raises(ConfigError) as exc:
        render("k8s", bad, plan, DeployConfig(), tmp_path)
    assert "trainer.resume is 'none'" in str(exc.value)
    assert "trainer.checkpoint_dir '/scratch/ckpt' is not on the shared volume" in str(exc.value)
