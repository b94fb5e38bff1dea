"""What both deploy targets share: plan/config checks, the resolved in-cluster config,
secrets, names and the GPU-kind → node-label table.

The rendered objects come from `areal_hex.layout.build_layout(cfg, plan)`, the same
layout `areal-hex run` starts locally, so both run one system.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote, urlsplit, urlunsplit

import yaml

from areal_hex.config import ConfigError, ExperimentConfig, ModelConfig, dump_yaml
from areal_hex.config.deploy import DeployConfig, NodeMatch
from areal_hex.deploy.output import SECRETS
from areal_hex.layout import CONFIG_PLACEHOLDER, Layout, ServiceSpec, build_layout
from areal_hex.plan import Plan

# Value of `nvidia.com/gpu.product` (set by NVIDIA GPU feature discovery) per planner GPU
# kind. Extend or override with `gpu_labels` in the deploy config.
GPU_PRODUCT_LABELS: dict[str, str] = {
    "H100": "NVIDIA-H100-80GB-HBM3",
    "H200": "NVIDIA-H200",
    "H800": "NVIDIA-H800",
    "H20": "NVIDIA-H20",
    "A100-40GB": "NVIDIA-A100-SXM4-40GB",
    "A100-80GB": "NVIDIA-A100-SXM4-80GB",
    "A10": "NVIDIA-A10",
    "A10G": "NVIDIA-A10G",
    "L40S": "NVIDIA-L40S",
    "L4": "NVIDIA-L4",
    "RTX4090": "NVIDIA-GeForce-RTX-4090",
}
DEFAULT_GPU_LABEL_KEY = "nvidia.com/gpu.product"
CONFIG_DIR = "/etc/areal-hex"  # the ConfigMap (config.yaml, plan.yaml)
SECRETS_DIR = "/run/secrets/areal-hex"  # the Secret's files (k8s); compose: /run/secrets
RUNTIME_CONFIG = "/tmp/areal-hex/config.yaml"  # config + secrets, written by deploy.entry


SGLANG_CONFIG = "/tmp/areal-hex/sglang.yaml"  # SGLang's --config file with its API key


def entry_argv(secrets_dir: str, sglang: bool = False) -> list[str]:
    """The secret-injecting wrapper every container starts through; the service's layout
    command follows after `--`. Only where the secrets are mounted differs by target. An
    SGLang server gets its API key in a config file, never on its command line."""
    argv = [
        "python3", "-m", "areal_hex.deploy.entry",
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

    def prepare_command(self) -> list[str]:
        """Writes v0 = the experiment's model into the run's weights directory."""
        cmd = ["python3", "-m", "areal_hex.deploy.prepare", CONFIG_PLACEHOLDER]
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
    `start` is the command that starts the job, `{out}` standing for the folder."""

    files: dict[str, str]
    private: set[str] = field(default_factory=set)
    start: str = ""


def resolved_files(d: Deployment, folder: str) -> dict[str, str]:
    """Plain copies of the config the services load and of the plan."""
    plan_yaml = yaml.safe_dump(d.plan.model_dump(mode="json"), sort_keys=False)
    return {f"{folder}config.yaml": dump_yaml(d.cfg), f"{folder}plan.yaml": plan_yaml}


def secret_files(d: Deployment) -> dict[str, str]:
    return {f"{SECRETS}/{k}": v + "\n" for k, v in d.secrets.as_dict().items()}


def slug(text: str, max_len: int = 40) -> str:
    """A DNS-1123 label from any text: lowercase, [a-z0-9-], no leading/trailing '-'."""
    s = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")
    return s[:max_len].strip("-") or "x"


def normalize_model_name(name: str) -> str:
    """`Qwen/Qwen3-8B`, `/data/models/qwen3_8b/` and `qwen3-8b` all give `qwen38b`."""
    last = name.rstrip("/").split("/")[-1]
    return re.sub(r"[^a-z0-9]", "", last.lower())


def gpu_label_value(kind: str, dcfg: DeployConfig) -> str | None:
    """The node-label value that marks nodes of `kind`; None when unknown."""
    want = _kind_key(kind)
    for k, v in dcfg.gpu_labels.items():
        if _kind_key(k) == want:
            return v
    if dcfg.gpu_label_key != DEFAULT_GPU_LABEL_KEY:
        return slug(kind, 63)  # a custom key such as areal-hex/gpu-kind holds the kind itself
    for k, v in GPU_PRODUCT_LABELS.items():
        if _kind_key(k) == want:
            return v
    return None


def _kind_key(kind: str) -> str:
    """`A100-80GB`, `a100_80gb` and `A100 80GB` name one kind."""
    return re.sub(r"[^a-z0-9]", "", kind.lower())


def service_name(prefix: str, svc: ServiceSpec) -> str:
    return f"{prefix}-{slug(svc.name, 62 - len(prefix))}"


# ---------------------------------------------------------------- checks


MIXED_TRAINER_TARGETS = ("k8s", "slurm")  # render a trainer across GPU kinds


def refuse_mixed_trainer(plan: Plan, target: str, dcfg: DeployConfig | None = None) -> None:
    """A trainer across GPU kinds needs every rank on a machine of the kind its
    `rank_speeds` entry assumes. Kubernetes renders it as one JobSet with a replicated job
    per kind (`k8s_trainer.kind_segments`), Slurm as one heterogeneous-job component per
    kind; compose (one host) and a Slurm site without heterogeneous jobs (one
    allocation) cannot, and refuse it rather than share a step wrongly."""
    t = plan.trainer
    if not t.mixed:
        return
    kinds = " + ".join(t.kinds)
    if target == "slurm-one-allocation":
        raise ConfigError(
            f"plan.trainer.gpu_kinds: the trainer spans GPU kinds {kinds} (heterogeneous "
            "data parallelism), which needs one job component per kind, but the site file "
            "sets `hetjob: false` (one allocation for every service); set `hetjob: true`, "
            "or plan again with `areal-hex plan --one-kind-trainer`"
        )
    if target not in MIXED_TRAINER_TARGETS:
        raise ConfigError(
            f"plan.trainer.gpu_kinds: the trainer spans GPU kinds {kinds} "
            f"(heterogeneous data parallelism), but --target {target} renders a trainer of "
            f"one GPU kind only; deploy it with --target k8s or --target slurm, run it with "
            f"`areal-hex run --plan`, or plan again with `areal-hex plan --one-kind-trainer`"
        )
    if dcfg is not None and dcfg.trainer.gang != "jobset":
        raise ConfigError(
            f"trainer.gang: the plan's trainer spans GPU kinds {' + '.join(t.kinds)}, "
            f"rendered as one JobSet with a replicated job per kind; got "
            f"{dcfg.trainer.gang!r}, expected 'jobset'"
        )


def check_plan(
    cfg: ExperimentConfig, plan: Plan, dcfg: DeployConfig, target: str, layout: Layout
) -> None:
    """Refuse a plan that does not fit the config; every problem is named at once."""
    errors = [
        *_check_model(cfg, plan),
        *_check_inference(cfg, plan, dcfg),
        *_check_trainer(cfg, plan, dcfg),
        *_check_devices(plan),
        *_check_placement(plan, dcfg),
    ]
    if target == "compose":
        nodes = sorted({n for s in layout.services for n in s.node_names})
        if len(nodes) > 1:
            errors.append(
                f"target compose runs every service on one host, but the plan uses "
                f"{len(nodes)} nodes ({', '.join(nodes)}); use --target k8s or a one-node plan"
            )
    redis_url = dcfg.redis.url or cfg.redis.url
    if dcfg.redis.mode == "external" and redis_url is None:
        errors.append("redis.mode is external but no URL is set (deploy redis.url or redis.url)")
    if errors:
        raise ConfigError("plan does not match the config:\n  " + "\n  ".join(errors))


def _check_model(cfg: ExperimentConfig, plan: Plan) -> list[str]:
    have = cfg.model.path or ("tiny" if cfg.model.tiny is not None else None)
    if have is None:
        return ["model.path is not set (the plan was made for model " + repr(plan.model) + ")"]
    if normalize_model_name(have) != normalize_model_name(plan.model):
        return [f"plan.model is {plan.model!r} but the config's model.path is {have!r}"]
    return []


def _check_inference(cfg: ExperimentConfig, plan: Plan, dcfg: DeployConfig) -> list[str]:
    errors: list[str] = []
    inf = cfg.inference
    if not plan.rollout:
        errors.append("plan.rollout is empty: the plan has no inference instances")
    seen: set[str] = set()
    pinned_tp = "tp_size" in inf.sglang.model_fields_set
    for i, inst in enumerate(plan.rollout):
        where = f"plan.rollout[{i}] ({inst.id})"
        if slug(inst.id) in seen:
            errors.append(f"{where}: instance id repeats another one")
        seen.add(slug(inst.id))
        if gpu_label_value(inst.gpu_kind, dcfg) is None:
            errors.append(_unknown_kind(where, inst.gpu_kind, dcfg))
        if len(inst.placement.gpu_ids) != inst.tp:
            errors.append(
                f"{where}: tp={inst.tp} but placement lists {len(inst.placement.gpu_ids)} GPUs"
            )
        # An unset tp_size takes the plan's degree per instance (a serve override, see
        # layout.py); one the config sets explicitly must agree with the plan.
        if inf.backend == "sglang" and pinned_tp and inst.tp != inf.sglang.tp_size:
            errors.append(
                f"{where}: tp={inst.tp} but the config sets inference.sglang.tp_size="
                f"{inf.sglang.tp_size} (remove it to take the plan's TP per instance)"
            )
        if inf.backend == "builtin" and inst.tp != 1:
            errors.append(f"{where}: tp={inst.tp} but the builtin engine serves on one GPU")
    if inf.backend == "builtin" and inf.device == "cpu":
        errors.append(
            "inference.device is 'cpu' but the plan puts inference on GPUs (expected 'cuda')"
        )
    return errors


def _check_trainer(cfg: ExperimentConfig, plan: Plan, dcfg: DeployConfig) -> list[str]:
    t, tc = plan.trainer, cfg.trainer
    errors: list[str] = []
    ngpus = sum(len(p.gpu_ids) for p in t.placements)
    for kind in t.kinds:  # each kind of a trainer across kinds, or its one kind
        if gpu_label_value(kind, dcfg) is None:
            errors.append(_unknown_kind("plan.trainer", kind, dcfg))
    if not t.placements:
        errors.append("plan.trainer.placements is empty")
    if t.dp * t.tp != t.world_size:
        errors.append(f"plan.trainer: dp={t.dp} x tp={t.tp} != world_size={t.world_size}")
    if ngpus != t.world_size:
        errors.append(f"plan.trainer: placements hold {ngpus} GPUs but world_size={t.world_size}")
    if t.tp != 1:
        errors.append(f"plan.trainer.tp={t.tp} but the DeepSpeed trainer runs pure data parallel")
    if t.zero_stage != tc.zero_stage:
        errors.append(
            f"plan.trainer.zero_stage={t.zero_stage} but trainer.zero_stage={tc.zero_stage}"
        )
    if tc.device != "cuda":
        errors.append(
            f"trainer.device is {tc.device!r} but the plan puts the trainer on {ngpus} "
            f"{t.gpu_kind} GPUs (expected 'cuda')"
        )
    counts = {len(p.gpu_ids) for p in t.placements}
    if len(counts) > 1:
        errors.append(
            f"plan.trainer: every node must hold the same number of ranks, got "
            f"{[len(p.gpu_ids) for p in t.placements]}"
        )
    if len(t.placements) > 1 and tc.launcher != "torchrun":
        errors.append(
            f"the plan spreads the trainer over {len(t.placements)} nodes, which needs "
            f"trainer.launcher=torchrun (static rendezvous from the pod environment); got "
            f"{tc.launcher!r}"
        )
    if len({p.node for p in t.placements}) != len(t.placements):
        errors.append("plan.trainer.placements name a node twice")
    if tc.resume != "auto":
        errors.append(
            f"trainer.resume is {tc.resume!r}: a restarted trainer must continue from its "
            "newest checkpoint on the shared volume (expected 'auto')"
        )
    mount = dcfg.storage.mount_path.rstrip("/") + "/"
    if tc.checkpoint_dir is not None and not tc.checkpoint_dir.startswith(mount):
        errors.append(
            f"trainer.checkpoint_dir {tc.checkpoint_dir!r} is not on the shared volume "
            f"({mount}): a restarted rank would not find it (leave it unset)"
        )
    return errors


def _check_placement(plan: Plan, dcfg: DeployConfig) -> list[str]:
    """A placement maps every plan node, and only those."""
    if not dcfg.placement:
        return []
    planned = {i.placement.node for i in plan.rollout} | {p.node for p in plan.trainer.placements}
    errors = []
    missing = sorted(planned - set(dcfg.placement))
    unknown = sorted(set(dcfg.placement) - planned)
    if missing:
        errors.append(
            f"placement maps no Kubernetes node for plan node(s) {', '.join(missing)} "
            f"(expected one entry per plan node: {', '.join(sorted(planned))})"
        )
    if unknown:
        errors.append(
            f"placement names {', '.join(unknown)}, which the plan does not use "
            f"(plan nodes: {', '.join(sorted(planned))})"
        )
    return errors


def node_match(dcfg: DeployConfig, plan_node: str) -> NodeMatch | None:
    """The Kubernetes node(s) standing for `plan_node`, or None when not mapped."""
    if plan_node in dcfg.placement:
        return dcfg.placement[plan_node]
    if dcfg.pin_nodes:
        return NodeMatch(hostname=plan_node)
    return None


def _check_devices(plan: Plan) -> list[str]:
    """No GPU may be planned twice."""
    owner: dict[tuple[str, int], str] = {}
    errors: list[str] = []
    slots = [(i.id, i.placement) for i in plan.rollout]
    slots += [("trainer", p) for p in plan.trainer.placements]
    for who, slot in slots:
        for g in slot.gpu_ids:
            key = (slot.node, g)
            if key in owner:
                errors.append(f"GPU {g} of node {slot.node} is planned for {owner[key]} and {who}")
            owner[key] = who
    return errors


def _unknown_kind(where: str, kind: str, dcfg: DeployConfig) -> str:
    known = sorted({*GPU_PRODUCT_LABELS, *dcfg.gpu_labels})
    return (
        f"{where}: unknown GPU kind {kind!r} (known: {', '.join(known)}; map it with "
        f"gpu_labels in the deploy config or --gpu-label {kind}=<{dcfg.gpu_label_key} value>)"
    )


# ---------------------------------------------------------------- resolution


def run_id(cfg: ExperimentConfig, plan: Plan) -> str:
    """The config's run_id, or run.name plus a short hash of the plan and the config
    (secrets aside): re-rendering the same job keeps its id, any change makes a new run
    (its own objects, run directory and buffer keys)."""
    if cfg.run.run_id:
        return cfg.run.run_id
    config = cfg.model_dump(mode="json", exclude={"redis": {"password"}, "inference": {"api_key"}})
    both = json.dumps([plan.model_dump(mode="json"), config], sort_keys=True)
    return f"{slug(cfg.run.name, 40)}-{_short_hash(both)}"


def _short_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:8]


def object_prefix(rid: str, name: str | None = None) -> str:
    """The prefix of every object name: it carries the run id, so two runs in one
    namespace never share a name. `name` (the deploy config's) replaces the readable
    part; a long run id keeps its head and a hash of the whole."""
    s = slug(rid, 63)
    if name is not None:
        s = f"{name}-{_short_hash(rid)}"
    elif len(s) > 30:
        s = f"{s[:21].strip('-')}-{_short_hash(rid)}"
    if not s[0].isalpha():  # Service names must start with a letter (RFC 1035)
        s = slug(f"ah-{s}", 33)
    return s


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


def resolve_config(
    cfg: ExperimentConfig,
    plan: Plan,
    dcfg: DeployConfig,
    prefix: str,
    target: str,
    server_urls: list[str],
) -> ExperimentConfig:
    """The config every deployed service loads: run dir on the shared volume, Redis at its
    service address, sizes from the plan; passwords and tokens removed (they reach the
    processes from the Secret at start, see `areal_hex.deploy.entry`)."""
    data = cfg.model_dump(mode="json")
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
        num_servers=len(plan.rollout),
        api_key=None,
        host="0.0.0.0",
        weights_dir=f"{dcfg.storage.mount_path}/runs/{rid}/weights",
    )
    inf["server_urls"] = server_urls  # the controller reaches server i there
    # num_ranks is per node (the launcher on each node starts that many ranks).
    t = plan.trainer
    data["trainer"].update(num_ranks=t.world_size // max(1, len(t.placements)))
    if t.rank_speeds is not None:  # across GPU kinds: each rank's share of a step
        data["trainer"]["rank_speeds"] = list(t.rank_speeds)
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
    resolved = resolve_config(cfg, plan, dcfg, prefix, target, urls)
    layout = build_layout(resolved, plan)
    secrets_ = load_secrets(cfg, dcfg, out_dir)
    return Deployment(resolved, plan, layout, dcfg, prefix, secrets_, cfg.model)
