"""π_ref log-probs for the KL term: read from the group records, or computed here.

With a reference task in the workflow (`workflow.tasks`, role `reference`), the rollout
controller has every group scored by it (rollout_service/controller/reference.py) and
each completion's `ref_logprobs` arrives in the record: the trainer then holds no
reference model, and loads one only for a micro-batch whose records lack them (a replay
file or a buffer written before). Without one, it holds the reference model from the
start and runs a no-grad forward per micro-batch, as the objective needs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from areal_hex.config import ExperimentConfig

if TYPE_CHECKING:
    import torch

    from trainer_service.batching import MicroBatch

# trainer_service/step.py's StepContext: the step imports this module, so its type is not
# imported back (no import cycle, tests/unit/test_architecture.py)
StepContext = Any

log = logging.getLogger(__name__)


def reference_model(
    cfg: ExperimentConfig, model_dir: Path, device: str
) -> tuple[Any | None, Callable[[], Any] | None]:
    """(the reference model, or None; a loader for it when it is held only on demand)."""
    if cfg.algo.kl_coef <= 0:
        return None, None
    dtype = "float32" if cfg.trainer.device == "cpu" else "bfloat16"

    def load() -> Any:
        from areal_hex.models import load_model
        from trainer_service import packed

        model = load_model(model_dir, device, dtype)
        model.requires_grad_(False)
        if device == "cpu":
            packed.enable(model)  # the policy's pass (engine.build_engine)
        return model

    task = cfg.workflow.task_with_role("reference")
    if task is not None:
        log.info(
            "π_ref log-probs from the records (reference task %r): no reference model", task.name
        )
        return None, load
    return load(), None


def reference_logprobs(ctx: StepContext, mb: MicroBatch) -> torch.Tensor | None:
    """(B, L - 1) π_ref log-probs of `mb`'s tokens, or None where the objective has no KL
    term: the records' when they carry them, else the reference model's forward."""
    from trainer_service.engine import token_logprobs

    if ctx.algo.kl_coef <= 0:
        return None
    if mb.ref_logp is not None:
        return mb.ref_logp
    if ctx.ref_model is None:
        if ctx.load_ref is None:
            return None
        log.warning("a batch without π_ref log-probs in its records: loading the reference model")
        ctx.ref_model = ctx.load_ref()
    return token_logprobs(ctx.ref_model, mb)[0]
