"""The one-rank CPU engine's optimizer step (torch's fused AdamW, the clipping in two
foreach ops: trainer_service/engine.py) leaves the weights DeepSpeed's own path leaves
(its for-loop AdamW and clipping), to 1e-6, with the gradients clipped or not, and
reports the gradients' norm."""

from __future__ import annotations

import copy
from typing import Any

import torch

from areal_hex.config import ModelConfig, TinyModelConfig, TrainerConfig


def _deepspeed_own(model: Any, cfg: TrainerConfig) -> Any:
    """The engine as DeepSpeed builds it from the config without the fused optimizer."""
    import deepspeed

    from trainer_service.engine import ds_config

    conf = ds_config(cfg, 1)
    conf["optimizer"]["params"].pop("fused")
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=list(model.parameters()), config=conf
    )
    engine.enable_backward_allreduce = False
    return engine


def test_same_weights_as_deepspeeds_own_step(tmp_path: Any) -> None:
    from areal_hex.models import load_model, materialize
    from trainer_service.engine import build_engine, init_single_rank

    init_single_rank("cpu")
    model = load_model(materialize(ModelConfig(tiny=TinyModelConfig(num_layers=1)), tmp_path))
    cfg = TrainerConfig(lr=1e-2, weight_decay=0.01, grad_clip=1.0)
    ours = build_engine(copy.deepcopy(model).train(), cfg, world_size=1)
    theirs = _deepspeed_own(copy.deepcopy(model).train(), cfg)
    assert ours.optimizer.param_groups[0]["fused"] and not theirs.optimizer.param_groups[0]["fused"]
    gen = torch.Generator().manual_seed(0)
    for scale in (10.0, 1e-3, 10.0):  # clipped, not clipped, clipped
        grads = [scale * torch.randn(p.shape, generator=gen) for p in model.parameters()]
        norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item()
        for engine in (ours, theirs):
            for p, g in zip(engine.module.parameters(), grads, strict=True):
                p.grad = g.clone()
            engine.step()
        assert abs(ours.get_global_grad_norm() - norm) <= 1e-5 * norm
        for a, b in zip(ours.module.parameters(), theirs.module.parameters(), strict=True):
            torch.testing.assert_close(a.detach(), b.detach(), atol=1e-6, rtol=1e-6)
    pairs = zip(ours.module.parameters(), model.parameters(), strict=True)
    assert max(float((a - b).detach().abs().max()) for a, b in pairs) > 1e-3  # they moved
