"""Hybrid plans: the lent instances recorded (`decisions.lent`), projected onto the config
(`workflow.placement: hybrid`, `workflow.lent_servers`) and carried by every deploy
render; a hand-written plan whose decisions disagree with its placement is refused with
the field named."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from areal_hex.config import ConfigError, load_config
from areal_hex.config.base import build
from areal_hex.plan import Plan, load_plan, save_plan

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "examples/plans/h800_h20.yaml"  # trainer: all 8 GPUs of h800-0 and h800-1
DEPLOY = ROOT / "examples/deploy/qwen3-8b.yaml"


ONE_NODE = ROOT / "examples/plans/one_node_8gpu.yaml"  # trainer: GPUs 4-7 of node-0


def _hybrid(base: Path = BASE) -> dict:
    """The example plan with one instance lent on the first GPU of each trainer slot."""
    data = load_plan(base).model_dump(mode="json")
    n, like = len(data["rollout"]), data["rollout"][-1]  # of the trainer's kind
    for k, slot in enumerate(data["trainer"]["placements"]):
        lent = {**like, "id": f"rollout-lent-{k}"}
        lent["placement"] = {"node": slot["node"], "gpu_ids": slot["gpu_ids"][:1]}
        data["rollout"].append(lent)
    lent = list(range(n, len(data["rollout"])))
    data["decisions"].update(placement="hybrid", lent=lent, publish_every=1)
    return data


def test_a_hybrid_plan_projects_its_lent_servers() -> None:
    from hexctl.job.plan_config import project_plan

    plan = build(Plan, _hybrid(), "hybrid plan")
    got = project_plan(load_config(DEPLOY), plan, "cluster")
    cfg = got.config
    assert (cfg.workflow.placement, cfg.workflow.lent_servers) == ("hybrid", 2)
    assert cfg.inference.num_servers == len(plan.rollout) and cfg.trainer.publish_every == 1
    assert any(c.startswith("workflow.placement: 'disaggregated' -> 'hybrid'") for c in got.changes)
    local = project_plan(load_config(DEPLOY), plan, "local").config  # `run --plan`
    assert (local.workflow.placement, local.workflow.lent_servers) == ("hybrid", 2)


def _broken(change: str) -> dict:
    data = _hybrid()
    d, n = data["decisions"], len(data["rollout"])
    if change == "lent off the trainer":
        data["rollout"][-1]["placement"] = {"node": "h800-2", "gpu_ids": [5]}
    elif change == "lent not last":
        d["lent"] = [0, n - 1]
    elif change == "none lent":
        d["lent"] = []
    elif change == "k of 2":
        d["publish_every"] = 2
    elif change == "lent, disaggregated":
        d["placement"] = "disaggregated"
    elif change == "colocated with eta 2":
        data["rollout"] = data["rollout"][-2:]
        d.update(placement="colocated", lent=[], max_staleness=2)
    elif change == "colocated off the trainer":
        d.update(placement="colocated", lent=[])
    return data


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ("lent off the trainer", r"decisions\.lent: rollout\[13\] .* GPU 5 of node 'h800-2'"),
        ("lent not last", r"decisions\.lent \[0, 13\] .*expected the indices of the last"),
        ("none lent", r"decisions\.lent \[\] with decisions\.placement hybrid"),
        ("k of 2", r"decisions\.publish_every 2 with decisions\.placement hybrid: expected 1"),
        ("lent, disaggregated", r"decisions\.lent \[12, 13\] with decisions\.placement disagg"),
        ("colocated with eta 2", r"decisions\.max_staleness 2 with decisions\.placement colo"),
        ("colocated off the trainer", r"rollout: rollout\[0\] .* expected it on the trainer's"),
    ],
)
def test_inconsistent_placement_decisions_are_refused(
    change: str, says: str, tmp_path: Path
) -> None:
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(_broken(change)))
    with pytest.raises(ConfigError, match=says):
        load_plan(path)


@pytest.mark.parametrize("target", ["compose", "k8s", "slurm"])
def test_a_hybrid_plan_renders_for_every_target(target: str, tmp_path: Path, capsys) -> None:
    """Every render's config runs hybrid with the plan's lent servers, and the GPUs the
    lent instances share with the trainer are counted once."""
    from hexctl.cli import main

    site = []
    if target == "slurm":
        from hexctl.deploy.slurm_site import load_site

        s = load_site(ROOT / "examples/slurm/site_cluster.yaml")
        s = s.model_copy(update={"shared_dir": str(tmp_path / "shared")})
        (tmp_path / "site.yaml").write_text(yaml.safe_dump(s.model_dump(mode="json")))
        site = ["--site", str(tmp_path / "site.yaml")]
    base = ONE_NODE if target == "compose" else BASE  # compose: one host
    deploy = ROOT / "examples/gsm8k_gpu.yaml" if target == "compose" else DEPLOY
    gpus = {}
    for name, plan in (("base", load_plan(base)), ("hybrid", build(Plan, _hybrid(base), "h"))):
        path = save_plan(plan, tmp_path / f"{name}.yaml")
        out = tmp_path / f"out-{name}"
        args = ["deploy", str(path), str(deploy), "--target", target, "--out", str(out), *site]
        code = main(args)
        said = capsys.readouterr()
        assert code == 0, said.err
        gpus[name] = [line for line in (said.out + said.err).splitlines() if "GPUs:" in line]
    assert gpus["hybrid"] == gpus["base"] and gpus["base"]
    text = "\n".join(p.read_text() for p in out.rglob("*") if p.is_file())
    lent = len(load_plan(base).trainer.placements)
    assert "placement: hybrid" in text and f"lent_servers: {lent}" in text
