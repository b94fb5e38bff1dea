"""A plan that does not fit the config is refused, with the mismatch named."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from areal_hex.config import ConfigError, load_config
from areal_hex.plan import load_plan
from hexctl.deploy import render
from hexctl.deploy.common import split_redis_url
from hexctl.deploy.config import DeployConfig
from hexctl.deploy.names import gpu_label_value, normalize_model_name
from hexctl.job.layout import build_layout

ROOT = Path(__file__).resolve().parents[2]
PLAN = ROOT / "examples/plans/a100_l40s_l4.yaml"
CONFIG = ROOT / "examples/deploy/qwen3-1.7b.yaml"


def _refused(tmp_path: Path, overrides=(), plan_edit=None, dcfg=None, target="k8s") -> str:
    plan = load_plan(PLAN)
    if plan_edit is not None:
        plan_edit(plan)
    cfg = load_config(CONFIG, list(overrides))
    with pytest.raises(ConfigError) as exc:
        render(target, cfg, plan, dcfg or DeployConfig(), tmp_path)
    assert not list(tmp_path.iterdir())  # nothing written
    return str(exc.value)


def test_model_mismatch_is_named(tmp_path):
    msg = _refused(tmp_path, ["model.path=Qwen/Qwen3-8B"])
    assert "plan.model is 'Qwen/Qwen3-1.7B' but the config's model.path is 'Qwen/Qwen3-8B'" in msg


def test_tp_set_in_the_config_must_match_the_plan(tmp_path):
    msg = _refused(tmp_path, ["inference.sglang.tp_size=2"])
    want = "plan.rollout[2] (rollout-l4-0): tp=1 but the config sets inference.sglang.tp_size=2"
    assert want in msg
    assert "plan.rollout[5] (rollout-l4-3)" in msg  # every instance, not just the first
    assert "rollout-l40s-0" not in msg  # planned with TP 2: agrees


def test_tp_unset_in_the_config_follows_the_plan_per_instance(tmp_path):
    plan, cfg = load_plan(PLAN), load_config(CONFIG)
    assert "tp_size" not in cfg.inference.sglang.model_fields_set
    render("k8s", cfg, plan, DeployConfig(), tmp_path)
    for i, inst in enumerate(plan.rollout):
        doc = list(yaml.safe_load_all((tmp_path / f"15-inference-{inst.id}.yaml").read_text()))
        c = doc[1]["spec"]["template"]["spec"]["containers"][0]
        tp = [] if inst.tp == 1 else [f"inference.sglang.tp_size={inst.tp}"]
        assert c["args"] == ["areal-hex", "serve", "{config}", *tp, "--index", str(i)]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == str(inst.tp)
    assert {i.tp for i in plan.rollout} == {1, 2}
    # the override is one `areal-hex serve` accepts, and it yields the planned degree
    from hexctl.cli import build_parser, config_from_args

    argv = ["serve", str(CONFIG), "inference.sglang.tp_size=2", "--index", "0"]
    args = build_parser().parse_args(argv)
    assert config_from_args(args).inference.sglang.tp_size == 2 and args.index == 0


def test_unknown_gpu_kind_is_named_and_can_be_mapped(tmp_path):
    def kind(plan):
        plan.rollout[2].gpu_kind = "MI300X"

    def kinds(plan):
        kind(plan)
        plan.trainer.gpu_kind = "Gaudi3"

    msg = _refused(tmp_path, plan_edit=kinds)
    assert "plan.rollout[2] (rollout-l4-0): unknown GPU kind 'MI300X'" in msg
    assert "plan.trainer: unknown GPU kind 'Gaudi3'" in msg
    assert "--gpu-label MI300X=" in msg
    plan = load_plan(PLAN)
    kind(plan)
    dcfg = DeployConfig(gpu_labels={"MI300X": "AMD-MI300X"})
    render("k8s", load_config(CONFIG), plan, dcfg, tmp_path / "ok")
    assert "AMD-MI300X" in (tmp_path / "ok" / "15-inference-rollout-l4-0.yaml").read_text()


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["trainer.zero_stage=3"], "plan.trainer.zero_stage=2 but trainer.zero_stage=3"),
        (["trainer.device=cpu"], "trainer.device is 'cpu' but the plan puts the trainer on 8"),
        (["trainer.launcher=deepspeed"], "over 2 nodes, which needs trainer.launcher=torchrun"),
        (
            ["inference.backend=builtin", "inference.device=cpu"],
            "inference.device is 'cpu' but the plan puts inference on GPUs",
        ),
    ],
)
def test_config_mismatches(tmp_path, overrides, needle):
    assert needle in _refused(tmp_path, overrides)


def test_inconsistent_plans(tmp_path):
    def double_book(plan):
        plan.rollout[1].placement.gpu_ids = [0]

    assert "GPU 0 of node l40s-0 is planned for rollout-l40s-0 and rollout-l40s-1" in _refused(
        tmp_path, plan_edit=double_book
    )

    def bad_world(plan):
        plan.trainer.world_size = 12
        plan.trainer.dp = 12

    msg = _refused(tmp_path, plan_edit=bad_world)
    assert "placements hold 8 GPUs but world_size=12" in msg

    def uneven(plan):
        plan.trainer.placements[1].gpu_ids = [0, 1]
        plan.trainer.world_size = plan.trainer.dp = 6

    assert "same number of ranks, got [4, 2]" in _refused(tmp_path, plan_edit=uneven)

    def tp_slots(plan):
        plan.rollout[0].tp = 4

    assert "tp=4 but placement lists 2 GPUs" in _refused(tmp_path, plan_edit=tp_slots)


def test_external_redis_needs_a_url(tmp_path):
    dcfg = DeployConfig.model_validate({"redis": {"mode": "external"}})
    assert "redis.mode is external but no URL is set" in _refused(tmp_path, dcfg=dcfg)


def test_layout_carries_planned_nodes():
    plan = load_plan(PLAN)
    layout = build_layout(load_config(CONFIG), plan)
    trainer = layout.by_role("trainer")[0]
    assert trainer.node_names == ["a100-0", "a100-1"] and trainer.nodes == 2
    assert [s.node_names for s in layout.by_role("inference")][4] == ["l4-0"]


@pytest.mark.parametrize(
    "name", ["Qwen/Qwen3-8B", "/data/models/qwen3_8b/", "qwen3-8b", "QWEN3.8B"]
)
def test_model_names_normalize(name):
    assert normalize_model_name(name) == "qwen38b"


def test_model_names_differ():
    assert normalize_model_name("Qwen/Qwen3-8B") != normalize_model_name("Qwen/Qwen3-1.7B")


def test_split_redis_url():
    assert split_redis_url("redis://u:p%40ss@h:6380/1") == ("redis://h:6380/1", "u", "p@ss")
    assert split_redis_url("redis://h:6379/0") == ("redis://h:6379/0", None, None)


def test_gpu_label_lookup():
    assert gpu_label_value("h20", DeployConfig()) == "NVIDIA-H20"
    assert gpu_label_value("a100_80gb", DeployConfig()) == "NVIDIA-A100-SXM4-80GB"
    assert gpu_label_value("TPUv5", DeployConfig()) is None
    assert gpu_label_value("A100-80GB", DeployConfig(gpu_label_key="pool")) == "a100-80gb"


def test_object_names_start_with_a_letter(tmp_path):
    plan = load_plan(PLAN)
    render("k8s", load_config(CONFIG, ["run.name=7b-run"]), plan, DeployConfig(), tmp_path)
    text = (tmp_path / "20-controller.yaml").read_text()
    # not a DNS-1035 label as it is: its slug, then a hash of the run id itself
    assert re.search(r"name: ah-7b-run-[0-9a-f]{8}-[0-9a-f]{8}-controller\n", text)


def test_example_deploy_config_renders(tmp_path):
    import argparse

    from hexctl.cli.deploy_cmd import deploy_config

    args = argparse.Namespace(
        deploy_config=ROOT / "examples/deploy/deploy.yaml",
        namespace=None,
        existing_secret=None,
        trainer_gang=None,
        kueue_queue=None,
        create_namespace=False,
        priority_class=None,
        node=[],
        gpu_label_key=None,
        storage_class=None,
        redis_url=None,
        gpu_label=["L4=NVIDIA-L4-24GB"],
        image_tag="0.2.0",
    )
    dcfg = deploy_config(args)
    assert dcfg.namespace == "rl-demo" and dcfg.storage.storage_class == "cephfs"
    assert dcfg.images.trainer == "registry.example.com/areal-hex/trainer:0.2.0"
    assert dcfg.images.redis == "docker.io/library/redis:7.4.2-alpine"  # only areal-hex images
    render("k8s", load_config(CONFIG), load_plan(PLAN), dcfg, tmp_path)
    trainer = (tmp_path / "30-trainer.yaml").read_text()
    assert "nvidia.com/gpu.product: NVIDIA-A100-PCIE-80GB" in trainer
    assert "NVIDIA-L4-24GB" in (tmp_path / "15-inference-rollout-l4-0.yaml").read_text()


@pytest.mark.parametrize(
    ("image", "want"),
    [
        ("areal-hex/cpu:0.1.0", "areal-hex/cpu:9"),
        ("registry:5000/areal-hex/cpu", "registry:5000/areal-hex/cpu:9"),
        ("registry:5000/areal-hex/cpu:0.1.0", "registry:5000/areal-hex/cpu:9"),
        ("areal-hex/cpu@sha256:abc", "areal-hex/cpu:9"),
    ],
)
def test_image_tag_replacement(image, want):
    from hexctl.cli.deploy_cmd import with_tag

    assert with_tag(image, "9") == want
