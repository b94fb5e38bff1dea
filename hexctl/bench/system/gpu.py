"""GPU check: the built-in engine, a DeepSpeed ZeRO-2 step, a publish + reload, and plan
fidelity, on the CUDA device of this host (`scripts/gpu_check.sh` runs it).

- decode: the built-in engine in bf16 on a Qwen3-0.6B-shaped model built from its config
  (random weights: speed does not depend on them), `--requests` requests of `--prompt`
  random tokens each generating `--new` tokens (`ignore_eos`), all at once: tokens/s;
- train: `trainer_service.step.optimize` under DeepSpeed ZeRO-2 with NCCL (one rank) on
  synthetic groups: tokens/s and MFU = 8·N·tokens/s / the kind's dense BF16 peak (6N for
  forward + backward, 2N for the proximal log-prob recompute);
- publish: the trainer's weights written as a HF directory (rank 0's critical path plus
  the write); reload: the engine loading that directory;
- fidelity: `bench fidelity` with the services on the GPUs (needs two: one generates,
  one trains).

Without CUDA it says so and returns at once.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=64, help="decode: requests at once")
    p.add_argument("--prompt", type=int, default=128, help="decode: prompt tokens")
    p.add_argument("--new", type=int, default=256, help="decode: new tokens per request")
    p.add_argument("--groups", type=int, default=8, help="train: groups per step")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=3, help="train: measured steps")
    p.add_argument("--fidelity-steps", type=int, default=20)
    p.add_argument("--no-fidelity", action="store_true", help="skip bench fidelity")


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    if not torch.cuda.is_available():
        return {"cuda": False, "message": "no CUDA device is visible here: nothing to check"}
    with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed prints on stdout
        return _run(args)


def _run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from areal_hex.device_kind import device_kind
    from scheduler.catalogue import CATALOGUE

    kind = device_kind("cuda")
    out: dict[str, Any] = {
        "cuda": True,
        "device": torch.cuda.get_device_name(0),
        "kind": kind,
        "gpus": torch.cuda.device_count(),
        "torch": torch.__version__,
    }
    with tempfile.TemporaryDirectory(prefix="areal-hex-gpu-") as tmp:
        model_dir = _random_model(Path(tmp) / "v0")
        out["params"] = _params(model_dir)
        engine = _inference_engine(model_dir)
        loop = asyncio.new_event_loop()
        try:
            out["decode"] = loop.run_until_complete(_decode(engine, args))
            train, tensors = _train(model_dir, args)
            peak = CATALOGUE[kind].bf16_tflops if kind in CATALOGUE else None
            flops = 8.0 * out["params"] * train["tokens_per_s"]
            train["mfu"] = None if peak is None else round(flops / (peak * 1e12), 4)
            out["train"] = train
            out["publish_s"], v1 = _publish(tensors, model_dir, Path(tmp) / "v1")
            out["reload_s"] = loop.run_until_complete(_reload(engine, v1))
        finally:
            engine.stop()
            loop.close()
    out["fidelity"] = _fidelity(args, out["gpus"])
    return out


def _random_model(out: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    from scheduler.model_shape import load_model_shape

    # Qwen3-0.6B's published shape (the planner's preset), random weights
    shape = load_model_shape("qwen3-0.6b").hf_config()
    config = Qwen3Config(**shape, max_position_embeddings=4096, torch_dtype="bfloat16")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(str(out))
    return out


def _params(model_dir: Path) -> int:
    from scheduler.model_shape import load_model_shape

    return load_model_shape(str(model_dir / "config.json")).params


def _inference_engine(model_dir: Path) -> Any:
    from areal_hex.config import InferenceConfig, ModelConfig
    from rollout_service.server.main import build_engine

    inf = InferenceConfig(device="cuda", max_running_requests=256, context_length=4096)
    return build_engine(ModelConfig(path=str(model_dir), dtype="bfloat16"), inf)


async def _decode(engine: Any, args: argparse.Namespace) -> dict[str, Any]:
    import random

    from rollout_service.wire import SamplingParamsIn

    engine.start()
    rng = random.Random(0)
    sp = SamplingParamsIn(max_new_tokens=args.new, temperature=1.0, ignore_eos=True)
    prompts = [
        [rng.randrange(100, 150000) for _ in range(args.prompt)] for _ in range(args.requests)
    ]
    await engine.generate(prompts[0], SamplingParamsIn(max_new_tokens=4, ignore_eos=True), "w")
    t0 = time.perf_counter()
    outs = await asyncio.gather(*(engine.generate(p, sp, f"r{i}") for i, p in enumerate(prompts)))
    wall = time.perf_counter() - t0
    tokens = sum(len(o.output_ids) for o in outs)
    return {"requests": args.requests, "tokens": tokens, "tokens_per_s": round(tokens / wall, 1)}


async def _reload(engine: Any, path: Path) -> float:
    t0 = time.perf_counter()
    await engine.update_weights(str(path), "1", abort_all=False)
    return round(time.perf_counter() - t0, 3)


def _train(model_dir: Path, args: argparse.Namespace) -> tuple[dict[str, Any], Any]:
    import statistics

    import torch

    from areal_hex.config import AlgoConfig, TrainerConfig
    from areal_hex.models import load_model
    from trainer_service.engine import build_engine, init_single_rank
    from trainer_service.publish import full_state_dict
    from trainer_service.step import StepContext, optimize
    from trainer_service.synthetic import synthetic_groups

    init_single_rank("cuda")
    tcfg = TrainerConfig(device="cuda", zero_stage=2, micro_batch_tokens=8192, lr=1e-6)
    model = load_model(model_dir, "cuda", "bfloat16")
    engine = build_engine(model.train(), tcfg, world_size=1)
    ctx = StepContext(engine, AlgoConfig(), tcfg.micro_batch_tokens, 512, 0, 0, 1, device="cuda")
    times, tokens = [], []
    for step in range(args.steps + 1):  # step 0 warms up
        groups = synthetic_groups(args.groups, args.group_size, 150000, 128, (256, 512), step)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        res = optimize(ctx, groups)
        torch.cuda.synchronize()
        if step:
            times.append(time.perf_counter() - t0)
            tokens.append(res.num_tokens)
    rate = statistics.median(n / s for n, s in zip(tokens, times, strict=True))
    train = {"zero_stage": 2, "backend": "nccl", "tokens_per_s": round(rate, 1)}
    return train, full_state_dict(engine, 2, 0)


def _publish(tensors: Any, model_dir: Path, out: Path) -> tuple[float, Path]:
    from trainer_service.publish import write_model_dir

    t0 = time.perf_counter()
    write_model_dir({k: v.detach().to("cpu") for k, v in tensors.items()}, model_dir, out)
    return round(time.perf_counter() - t0, 3), out


def _fidelity(args: argparse.Namespace, gpus: int) -> dict[str, Any]:
    if args.no_fidelity:
        return {"skipped": "--no-fidelity"}
    if gpus < 2:
        return {"skipped": f"{gpus} GPU: bench fidelity needs one to generate, one to train"}
    from hexctl.bench.system import DEFAULT_CONFIG
    from hexctl.bench.system import fidelity as bench_fidelity

    ns = argparse.Namespace(
        config=DEFAULT_CONFIG,
        steps=args.fidelity_steps,
        output_dir=None,
        overrides=["inference.device=cuda", "trainer.device=cuda", "run.pin_cores=false"],
    )
    return bench_fidelity.run(ns)
