"""The DeepSpeed engine over an HF causal LM, and token log-probs as the server samples.

CPU: fp32, gloo, `DS_ACCELERATOR=cpu`. CUDA: bf16, NCCL. The optimizer is torch AdamW
(built by DeepSpeed with `torch_adam`, so no fused-op build is needed; on CPU torch's
fused kernel, one op per parameter) and the LR schedule a `LambdaLR` that DeepSpeed
steps and checkpoints with the engine.
"""

from __future__ import annotations

import functools
import math
import os
import socket
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from areal_hex.config.trainer import TrainerConfig

if TYPE_CHECKING:
    import torch

    from trainer_service.batching import MicroBatch


def lr_lambda(cfg: TrainerConfig, updates_per_step: int = 1) -> Callable[[int], float]:
    """Multiplier of `cfg.lr` after `update` optimizer updates: linear warm-up from 0,
    then constant, linear or cosine decay to `min_lr_ratio` at `total_steps`. Warm-up
    and decay count trainer steps (`updates_per_step` updates each)."""

    def fn(update: int) -> float:
        step = update // updates_per_step
        if cfg.warmup_steps and step < cfg.warmup_steps:
            return (step + 1) / (cfg.warmup_steps + 1)
        if cfg.lr_schedule == "constant":
            return 1.0
        span = max(cfg.total_steps - cfg.warmup_steps, 1)
        frac = min(max(step - cfg.warmup_steps, 0) / span, 1.0)
        lo = cfg.min_lr_ratio
        if cfg.lr_schedule == "linear":
            return 1.0 - (1.0 - lo) * frac
        return lo + (1.0 - lo) * 0.5 * (1.0 + math.cos(math.pi * frac))

    return fn


def ds_config(cfg: TrainerConfig, world_size: int) -> dict[str, Any]:
    """DeepSpeed config: one optimizer step per call of `engine.step()`, whatever the
    number of micro-batches (`managed_gradient_accumulation` off)."""
    zero: dict[str, Any] = {"stage": cfg.zero_stage}
    if cfg.zero_stage == 3:
        # gather every parameter at once for the forward: small models, simpler schedule
        zero.update({"stage3_param_persistence_threshold": 0, "overlap_comm": False})
    elif cfg.zero_stage > 0:
        zero.update({"overlap_comm": False, "contiguous_gradients": True})
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "train_batch_size": world_size,
        "managed_gradient_accumulation": False,
        "gradient_clipping": cfg.grad_clip,
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": cfg.lr,
                "betas": list(cfg.adam_betas),
                "eps": cfg.adam_eps,
                "weight_decay": cfg.weight_decay,
                "torch_adam": True,
                **({"fused": True} if cfg.device == "cpu" else {}),
            },
        },
        "bf16": {"enabled": cfg.device == "cuda"},
        "zero_optimization": zero,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def cpu_environment(env: dict[str, str] | os._Environ[str]) -> None:
    """DeepSpeed on CPU: its CPU accelerator, and its JIT-compiled ops (the shared-memory
    comm op, compiled on first use) kept in this environment's own directory, where
    scripts/install.sh compiles them, unless TORCH_EXTENSIONS_DIR says otherwise or the
    environment is not writable (torch's per-user directory then)."""
    env.setdefault("DS_ACCELERATOR", "cpu")
    if "TORCH_EXTENSIONS_DIR" not in env and os.access(sys.prefix, os.W_OK):
        env["TORCH_EXTENSIONS_DIR"] = os.path.join(sys.prefix, "torch_extensions")


def flush_denormals(device: str) -> None:
    """On CPU, floats below ~1e-38 (denormals) count as zero on this thread and the
    threads it starts: x86 computes on them through a slow path, and the step's softmax
    and gradients make some (about 3 % of the step's CPU in the README job); values that
    small change no result at 1e-6 (tests/unit/test_token_logprobs_paths.py)."""
    if device == "cpu":
        import torch

        torch.set_flush_denormal(True)


def init_single_rank(device: str = "cpu") -> None:
    """A one-rank process group for DeepSpeed outside its launcher (profiling and benches
    time the trainer's step in-process): a free loopback port, gloo on CPU, NCCL on CUDA."""
    if device == "cpu":
        cpu_environment(os.environ)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for k, v in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0",
                 "LOCAL_RANK": "0", "WORLD_SIZE": "1"}.items():  # fmt: skip
        os.environ[k] = v
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo" if device == "cpu" else "nccl")


def build_engine(
    model: torch.nn.Module, cfg: TrainerConfig, world_size: int, updates_per_step: int = 1
) -> Any:
    """Wrap `model` in a DeepSpeed engine with AdamW and the warm-up LR schedule; on CPU
    its attention runs packed sequences where it can (packed.py) and its RMSNorms the
    written-out backward (rms_norm.py)."""
    import deepspeed
    import torch

    from trainer_service import packed, rms_norm

    if cfg.gradient_checkpointing and hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable()
    if cfg.device == "cpu":  # measured there (docs/trainer.md, "The step's CPU time")
        packed.enable(model)  # one pass, no padding (packed.py), where the model can
        rms_norm.fuse(model)  # fp32 norms with their backward written out (rms_norm.py)
    fn = lr_lambda(cfg, updates_per_step)
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=[p for p in model.parameters() if p.requires_grad],
        config=ds_config(cfg, world_size),
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, fn),
    )
    if world_size == 1 and cfg.zero_stage == 0:
        # one rank: averaging its gradients over itself is a flatten, an all-reduce and a
        # copy back of every gradient each step, for the same values
        engine.enable_backward_allreduce = False
        if cfg.device == "cpu":
            engine.clip_fp32_gradients = functools.partial(clip_one_rank, engine)
    return engine


def clip_one_rank(engine: Any) -> None:
    """DeepSpeed's fp32 gradient clipping on one rank (stage 0): the same norm and scale
    in two foreach ops, without its average of the norm over the one rank (a gloo
    all-reduce); the norm is kept for `get_global_grad_norm` (which stage 0 leaves
    unset)."""
    import torch

    grads = [p for p in engine.module.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(grads, engine.gradient_clipping(), foreach=True)
    engine._global_grad_norm = float(norm)


def token_logprobs(
    model: Callable[..., Any],
    mb: MicroBatch,
    with_entropy: bool = False,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of each next token under softmax(logits / T), as the server sampled it.

    Returns (B, L - 1) log-probs and, if asked, the (B, L - 1) entropy (with its graph
    only when `entropy_grad`, for the entropy bonus: it costs a (B, L, V) tensor).

    Only the positions from the batch's first completion token on are scored (logits,
    softmax over the vocabulary and their backward are the step's largest tensors, and
    prompt positions carry no loss); earlier positions hold 0. Rows are right-padded, so
    causal attention alone keeps every real token from seeing padding: no padding mask
    is built (padding positions see the tokens before them, and carry no loss). Rows
    that share prompts (a group's completions) run each prompt once (shared_prompt.py).
    """
    import torch
    import torch.nn.functional as F

    from areal_hex.algorithms import entropy_from_logp
    from trainer_service.shared_prompt import shared_prompt_logprobs, shares_prompts

    if shares_prompts(model, mb):
        return shared_prompt_logprobs(model, mb, with_entropy, entropy_grad)
    width = mb.input_ids.shape[1]
    start = first_scored(mb)
    out = model(input_ids=mb.input_ids, use_cache=False, logits_to_keep=width - start)
    # (B, L - 1 - start, V); a model that returns every position is cut here
    logits = out.logits[:, start - width : -1].float() / mb.temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, mb.targets[:, start:].unsqueeze(-1)).squeeze(-1)
    entropy = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropy = F.pad(entropy_from_logp(logp_all), (start, 0))
    return F.pad(logp, (start, 0)), entropy


def first_scored(mb: MicroBatch) -> int:
    """The first position (of L - 1) that predicts a completion token in any row; 0
    when none does (a dummy micro-batch)."""
    return int(mb.loss_mask.any(dim=0).float().argmax())  # argmax of all zeros: 0
