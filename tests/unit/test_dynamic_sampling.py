"""DAPO dynamic sampling at the controller: all-equal-reward groups never reach the
buffer, give their gate admission back, are counted, and production goes on until the
wanted number of informative groups (fakes: tests/fakes.py)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest
from fakes import TOK, FakeServer, MemoryProducer

from areal_hex.config import DataConfig, RolloutConfig
from areal_hex.data import build_prompts, generate_arithmetic
from areal_hex.rewards import RewardPool
from areal_hex.run_files import RolloutRow, TrainerRow
from hexctl.report.summary import accounting
from rollout_service.controller.rollout import RolloutController


class AlternatingRewards(RewardPool):
    """Scores every other group [1, 0, 0] (informative) and the others [1, 1, 1], in
    process (no workers are started)."""

    def __init__(self) -> None:
        super().__init__(workers=1, timeout_s=1.0)
        self.calls = 0

    async def score_many(self, texts: Sequence[str], answer: str) -> list[float]:
        self.calls += 1
        return [1.0, 0.0, 0.0] if self.calls % 2 else [1.0] * len(texts)


def _controller(tmp_path: Path, producer: MemoryProducer, rewards, **cfg) -> RolloutController:
    base = dict(group_size=3, max_new_tokens=16, metrics_interval_s=0.2, probe_interval_s=0.05)
    prompts = build_prompts(generate_arithmetic(8, "train"), TOK, DataConfig()).prompts
    return RolloutController(
        [FakeServer("a")],
        producer,
        prompts,
        lambda ids: TOK.decode(ids, skip_special_tokens=True),
        RolloutConfig(**{**base, **cfg}),
        max_groups=4,
        metrics_path=tmp_path / "rollout.jsonl",
        rewards=rewards,
    )


@pytest.mark.timeout(60)
async def test_filtered_groups_free_their_slot_and_are_counted(tmp_path: Path) -> None:
    producer = MemoryProducer(groups_per_step=2, eta=100)
    ctl = _controller(tmp_path, producer, AlternatingRewards(), dynamic_sampling=True)
    await ctl.run()
    kept = producer.groups
    assert len(kept) == 4  # max_groups informative groups, after over-sampling
    assert all(len(set(g.rewards.tolist())) > 1 for g in kept)
    rows = [RolloutRow(**json.loads(x)) for x in (tmp_path / "rollout.jsonl").read_text().split()]
    last = rows[-1]
    assert last.groups_filtered_total == producer.released >= 3
    # the ledger: every produced group is kept or filtered; the gate holds only kept ones
    assert last.groups_produced_total == len(kept) + last.groups_filtered_total
    assert producer.submitted == len(kept)
    trainer = TrainerRow(groups_trained_total=len(kept))
    buffer = {"groups_dropped_stale": 0, "dead_letter": 0, "unconsumed": 0, "pending": 0,
              "submitted": producer.submitted}  # fmt: skip
    ledger = accounting([trainer], [last], buffer)
    assert ledger["groups_filtered"] == last.groups_filtered_total
    assert ledger["groups_lost"] == 0


@pytest.mark.timeout(60)
async def test_without_dynamic_sampling_nothing_is_filtered(tmp_path: Path) -> None:
    producer = MemoryProducer(groups_per_step=2, eta=100)
    await _controller(tmp_path, producer, AlternatingRewards()).run()
    assert len(producer.groups) == 4 and producer.released == 0


@pytest.mark.timeout(60)
async def test_over_sampling_is_bounded(tmp_path: Path) -> None:
    class Flat(AlternatingRewards):
        async def score_many(self, texts: Sequence[str], answer: str) -> list[float]:
            return [0.0] * len(texts)

    producer = MemoryProducer(groups_per_step=2, eta=100)
    ctl = _controller(
        tmp_path, producer, Flat(), dynamic_sampling=True, dynamic_sampling_max_factor=2
    )
    await ctl.run()
    assert producer.groups == [] and producer.released == 8  # 4 x 2 produced, all filtered
