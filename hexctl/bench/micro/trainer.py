"""Trainer throughput and publication cost against plain-PyTorch baselines in the same run.

- `trainer_tokens_per_s`: the DeepSpeed trainer step (`optimize`: advantages, decoupled
  PPO loss with the loss pass's own log-probs as the proximal ones, backward per
  micro-batch, clip, AdamW step), 1 rank.
- `torch_loop_tokens_per_s`: a plain PyTorch loop doing the same work on an identical
  model, batch, optimizer and loss. Steps of the two alternate, so machine load hits both.
- `publish_s`: snapshot + write one HF weights directory (temp dir, rename);
  `safetensors_save_s`: a plain `safetensors.torch.save_file` of the same tensors;
  `publish_blocking_s`: collecting the tensors, the only part on the training critical
  path (the write overlaps the next step's forward and backward).
  Medians over repeats.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from trainer_service.engine import init_single_rank


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=6, help="measured steps per loop")
    p.add_argument("--groups", type=int, default=8, help="groups per step")
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--completion-len", type=int, default=64)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--micro-batch-tokens", type=int, default=2048)
    p.add_argument("--publish-repeats", type=int, default=9)


def _torch_step(model: Any, opt: Any, ctx: Any, groups: list, clip: float) -> None:
    """The same step as `optimize`, written as a plain PyTorch loop."""
    import numpy as np
    import torch

    from areal_hex.algorithms import policy_loss
    from trainer_service.batching import sequence_advantages
    from trainer_service.engine import token_logprobs
    from trainer_service.step import plan_micro_batches

    mbs, items, counts = plan_micro_batches(ctx, groups)
    a = ctx.algo
    adv, _, _ = sequence_advantages(groups, items, a.advantage, a.std_normalize, a.std_eps)
    adv_t = torch.tensor(np.append(adv, 0.0), dtype=torch.float32)
    for mb in mbs:
        logp, _ = token_logprobs(model, mb, with_entropy=True)
        prox = logp.detach()  # one update per step: the loss pass's weights are pi_prox
        loss, _ = policy_loss(
            a, logp, prox, mb.behav_logp, adv_t[mb.seq_index].view(-1, 1), mb.loss_mask, counts
        )
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    opt.zero_grad(set_to_none=True)


def _throughput(args: argparse.Namespace, model_dir: Path) -> dict[str, float]:
    import torch

    from areal_hex.config import AlgoConfig, TrainerConfig
    from areal_hex.models import load_model
    from trainer_service import packed, rms_norm
    from trainer_service.engine import build_engine
    from trainer_service.step import StepContext, optimize
    from trainer_service.synthetic import synthetic_groups

    tcfg = TrainerConfig(micro_batch_tokens=args.micro_batch_tokens, lr=1e-5)
    algo = AlgoConfig()
    engine = build_engine(load_model(model_dir).train(), tcfg, world_size=1)
    plain = load_model(model_dir).train()
    # the engine's attention and norms (build_engine), so both run the same passes
    packed.enable(plain)
    rms_norm.fuse(plain)
    opt = torch.optim.AdamW(
        plain.parameters(), lr=tcfg.lr, betas=tcfg.adam_betas, eps=tcfg.adam_eps,
        weight_decay=tcfg.weight_decay,
    )  # fmt: skip
    vocab = plain.config.vocab_size
    ctx = StepContext(engine, algo, tcfg.micro_batch_tokens, 64, 0, rank=0, world=1)
    plain_ctx = StepContext(plain, algo, tcfg.micro_batch_tokens, 64, 0, rank=0, world=1)
    n = args.completion_len
    times: dict[str, list[float]] = {"ds": [], "torch": []}
    tokens = 0
    for step in range(args.steps + 1):  # step 0 warms both up
        groups = synthetic_groups(
            args.groups, args.group_size, vocab, args.prompt_len, (n // 2, n), seed=step
        )
        t0 = time.perf_counter()
        result = optimize(ctx, groups)
        t1 = time.perf_counter()
        _torch_step(plain, opt, plain_ctx, groups, tcfg.grad_clip)
        t2 = time.perf_counter()
        if step:
            times["ds"].append(t1 - t0)
            times["torch"].append(t2 - t1)
            tokens += result.num_tokens
    ds_rate = tokens / sum(times["ds"])
    torch_rate = tokens / sum(times["torch"])
    return {
        "trainer_tokens_per_s": ds_rate,
        "torch_loop_tokens_per_s": torch_rate,
        "ratio": ds_rate / torch_rate,
        "tokens_per_step": tokens / args.steps,
        "_engine": engine,  # handed on to the publication benchmark
    }


def _publication(engine: Any, model_dir: Path, repeats: int) -> dict[str, float]:
    from safetensors.torch import save_file

    from trainer_service.publish import full_state_dict, write_model_dir

    pub, plain, snap = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(repeats):
            t0 = time.perf_counter()
            tensors = full_state_dict(engine, 0, 0)
            assert tensors is not None
            ts = time.perf_counter()
            write_model_dir(tensors, model_dir, Path(tmp) / f"v{i}")
            t1 = time.perf_counter()
            save_file(tensors, str(Path(tmp) / f"plain{i}.safetensors"))
            t2 = time.perf_counter()
            pub.append(t1 - t0)
            snap.append(ts - t0)
            plain.append(t2 - t1)
        size = sum(t.numel() * t.element_size() for t in tensors.values())
    return {
        "publish_s": statistics.median(pub),
        "safetensors_save_s": statistics.median(plain),
        "publish_ratio": statistics.median(pub) / statistics.median(plain),
        # the part on the training critical path (the write runs on a background thread)
        "publish_blocking_s": statistics.median(snap),
        "weights_mb": size / 2**20,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:

    # DeepSpeed prints build messages on stdout: keep stdout for the one JSON object
    with contextlib.redirect_stdout(sys.stderr):
        return _run(args)


def _run(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from areal_hex.config import ModelConfig, TinyModelConfig
    from areal_hex.models import materialize

    init_single_rank()
    tiny = TinyModelConfig(
        num_layers=args.layers,
        hidden_size=args.hidden,
        intermediate_size=3 * args.hidden,
        num_heads=max(args.hidden // 64, 1),
        num_kv_heads=max(args.hidden // 128, 1),
    )
    try:
        with tempfile.TemporaryDirectory() as tmp:
            model_dir = materialize(ModelConfig(tiny=tiny), Path(tmp) / "v0")
            out = _throughput(args, model_dir)
            engine = out.pop("_engine")
            out.update(_publication(engine, model_dir, args.publish_repeats))
            out["params_m"] = sum(p.numel() for p in engine.module.parameters()) / 1e6
            out["threads"] = torch.get_num_threads()
            return out
    finally:
        dist.destroy_process_group()
