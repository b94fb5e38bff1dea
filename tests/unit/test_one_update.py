"""One update for every server: each pause is the slowest copy's
(`scheduler/sync_cost.py` `one_update`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hexctl.box.profile import inventory
from scheduler.cluster import ClusterSpec, make_cluster
from tests.unit.test_box_inventory import FIGURES, _box


def test_every_server_pauses_until_the_slowest_has_its_copy(tmp_path: Path) -> None:
    """One controller pauses its servers, has each take its copy and resumes them all
    once the last has it: a server beside the trainer pauses as long as one behind a
    thin uplink. So, where generation binds, a second server behind rack b's 16 Mbit/s
    uplink makes the pipeline slower than the near server alone (priced one by one, it
    added a little), in the run's prediction and in the planner's cost of the placement."""
    from scheduler.model_shape import ModelShape
    from scheduler.partition import Placement, evaluate, sync_on_topology
    from scheduler.predict import LayoutNodes, TrainerLayout, _rollouts, predict_layout
    from scheduler.sync_cost import one_update
    from scheduler.trainers import cost_trainer
    from scheduler.workload import load_workload

    assert one_update([0.1, 0.4, 0.2]) == [0.4, 0.4, 0.4] and one_update([]) == []
    root = Path(__file__).resolve().parents[2]
    fast = {**FIGURES, "bf16_tflops": 1.0}  # a trainer well ahead of the servers
    cl = make_cluster(
        ClusterSpec.model_validate(
            inventory(_box(tmp_path), {"fast": fast, "mem": FIGURES}, reload_ms=20.0)
        )
    )
    m = ModelShape("tiny", 2, 64, 4, 2, 16, 128, 2000, True)  # 0.2 M parameters
    w = load_workload(root / "examples/workloads/math_grpo.yaml").model_copy(
        update={"weight_sync": "network", "groups_per_step": 8, "group_size": 8}
    )
    w = w.model_copy(update={"prompt_tokens": 34, "response_tokens": 16, "max_response_tokens": 24})
    both = LayoutNodes("fast-0", ("mem-2", "mem-1"))
    near, far = sync_on_topology(cl, m, w, both.writer, list(both.rollout))
    assert far > 5 * near
    trainer = TrainerLayout((("fast", 1),), 1)

    def rates(nodes: LayoutNodes):
        kinds = [("mem", 1)] * len(nodes.rollout)
        return predict_layout(cl, m, w, None, kinds, trainer, nodes=nodes).asynchronous

    two, one = rates(both), rates(LayoutNodes("fast-0", ("mem-2",)))
    assert two.training_samples_per_s > 2 * two.pipeline_samples_per_s  # generation binds
    assert two.pipeline_samples_per_s < 0.9 * one.pipeline_samples_per_s
    tr = cost_trainer(cl, m, w, trainer.parts, trainer.per_node, None)
    assert tr is not None
    opts = _rollouts(cl, m, w, None, [("mem", 1), ("mem", 1)])
    pl = Placement(
        [("fast-0", [0])], [(o, n, [0]) for o, n in zip(opts, both.rollout, strict=True)]
    )
    cost = evaluate(cl, m, w, tr, pl)
    assert cost.sync_s == pytest.approx([far, far])
    assert cost.busy_sync_s[0] == cost.busy_sync_s[1]
