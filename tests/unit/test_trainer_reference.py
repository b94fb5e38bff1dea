"""The trainer's π_ref log-probs: from the records when a reference task scored them
(no reference model held), else from its own reference model, loaded on demand."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from areal_hex.config import ExperimentConfig, ModelConfig, TinyModelConfig
from areal_hex.config.algo import AlgoConfig
from areal_hex.models import materialize
from areal_hex.record import Completion, GroupRecord
from trainer_service import packed
from trainer_service.batching import collate, dummy_batch, flatten_groups
from trainer_service.reference import reference_logprobs, reference_model
from trainer_service.step import StepContext

REF_TASK = {"name": "ref", "command": ["areal-hex", "serve", "{config}"], "role": "reference"}


def _group(ref: bool) -> GroupRecord:
    comps = [
        Completion([3, 4], [-1.0, -1.0], [0, 0], "stop", 1.0),
        Completion([5, 6, 7], [-1.0] * 3, [0] * 3, "length", 0.0),
    ]
    if ref:
        comps[0].ref_logprobs = np.array([-0.3, -0.4], np.float32)
        comps[1].ref_logprobs = np.array([-0.5, -0.6, -0.7], np.float32)
    return GroupRecord("p", [1, 2], comps)


@pytest.fixture(scope="module")
def v0(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return materialize(ModelConfig(tiny=TinyModelConfig(), seed=0), tmp_path_factory.mktemp("v0"))


def test_recorded_ref_logprobs_sit_where_the_tokens_are_predicted() -> None:
    mb = collate(flatten_groups([_group(ref=True)]), pad_id=0)
    assert mb.ref_logp is not None
    # row 1: prompt [1, 2], tokens 5 6 7 predicted at positions 1, 2, 3
    torch.testing.assert_close(mb.ref_logp[1], torch.tensor([0.0, -0.5, -0.6, -0.7]))
    torch.testing.assert_close(mb.ref_logp[0], torch.tensor([0.0, -0.3, -0.4, 0.0]))
    mixed = flatten_groups([_group(ref=True), _group(ref=False)])
    assert collate(mixed, pad_id=0).ref_logp is None  # computed for the whole micro-batch
    assert dummy_batch(0).ref_logp is not None


def _ctx(kl: float, load_ref: object = None) -> StepContext:
    return StepContext(None, AlgoConfig(kl_coef=kl), 64, 8, 0, 0, 1, load_ref=load_ref)


def test_records_first_then_the_model_loaded_once_on_demand(v0: Path) -> None:
    cfg = ExperimentConfig.model_validate(
        {"algo": {"kl_coef": 0.1}, "workflow": {"tasks": [{**REF_TASK, "port": 31000}]}}
    )
    held, load = reference_model(cfg, v0, "cpu")
    assert held is None and load is not None  # a reference task: no model at start
    loads = []

    def counted() -> object:
        loads.append(1)
        return load()

    ctx = _ctx(0.1, counted)
    scored = collate(flatten_groups([_group(ref=True)]), pad_id=0)
    assert reference_logprobs(ctx, scored) is scored.ref_logp and not loads
    plain = collate(flatten_groups([_group(ref=False)]), pad_id=0)
    first = reference_logprobs(ctx, plain)
    again = reference_logprobs(ctx, plain)
    assert len(loads) == 1 and first is not None and first.shape == (2, 4)
    torch.testing.assert_close(first, again)
    assert reference_logprobs(_ctx(0.0, counted), scored) is None  # no KL term: none needed


def test_a_reference_task_without_a_kl_term_is_refused() -> None:
    from areal_hex.config.base import ConfigError, build

    data = {"workflow": {"tasks": [{**REF_TASK, "port": 31000}]}}
    with pytest.raises(ConfigError, match="expected algo.kl_coef > 0, or no reference task"):
        build(ExperimentConfig, data, "test")


def test_without_a_reference_task_the_model_is_held_from_the_start(v0: Path) -> None:
    held, load = reference_model(
        ExperimentConfig.model_validate({"algo": {"kl_coef": 0.1}}), v0, "cpu"
    )
    assert held is not None and load is None
    assert not any(p.requires_grad for p in held.parameters())
    assert packed.enabled(held)  # its log-probs in the policy's one packed pass
    assert reference_model(ExperimentConfig(), v0, "cpu") == (None, None)
