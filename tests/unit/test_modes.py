"""Execution modes: `workflow.placement` colocated beside disaggregated, the combinations
the config accepts, and a colocated plan's shared devices."""

from __future__ import annotations

from pathlib import Path

import pytest

from areal_hex.config import ConfigError, load_config
from areal_hex.plan import Decisions, Plan, load_plan

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples/tiny_cpu.yaml"


def test_colocated_runs_synchronously() -> None:
    cfg = load_config(TINY, ["workflow.placement=colocated", "run.mode=sync"])
    assert cfg.workflow.placement == "colocated"
    assert (cfg.buffer.max_staleness, cfg.trainer.publish_every) == (0, 1)


def test_colocated_async_is_refused_with_the_fix() -> None:
    with pytest.raises(ConfigError, match=r"workflow.placement colocated with run.mode async"):
        load_config(TINY, ["workflow.placement=colocated"])
    with pytest.raises(ConfigError, match="expected one of|Input should be"):
        load_config(TINY, ["workflow.placement=hybrid"])


def _sharing(placement: str) -> dict:
    """A plan whose first generation instance sits on the trainer's first GPU."""
    plan = load_plan(ROOT / "examples/plans/local_cpu.yaml")
    data = plan.model_dump(mode="json")
    data["rollout"][0]["placement"] = data["trainer"]["placements"][0] | {
        "gpu_ids": data["trainer"]["placements"][0]["gpu_ids"][:1]
    }
    data["decisions"]["placement"] = placement
    return data


def test_a_colocated_plan_shares_the_trainers_gpus() -> None:
    with pytest.raises(ValueError, match=r"placed for both 'rollout\[0\]"):
        Plan.model_validate(_sharing("disaggregated"))
    plan = Plan.model_validate(_sharing("colocated"))
    assert plan.decisions.placement == "colocated"
    # still one slot per GPU within a side: two instances on one GPU are refused
    data = _sharing("colocated")
    data["rollout"].append(data["rollout"][0] | {"id": "rollout-cpu-1"})
    with pytest.raises(ValueError, match=r"placed for both 'rollout\[0\].*'rollout\[1\]"):
        Plan.model_validate(data)
    assert Decisions(placement="colocated").placement == "colocated"
