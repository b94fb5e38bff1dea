"""What every deploy target shares: the resolved in-cluster config, secrets, run ids and
object names, and `prepare`, which checks the plan (`deploy/checks.py`) and builds the
layout. Names and the GPU-kind -> node-label table are in `deploy/names.py`.

The rendered objects come from `hexctl.job.layout.build_layout(cfg, plan)`, the same
layout `areal-hex run` starts locally, so both run one system.
"""

from __future__ import annotations

import json
import secrets
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

import yaml

from areal_hex.config import ExperimentConfig, ModelConfig, dump_yaml
from areal_hex.plan import Plan
from hexctl.deploy.checks import check_plan, refuse_mixed_trainer
from hexctl.deploy.config import DeployConfig, NodeMatch
from hexctl.deploy.names import dns_name, service_name, short_hash, slug
from hexctl.deploy.output import SECRETS
from hexctl.job.layout import CONFIG_PLACEHOLDER, Layout, build_layout
from hexctl.job.plan_config import project_plan
from hexctl.job.predict import predict_run

CONFIG_DIR = "/etc/areal-hex"  # the ConfigMap (config.yaml, plan.yaml)
SECRETS_DIR = "/run/secrets/areal-hex"  # the Secret's files (k8s); compose: /run/secrets
RUNTIME_CONFIG = "/tmp/areal-hex/config.yaml"  # config + secrets, written by deploy.entry


SGLANG_CONFIG = "/tmp/areal-hex/sglang.yaml"  # SGLang's --config file with its API key


def entry_argv(secrets_dir: str, sglang: bool = False) -> list[str]:
    """The secret-injecting wrapper every container starts through; the service's layout
    command follows after `--`. Only where the secrets are mounted differs by target. An
    SGLang server gets its API key in a config file, never on its command line."""
    argv = [
        "python3", "-m", "hexctl.runtime.entry",
        "--config", f"{CONFIG_DIR}/config.yaml",
        "--secrets", secrets_dir,
        "--out", RUNTIME_CONFIG,
    ]  # fmt: skip
    if sglang:
        argv += ["--sglang-config", SGLANG_CONFIG]
    return [*argv, "--"]


SECRET_KEYS = ("redis-password", "api-token")


@dataclass
class DeploySecrets:
    redis_password: str
    api_token: str

    def as_dict(self) -> dict[str, str]:
        return {"redis-password": self.redis_password, "api-token": self.api_token}


@dataclass
class Deployment:
    """Everything a renderer needs, checked and resolved."""

    cfg: ExperimentConfig  # the config the services load (no secrets in it)
    plan: Plan
    layout: Layout
    dcfg: DeployConfig
    prefix: str  # object-name prefix (DNS label)
    secrets: DeploySecrets
    source_model: ModelConfig  # the experiment's model, which the prepare job writes as v0
    # the plan's predicted rates (`prediction.json` in the run directory): the trainer
    # serves them next to the measured ones, the report holds the run against them
    prediction: dict[str, Any] = field(default_factory=dict)

    def prepare_command(self, prediction: str | None = None) -> list[str]:
        """Writes v0 = the experiment's model into the run's weights directory, and the
        file `prediction` (the rendered prediction.json) into the run directory."""
        cmd = ["python3", "-m", "hexctl.deploy.prepare", CONFIG_PLACEHOLDER]
        if prediction:
            cmd += ["--prediction", prediction]
        if self.source_model.path:
            cmd += ["--source", self.source_model.path]
        if self.source_model.tokenizer_path:
            cmd += ["--tokenizer-source", self.source_model.tokenizer_path]
        return cmd

    def initial_weights_marker(self) -> str:
        return f"{self.cfg.model.path}/config.json"


@dataclass
class Bundle:
    """What a target writes: relative path -> text; `private` ones are written 0600.
    `start` is the command that starts the job, `{out}` standing for the folder;
    `delete` the one that removes it and nothing else."""

    files: dict[str, str]
    private: set[str] = field(default_factory=set)
    start: str = ""
    delete: str = ""


PREDICTION = "prediction.json"


def resolved_files(d: Deployment, folder: str) -> dict[str, str]:
    """Plain copies of the config the services load, of the plan and its prediction."""
    plan_yaml = yaml.safe_dump(d.plan.model_dump(mode="json"), sort_keys=False)
    return {
        f"{folder}config.yaml": dump_yaml(d.cfg),
        f"{folder}plan.yaml": plan_yaml,
        f"{folder}{PREDICTION}": prediction_text(d.prediction),
    }


def prediction_text(prediction: dict[str, Any]) -> str:
    return json.dumps(prediction, indent=2) + "\n"


def secret_files(d: Deployment) -> dict[str, str]:
    return {f"{SECRETS}/{k}": v + "\n" for k, v in d.secrets.as_dict().items()}


def node_match(dcfg: DeployConfig, plan_node: str) -> NodeMatch | None:
    """The Kubernetes node(s) standing for `plan_node`, or None when not mapped."""
    if plan_node in dcfg.placement:
        return dcfg.placement[plan_node]
    if dcfg.pin_nodes:
        return NodeMatch(hostname=plan_node)
    return None


# ---------------------------------------------------------------- resolution


def run_id(cfg: ExperimentConfig, plan: Plan) -> str:
    """The config's run_id, or run.name plus a short hash of the plan and the config
    (secrets aside): re-rendering the same job keeps its id, any change makes a new run
    (its own objects, run directory and buffer keys)."""
    if cfg.run.run_id:
        return cfg.run.run_id
    config = cfg.model_dump(mode="json", exclude={"redis": {"password"}, "inference": {"api_key"}})
    both = json.dumps([plan.model_dump(mode="json"), config], sort_keys=True)
    return f"{slug(cfg.run.name, 40)}-{short_hash(both)}"


PREFIX_MAX = 30  # leaves room for the longest part name within a 63-character name


def object_prefix(rid: str, name: str | None = None) -> str:
    """The prefix of every object name, one to one with the run id (`names.dns_name`),
    so two runs in one namespace never share a name. `name` (the deploy config's)
    replaces the readable part; a hash of the run id follows it."""
    if name is not None:
        return f"{name}-{short_hash(rid)}"
    return dns_name(rid, PREFIX_MAX)


def instance_label(rid: str) -> str:
    """The run's `app.kubernetes.io/instance` value: every object of the run carries it,
    every selector of the run names it (one to one with the run id)."""
    return dns_name(rid, 63)


def split_redis_url(url: str) -> tuple[str, str | None, str | None]:
    """(url without credentials, username, password)."""
    parts = urlsplit(url)
    if parts.password is None and parts.username is None:
        return url, None, None
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    clean = urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))
    user = unquote(parts.username) if parts.username else None
    return clean, user, unquote(parts.password) if parts.password is not None else None


def prediction_for_plan(plan: Plan, cfg: ExperimentConfig) -> dict[str, Any]:
    """The run's `prediction.json` (the launcher's format: `areal_hex.prom`
    `prediction_collectors`, `hexctl.report.fidelity`): the cost model's rates for the
    projected config where the plan's inputs (`plan.sources`) are at hand, as
    `areal-hex run --plan` writes it; else the plan's own prediction, which is for the
    asynchronous pipeline (its synchronous block is empty, so a `run.mode: sync` run
    shows no predicted series)."""
    found = predict_run(cfg, plan)
    if "unavailable" not in found:
        return found
    p = plan.predicted
    return {
        "source": "plan",
        "cluster": plan.cluster,
        "asynchronous": {
            "pipeline_samples_per_s": p.samples_per_s,
            "generation_samples_per_s": p.generation_samples_per_s,
            "training_samples_per_s": p.training_samples_per_s,
            "weight_sync_s": p.weight_sync_s,
        },
        "synchronous": {},
        "cost_model": found["unavailable"],  # why not the cost model's own
    }


def resolve_config(
    cfg: ExperimentConfig,
    plan: Plan,
    dcfg: DeployConfig,
    prefix: str,
    target: str,
    server_urls: list[str],
    task_urls: dict[str, list[str]] | None = None,
) -> ExperimentConfig:
    """The config every deployed service loads: run dir on the shared volume, Redis at its
    service address, sizes from the plan, each server task's instances at `task_urls`
    (unless the config names them); passwords and tokens removed (they reach the
    processes from the Secret at start, see `hexctl.runtime.entry`)."""
    planned = project_plan(cfg, plan, "cluster")
    for line in planned.changes:
        print(f"areal-hex deploy: {line}", file=sys.stderr)
    data = planned.config.model_dump(mode="json")
    rid = run_id(cfg, plan)
    data["run"].update(run_id=rid, output_dir=f"{dcfg.storage.mount_path}/runs")
    if dcfg.redis.mode == "internal":
        host = "redis" if target == "compose" else f"{prefix}-redis"
        url, user = f"redis://{host}:{dcfg.redis.port}/0", None
    else:
        url, user, _ = split_redis_url(dcfg.redis.url or cfg.redis.url or "")
    # The services start from v0 on the shared volume, written once by the prepare job
    # (as `areal-hex run` writes it before starting them).
    data["model"].update(path=f"{dcfg.storage.mount_path}/runs/{rid}/weights/v0")
    data["model"].update(tokenizer_path=None)
    data["redis"].update(url=url, password=None, data_dir=None)
    if user is not None:
        data["redis"]["username"] = user
    inf = data["inference"]
    # Servers listen on their container's or pod's network (a compose network with no
    # route off the host, or the pod network behind NetworkPolicies); the controller
    # reaches each by its service name.
    inf.update(
        api_key=None,
        host="0.0.0.0",
        weights_dir=f"{dcfg.storage.mount_path}/runs/{rid}/weights",
    )
    inf["server_urls"] = server_urls  # the controller reaches server i there
    for task in data["workflow"]["tasks"]:  # and a task's instance i there
        task["urls"] = task["urls"] or (task_urls or {}).get(task["name"], [])
    data["trainer"]["master_port"] = dcfg.master_port
    # Prometheus scrapes a fixed port (a free one, 0, cannot be announced).
    if not data["trainer"].get("metrics_port"):
        data["trainer"]["metrics_port"] = dcfg.metrics.trainer_port
    if not data["rollout"].get("metrics_port"):
        data["rollout"]["metrics_port"] = dcfg.metrics.controller_port
    return ExperimentConfig.model_validate(data)


def server_urls(layout: Layout, prefix: str, target: str) -> list[str]:
    """Where the controller reaches inference server i (index order = plan order)."""
    out = []
    for svc in layout.by_role("inference"):
        host = svc.name if target == "compose" else service_name(prefix, svc)
        out.append(f"http://{host}:{svc.port}")
    return out


def task_urls(layout: Layout, prefix: str, target: str) -> dict[str, list[str]]:
    """Where the controller reaches instance i of each workflow task that listens on a
    port (a reference or reward-model server): its service's name, as for the servers."""
    out: dict[str, list[str]] = {}
    for svc in layout.by_role("worker"):
        if svc.task is not None and svc.port is not None:
            host = svc.name if target == "compose" else service_name(prefix, svc)
            out.setdefault(svc.task, []).append(f"http://{host}:{svc.port}")
    return out


def load_secrets(cfg: ExperimentConfig, dcfg: DeployConfig, out_dir: Path) -> DeploySecrets:
    """Values from the config if it has them, else those rendered before into `out_dir`
    (re-rendering must not rotate a running job's passwords), else fresh random ones."""
    old = _read_previous(out_dir)
    url_pw = split_redis_url(cfg.redis.url)[2] if cfg.redis.url else None
    ext_pw = split_redis_url(dcfg.redis.url)[2] if dcfg.redis.url else None
    pw = cfg.redis.password or ext_pw or url_pw or old.get("redis-password")
    token = cfg.inference.api_key or old.get("api-token")
    return DeploySecrets(
        redis_password=pw or secrets.token_urlsafe(32),
        api_token=token or secrets.token_urlsafe(32),
    )


def _read_previous(out_dir: Path) -> dict[str, str]:
    found: dict[str, str] = {}
    for key in SECRET_KEYS:
        f = out_dir / "secrets" / key
        if f.is_file():
            found[key] = f.read_text().strip()
    return found


def prepare(
    cfg: ExperimentConfig, plan: Plan, dcfg: DeployConfig, target: str, out_dir: Path
) -> Deployment:
    """Check, then resolve: the one entry both renderers start from."""
    refuse_mixed_trainer(plan, target, dcfg)
    layout = build_layout(cfg, plan)
    check_plan(cfg, plan, dcfg, target, layout)
    prefix = object_prefix(run_id(cfg, plan), dcfg.name)
    urls = server_urls(layout, prefix, target)
    tasks = task_urls(layout, prefix, target)
    resolved = resolve_config(cfg, plan, dcfg, prefix, target, urls, tasks)
    layout = build_layout(resolved, plan)
    secrets_ = load_secrets(cfg, dcfg, out_dir)
    prediction = prediction_for_plan(plan, resolved)
    return Deployment(resolved, plan, layout, dcfg, prefix, secrets_, cfg.model, prediction)


def on_trainer_gpus(cfg: ExperimentConfig, layout: Layout) -> set[str]:
    """The services whose GPUs are the trainer's (counted once, with the trainer's):
    every inference server colocated, the lent ones hybrid."""
    from hexctl.job.cores import lent_services

    if cfg.workflow.placement == "colocated":
        return {s.name for s in layout.by_role("inference")}
    return lent_services(cfg, layout)
