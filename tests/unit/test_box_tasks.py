"""A workflow's server tasks on a box, and `bench tasks`'s pair of plans: the planner's
choice of kind for the reference against the same job with it kept on the actor's kind."""

from __future__ import annotations

from pathlib import Path

import pytest

from areal_hex.config.workflow import TaskSpec
from areal_hex.errors import UsageError
from tests.unit.test_box_inventory import _plan, _state

ROOT = Path(__file__).resolve().parents[2]


def _with_task(trainer: str, rollout: list[str], node: str, task: str = "reference"):
    plan = _plan([trainer], rollout)
    plan.decisions = plan.decisions.model_validate(
        {"tasks": [{"task": task, "gpu_kind": node.split("-")[0],
                    "slots": [{"node": node, "gpu_ids": [0]}]}]}
    )  # fmt: skip
    return plan


def on_box(tmp_path: Path, example: str, plan) -> tuple:
    """`example` run on the box `inv` with `plan`: its config (the box's addresses in it)
    and each process as the box starts it."""
    from areal_hex.config import load_config
    from hexctl.box.place import place_on_box
    from hexctl.box.run_config import apply_box
    from hexctl.job.layout import build_layout
    from hexctl.launch.run import process_specs

    overrides = ["run.box=inv", "run.run_id=r", f"run.output_dir={tmp_path}"]
    cfg = load_config(ROOT / example, overrides)
    apply_box(cfg, plan)
    layout = build_layout(cfg, plan)
    specs = {s.name: s for s in process_specs(cfg, layout, tmp_path / "config.yaml")}
    place_on_box(cfg, layout, list(specs.values()))
    return cfg, specs


def test_a_reference_task_serves_from_its_planned_node(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its URL is its node's address (the controller on the spine reaches it there), and
    its server starts in that node, bound to that address with the kind's batch and
    threads."""
    state = _state(tmp_path, monkeypatch)
    plan = _with_task("mem-0", ["mem-1"], "fast-1")
    cfg, specs = on_box(tmp_path, "examples/box/tiny_box_ref.yaml", plan)
    fast1 = state.node("fast-1")
    ref = cfg.workflow.task_with_role("reference")
    assert ref is not None and ref.instance_urls() == [f"http://{fast1.address}:31100"]
    cmd = specs["reference-0"].command
    assert cmd[5] == fast1.netns and cmd[:5] == ["sh", "-c", cmd[2], "sh", fast1.cgroup]
    at = cmd.index("serve") + 2
    assert cmd[at : at + 3] == [
        f"inference.host={fast1.address}",
        "inference.max_running_requests=4",
        "inference.num_threads=1",
    ]
    assert cmd[-2:] == ["--port", "31100"]
    assert specs["reference-0"].env["OMP_NUM_THREADS"] == "1"


def test_a_task_on_a_node_the_box_lacks_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from areal_hex.config import load_config
    from hexctl.box.run_config import box_state

    _state(tmp_path, monkeypatch)
    cfg = load_config(ROOT / "examples/box/tiny_box_ref.yaml", ["run.box=inv"])
    with pytest.raises(UsageError, match="no node 'fast-7'"):
        box_state(cfg, _with_task("mem-0", ["mem-1"], "fast-7"))


def _inputs():
    from hexctl.bench.system.hetero import plan_inputs
    from hexctl.job.predict import LocalProfileFiles

    cl, m, w, prof = plan_inputs(LocalProfileFiles(ROOT / "tests/data/box_thin_profile"))
    ref = TaskSpec(name="reference", role="reference", command=["x"], port=31100, gpus=1)
    return cl, m, w.model_copy(update={"tasks": [ref]}), prof


def test_plan_b_keeps_the_reference_on_the_actors_kind() -> None:
    """On the thin box's profile at $5/h the planner trains and generates on mem and
    scores on fast (mem's prefill would bind the plan); b is the same job with the
    reference on mem, slower by the prefill rates' ratio."""
    from hexctl.bench.system.tasks import plan_pair, summarise_pair, task_kinds

    cl, m, w, prof = _inputs()
    plans = plan_pair(cl, m, w, prof, 5.0, "tiny")
    a, b = plans["a"], plans["b"]
    assert a.trainer.gpu_kind == "mem" and task_kinds(a) == {"reference": "fast"}
    assert task_kinds(b) == {"reference": "mem"}
    ref_b = b.decisions.task("reference")
    assert ref_b is not None and ref_b.slots[0].node not in {
        *(i.placement.node for i in b.rollout),
        b.trainer.placements[0].node,
    }
    rates = prof.prefill_tokens_per_s("fast") / prof.prefill_tokens_per_s("mem")
    ref_a = a.decisions.task("reference")
    assert ref_a is not None and ref_b.predicted_samples_per_s is not None
    assert ref_a.predicted_samples_per_s / ref_b.predicted_samples_per_s == pytest.approx(rates)
    assert b.predicted.samples_per_s == pytest.approx(ref_b.predicted_samples_per_s, rel=1e-3)
    assert a.predicted.samples_per_s > b.predicted.samples_per_s
    block = lambda p, m: {"predicted": {"pipeline_samples_per_s": p},  # noqa: E731
                          "measured": {"pipeline_samples_per_s": m}}  # fmt: skip
    runs = {"a": {"block": block(60.0, 50.0), "wall_s": 1.0},
            "b": {"block": block(40.0, 44.0), "wall_s": 1.0}}  # fmt: skip
    out = summarise_pair(runs, plans)
    assert out["a/b"]["predicted"] == 1.5 and out["a/b"]["measured"] == pytest.approx(1.1364)
    assert out["plans"]["a"]["error"] == 0.2 and out["within_15pct"] is False
    assert out["plans"]["a"]["tasks"]["reference"]["kind"] == "fast"


def test_a_job_without_a_priced_task_or_without_a_choice_is_refused() -> None:
    """At $4/h all runs on mem: no choice. At $8/h the planner trains and scores on fast
    and generates on mem: b keeps the reference beside the actor's generation."""
    from hexctl.bench.system.tasks import actor_kinds, plan_pair, task_kinds

    cl, m, w, prof = _inputs()
    plans = plan_pair(cl, m, w, prof, 8.0, "tiny")
    assert actor_kinds(plans["a"]) == ["fast", "mem"]
    assert task_kinds(plans["a"]) == {"reference": "fast"}
    assert task_kinds(plans["b"]) == {"reference": "mem"}
    with pytest.raises(UsageError, match="no reference or reward_model task"):
        plan_pair(cl, m, w.model_copy(update={"tasks": []}), prof, 5.0, "tiny")
    with pytest.raises(UsageError, match="already keeps every priced task"):
        plan_pair(cl, m, w, prof, 4.0, "tiny")


def test_a_profile_of_a_reference_task_job_trains_on_records_with_ref_logprobs() -> None:
    """With a reference task the records carry π_ref log-probs (the profile's training
    step then has them for its KL term) and the trainer holds no reference model, so the
    planner's workload charges it none."""
    from areal_hex.config import load_config
    from hexctl.profile.generation import GenerationRates
    from hexctl.profile.local import workload_for
    from trainer_service.synthetic import synthetic_groups

    groups = synthetic_groups(2, 3, 50, completion_len=(2, 5), with_ref=True)
    for c in (c for g in groups for c in g.completions):
        assert c.ref_logprobs is not None and len(c.ref_logprobs) == len(c.token_ids)
    plain = synthetic_groups(1, 2, 50)
    assert all(c.ref_logprobs is None for c in plain[0].completions)
    gen = GenerationRates({1: 0.01}, 100.0, 30.0, 12.0, 0.1, 0.1, 5.0, 0.01, None, None, 1.0)
    cfg = load_config(ROOT / "examples/box/tiny_box_ref.yaml")
    w = workload_for(cfg, gen)
    assert w["reference_model"] is False and w["tasks"][0]["role"] == "reference"
    cfg.workflow.tasks = []
    assert workload_for(cfg, gen)["reference_model"] is True


def test_a_measured_scoring_rate_prices_the_task_over_the_prefill_rate() -> None:
    """Where a kind's profile has its scoring rate (a group's sequences scored in one
    request), the task's rate is that over the sample's tokens; without it, prefill's."""
    from scheduler.task_costs import instance_rate

    cl, m, w, prof = _inputs()
    ref, g = w.tasks[0], next(g for g in cl.spec.node_groups if g.name == "fast")
    toks = w.prompt_tokens + w.response_tokens
    plain = instance_rate(cl, g, ref, m, m, w, prof)
    assert plain == pytest.approx(prof.prefill_tokens_per_s("fast") / toks)
    fast = prof.kinds["fast"].model_copy(update={"score_tokens_per_s": 9000.0})
    scored = prof.model_copy(update={"kinds": {**prof.kinds, "fast": fast}})
    assert instance_rate(cl, g, ref, m, m, w, scored) == pytest.approx(9000.0 / toks)
    assert scored.at_speed({"fast": 0.5}).kinds["fast"].score_tokens_per_s == 4500.0
