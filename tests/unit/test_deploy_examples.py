"""Every shipped example config renders with a matching plan, and every rendered service
passes the checks its own command runs at start (`areal-hex train|rollout|serve`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from areal_hex.config import load_config
from areal_hex.plan import load_plan
from hexctl.cli import build_parser, main
from hexctl.cli.deploy_cmd import check_services
from hexctl.deploy import render
from hexctl.deploy.config import DeployConfig
from hexctl.job.layout import CONFIG_PLACEHOLDER, build_layout

ROOT = Path(__file__).resolve().parents[2]
# example config -> the plan it is deployed with
PAIRS = {
    "examples/gsm8k_gpu.yaml": "examples/plans/one_node_8gpu.yaml",
    "examples/deploy/qwen3-8b.yaml": "examples/plans/h800_h20.yaml",
    "examples/deploy/qwen3-1.7b.yaml": "examples/plans/a100_l40s_l4.yaml",
    "examples/deploy/qwen3-0.6b.yaml": "examples/plans/workstation_l40s_l4.yaml",
}
NOT_DEPLOYED = {
    "examples/tiny_cpu.yaml": "runs on CPU with `areal-hex run`; plans place GPUs",
    "examples/tiny_cpu_ppo.yaml": "tiny_cpu.yaml with PPO, a reference and a reward model: CPU",
    "examples/math500_eval.yaml": "an `areal-hex eval` config, not a training job",
    "examples/deploy/deploy.yaml": "deploy options (DeployConfig), not an experiment",
}


def _one_node(plan_file: str) -> bool:
    plan = load_plan(ROOT / plan_file)
    nodes = {p.node for p in plan.trainer.placements} | {i.placement.node for i in plan.rollout}
    return len(nodes) == 1


def test_every_example_config_is_covered():
    shipped = {
        p.relative_to(ROOT).as_posix()
        for p in [*ROOT.glob("examples/*.yaml"), *ROOT.glob("examples/deploy/*.yaml")]
    }
    assert shipped == set(PAIRS) | set(NOT_DEPLOYED)


CASES = [
    (cfg, plan, target)
    for cfg, plan in PAIRS.items()
    for target in ("k8s", "compose")
    if target == "k8s" or _one_node(plan)
]


@pytest.mark.parametrize(("cfg_file", "plan_file", "target"), CASES)
def test_example_renders_and_every_service_would_start(tmp_path, cfg_file, plan_file, target):
    cfg, plan = load_config(ROOT / cfg_file), load_plan(ROOT / plan_file)
    out = tmp_path / "out"
    render(target, cfg, plan, DeployConfig(), out, check=check_services)
    rendered = out / ("config.yaml" if target == "compose" else "resolved/config.yaml")
    deployed = load_config(rendered)
    layout = build_layout(deployed, plan)
    assert {s.role for s in layout.services} == {"inference", "controller", "trainer"}
    parser = build_parser()
    for svc in layout.services:  # the commands the rendered containers run, on that file
        argv = [a.replace(CONFIG_PLACEHOLDER, str(rendered)) for a in svc.command]
        args = parser.parse_args(argv[1:])
        args.preflight(args)
    assert deployed.trainer.num_ranks * len(plan.trainer.placements) == plan.trainer.world_size
    assert deployed.inference.num_servers == len(plan.rollout)


def test_a_service_that_would_refuse_to_start_stops_the_render(tmp_path, capsys):
    out = tmp_path / "out"
    code = main(
        [
            "deploy",
            str(ROOT / "examples/plans/one_node_8gpu.yaml"),
            str(ROOT / "examples/gsm8k_gpu.yaml"),
            "trainer.checkpoint_every=50",
            "--target",
            "k8s",
            "--out",
            str(out),
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and not out.exists()
    assert "trainer (areal-hex train '{config}'): trainer.checkpoint_every (50) x" in err
    assert "keeps up to (2 x 50 + 1) x 64 = 6464 groups pending" in err
    assert "buffer.max_pending (2048)" in err


def test_check_services_names_each_failing_service(tmp_path):
    plan = load_plan(ROOT / "examples/plans/a100_l40s_l4.yaml")
    cfg = load_config(
        ROOT / "examples/deploy/qwen3-1.7b.yaml",
        ["trainer.checkpoint_every=100", "buffer.max_pending=64"],
    )
    from hexctl.deploy.common import prepare

    errors = check_services(prepare(cfg, plan, DeployConfig(), "k8s", tmp_path))
    assert len(errors) == 1 and errors[0].startswith("trainer (areal-hex train")
    # the same rule `areal-hex train` applies on its own
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text(yaml.safe_dump({"run": {"run_id": "r"}, "redis": {"url": "redis://h"}}))
    args = build_parser().parse_args(
        ["train", str(cfg_file), "trainer.checkpoint_every=100", "buffer.max_pending=64"]
    )
    with pytest.raises(Exception, match=r"keeps up to \(2 x 100 \+ 1\) x 8 = 1608 groups pending"):
        args.preflight(args)
