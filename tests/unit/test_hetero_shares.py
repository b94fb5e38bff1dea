"""Heterogeneous data parallelism: shares in proportion to rank speed, and the same
gradient as one rank on the whole batch (global token counts)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from fakes import PlainEngine

from areal_hex.config import AlgoConfig, ModelConfig, TinyModelConfig
from trainer_service.batching import assign_to_ranks
from trainer_service.step import (
    StepContext,
    _accumulate,
    _prepare,
)


def test_equal_speeds_keep_equal_token_loads() -> None:
    lengths = [50, 40, 30, 30, 20, 10, 10, 5]
    assert assign_to_ranks(lengths, 2, [1.0, 1.0]) == assign_to_ranks(lengths, 2)
    loads = [sum(lengths[i] for i in s) for s in assign_to_ranks(lengths, 2)]
    assert abs(loads[0] - loads[1]) <= 5


def test_shares_follow_speeds() -> None:
    lengths = [20] * 40  # 800 tokens
    shares = assign_to_ranks(lengths, 3, [3.0, 1.0, 1.0])
    loads = [sum(lengths[i] for i in s) for s in shares]
    assert loads == [480, 160, 160]
    assert sorted(i for s in shares for i in s) == list(range(40))  # each sequence once
    with pytest.raises(ValueError, match="expected one per rank"):
        assign_to_ranks(lengths, 2, [1.0])


def test_emulated_slowdown_is_checked_by_the_config() -> None:
    from pydantic import ValidationError

    from areal_hex.config.trainer import TrainerConfig

    assert TrainerConfig(emulate_slowdown={1: 3.0}).emulate_slowdown == {1: 3.0}
    # ZeRO-2/3 passes hold collectives: stretching them would stretch the waits too
    with pytest.raises(ValidationError, match="expected zero_stage 0 or 1"):
        TrainerConfig(emulate_slowdown={1: 3.0}, zero_stage=2)
    with pytest.raises(ValidationError, match="factor >= 1"):
        TrainerConfig(emulate_slowdown={0: 0.5})
    assert TrainerConfig(zero_stage=3).emulate_slowdown == {}


def _grads(model: Any, groups: list, algo: AlgoConfig, world: int, speeds: list | None) -> dict:
    """Every rank's share run in turn (loss x world, as on DeepSpeed), then / world."""
    model.zero_grad(set_to_none=True)
    sums = dict.fromkeys(
        ("loss", "tokens", "clipped", "dual_clipped", "behav_w", "behav_masked", "entropy", "kl"),
        0.0,
    )
    rows = []
    for rank in range(world):
        # every "rank" accumulates into one model: the sum / world is DeepSpeed's average
        ctx = StepContext(PlainEngine(model), algo, 64, 16, 0, rank=rank, world=world)
        ctx.speeds = speeds
        prepared = _prepare(ctx, groups)
        rows.append(sum(int((mb.seq_index >= 0).sum()) for mb in prepared.mbs))
        _accumulate(ctx, prepared, sums)
    g = {n: p.grad.clone() / world for n, p in model.named_parameters() if p.grad is not None}
    return {"grads": g, "rows": rows, "loss": sums["loss"]}


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_uneven_shares_give_the_whole_batch_gradient(tmp_path: Any, aggregation: str) -> None:
    from areal_hex.models import load_model, materialize
    from trainer_service.synthetic import synthetic_groups

    d = materialize(ModelConfig(tiny=TinyModelConfig(num_layers=1)), tmp_path / "m")
    model = load_model(d).train()
    groups = synthetic_groups(4, 4, model.config.vocab_size, seed=3, temperature=0.8)
    algo = AlgoConfig(aggregation=aggregation, behav_cap=2.0)
    whole = _grads(model, groups, algo, 1, None)
    uneven = _grads(model, groups, algo, 2, [3.0, 1.0])
    fast, slow = uneven["rows"]
    assert fast >= 2 * slow > 0  # rank 0 (three times as fast) trains most sequences
    assert uneven["loss"] == pytest.approx(whole["loss"], abs=1e-6)  # global counts
    for k, g in whole["grads"].items():
        torch.testing.assert_close(uneven["grads"][k], g, atol=1e-5, rtol=1e-5)


def test_ranks_run_only_their_share_outside_lockstep(tmp_path: Any) -> None:
    """ZeRO-0/1 (no collective in a micro-batch's passes): no padding to the busiest rank;
    a rank without a share runs one zero-weight micro-batch, so it still has gradients."""
    from areal_hex.models import load_model, materialize
    from trainer_service.step import plan_micro_batches
    from trainer_service.synthetic import synthetic_groups

    d = materialize(ModelConfig(tiny=TinyModelConfig(num_layers=1)), tmp_path / "m")
    model = load_model(d)
    groups = synthetic_groups(4, 4, model.config.vocab_size, seed=3, temperature=0.8)
    algo = AlgoConfig()

    def rows(rank: int, speeds: list[float]) -> list[list[int]]:
        ctx = StepContext(PlainEngine(model), algo, 64, 16, 0, rank=rank, world=2)
        ctx.speeds, ctx.lockstep = speeds, False
        mbs, _, _ = plan_micro_batches(ctx, groups)
        return [mb.seq_index.tolist() for mb in mbs]

    fast, slow = rows(0, [3.0, 1.0]), rows(1, [3.0, 1.0])
    assert len(fast) > len(slow) > 0 and -1 not in sum(fast + slow, [])
    assert sorted(sum(fast + slow, [])) == list(range(16))  # each sequence once
    assert rows(1, [1e6, 1.0]) == [[-1]]  # empty share: one dummy row


def test_train_preflight_counts_rank_speeds_across_nodes(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """One speed per rank of the whole job: num_ranks per node x PET_NNODES nodes."""
    import argparse

    from areal_hex.errors import UsageError
    from hexctl.cli.train_cmd import preflight

    root = Path(__file__).resolve().parents[2]
    args = argparse.Namespace(
        config=str(root / "examples" / "tiny_cpu.yaml"),
        overrides=[
            "trainer.num_ranks=2",
            "trainer.rank_speeds=[1.0,2.0,3.0,4.0]",
            f"trainer.replay_path={tmp_path / 'replay.jsonl'}",
            "run.run_id=r1",
        ],
    )
    monkeypatch.delenv("PET_NNODES", raising=False)
    with pytest.raises(UsageError, match="4 values for trainer.num_ranks = 2"):
        preflight(args)
    monkeypatch.setenv("PET_NNODES", "2")
    assert preflight(args).trainer.rank_speeds == [1.0, 2.0, 3.0, 4.0]
