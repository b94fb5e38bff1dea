"""Rollout generation throughput: the built-in server (continuous batching) vs HF generate.

`areal-hex bench rollout --json` sends N requests of mixed prompt and output lengths
(`ignore_eos`, so each produces exactly the tokens asked for) to a real server process,
all at once, and measures useful tokens/s and per-request latency. The baseline, in the
same run, is plain `model.generate` on the same prompts and lengths in static batches of
the server's batch size (a batch runs until its longest member is done).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

SIZES: dict[str, dict[str, int]] = {
    "tiny": {},  # TinyModelConfig defaults
    # a ~0.45B Qwen3 (28 layers, hidden 1024) built from a config
    "0.5b": {
        "num_layers": 28,
        "hidden_size": 1024,
        "intermediate_size": 4096,
        "num_heads": 16,
        "num_kv_heads": 8,
        "max_position_embeddings": 4096,
    },
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=64, help="requests to send (default 64)")
    p.add_argument(
        "--batch-size",
        type=int,
        default=16,
        help="server max running requests and the baseline's static batch size (default 16)",
    )
    p.add_argument("--min-prompt", type=int, default=8)
    p.add_argument("--max-prompt", type=int, default=64)
    p.add_argument("--min-new", type=int, default=16)
    p.add_argument("--max-new", type=int, default=192)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--model-size", choices=sorted(SIZES), default="tiny")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads for both the server and the baseline (default 1)",
    )


def _workload(args: argparse.Namespace, vocab: int) -> list[tuple[list[int], int]]:
    rng = random.Random(args.seed)
    out = []
    for _ in range(args.requests):
        n = rng.randint(args.min_prompt, args.max_prompt)
        prompt = [rng.randrange(5, vocab) for _ in range(n)]
        out.append((prompt, rng.randint(args.min_new, args.max_new)))
    return out


def _model_config(args: argparse.Namespace) -> dict[str, Any]:
    dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    return {"tiny": SIZES[args.model_size], "dtype": dtype, "seed": args.seed}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from areal_hex.cli import UsageError

    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            print(
                "bench rollout: CUDA is not available on this machine; nothing to measure",
                file=sys.stderr,
            )
            raise SystemExit(0)
    if args.requests <= 0 or args.batch_size <= 0:
        raise UsageError("--requests and --batch-size must be positive")
    if args.min_new > args.max_new or args.min_prompt > args.max_prompt:
        raise UsageError("--min-* must not exceed --max-*")
    from areal_hex import models
    from areal_hex.config import ModelConfig

    model_cfg = ModelConfig.model_validate(_model_config(args))
    tok = models.build_tokenizer()
    work = _workload(args, len(tok))
    context = args.max_prompt + args.max_new
    server = _server_run(args, work, context)
    hf = _hf_run(args, model_cfg, tok, work)
    return {
        "requests": args.requests,
        "batch_size": args.batch_size,
        "device": args.device,
        "model_size": args.model_size,
        "threads": args.threads,
        "useful_tokens": sum(n for _, n in work),
        **server,
        "hf_generate_tokens_per_s": hf,
        "ratio": server["server_tokens_per_s"] / hf if hf else 0.0,
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _server_run(
    args: argparse.Namespace, work: list[tuple[list[int], int]], context: int
) -> dict[str, Any]:
    """Start `areal-hex serve` in a subprocess, send every request at once."""
    port = _free_port()
    cfg = {
        "model": _model_config(args),
        "inference": {
            "device": args.device,
            "max_running_requests": args.batch_size,
            "context_length": context,
            "seed": args.seed,
            "num_threads": args.threads,
        },
    }
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bench.yaml"
        path.write_text(yaml.safe_dump(cfg))
        env = dict(
            os.environ,
            PYTHONPATH=os.pathsep.join(filter(None, [_root(), os.environ.get("PYTHONPATH")])),
        )
        cmd = [sys.executable, "-m", "areal_hex.cli", "serve", str(path), "--port", str(port)]
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            return asyncio.run(_drive(f"http://127.0.0.1:{port}", args, work, proc))
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _root() -> str:
    return str(Path(__file__).resolve().parent.parent)


async def _drive(
    url: str, args: argparse.Namespace, work: list[tuple[list[int], int]], proc: subprocess.Popen
) -> dict[str, Any]:
    from areal_hex.api import SamplingParams
    from rollout_service.client import InferenceClient

    async with InferenceClient(url, timeout_s=None) as client:
        deadline = time.monotonic() + 300
        while not await client.health():
            if proc.poll() is not None or time.monotonic() > deadline:
                err = proc.stderr.read().decode()[-2000:] if proc.stderr else ""
                raise RuntimeError(f"bench server did not start:\n{err}")
            await asyncio.sleep(0.2)
        # warm-up: one short request (first-call allocations, lazy imports)
        await client.generate(work[0][0], SamplingParams(max_new_tokens=4, ignore_eos=True))

        async def one(prompt: list[int], n: int) -> tuple[float, int]:
            t0 = time.perf_counter()
            sp = SamplingParams(max_new_tokens=n, temperature=args.temperature, ignore_eos=True)
            res = await client.generate(prompt, sp)
            return time.perf_counter() - t0, len(res.output_ids)

        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(p, n) for p, n in work))
        wall = time.perf_counter() - t0
    lat = sorted(r[0] for r in results)
    tokens = sum(r[1] for r in results)
    return {
        "server_tokens": tokens,
        "server_wall_s": wall,
        "server_tokens_per_s": tokens / wall,
        "p50_latency_s": _pct(lat, 0.50),
        "p99_latency_s": _pct(lat, 0.99),
    }


def _pct(sorted_values: list[float], q: float) -> float:
    idx = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[idx]


def _hf_run(
    args: argparse.Namespace, model_cfg: Any, tok: Any, work: list[tuple[list[int], int]]
) -> float:
    """Useful tokens/s of `model.generate` over static batches in submission order."""
    import torch

    from areal_hex import models

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    model = models.build_tiny_model(model_cfg.tiny, tok, seed=model_cfg.seed)
    model = model.to(device=args.device, dtype=models.torch_dtype(model_cfg.dtype)).eval()
    pad = int(tok.pad_token_id)
    _hf_batch(model, [work[0]], pad, args)  # warm-up, as for the server
    useful = 0
    t0 = time.perf_counter()
    for i in range(0, len(work), args.batch_size):
        chunk = work[i : i + args.batch_size]
        _hf_batch(model, chunk, pad, args)
        useful += sum(n for _, n in chunk)
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    return useful / (time.perf_counter() - t0)


def _hf_batch(
    model: Any, chunk: list[tuple[list[int], int]], pad: int, args: argparse.Namespace
) -> None:
    import torch

    width = max(len(p) for p, _ in chunk)
    ids = torch.full((len(chunk), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, (prompt, _) in enumerate(chunk):
        ids[b, width - len(prompt) :] = torch.tensor(prompt)
        mask[b, width - len(prompt) :] = 1
    longest = max(n for _, n in chunk)
    with torch.no_grad():
        model.generate(
            input_ids=ids.to(args.device),
            attention_mask=mask.to(args.device),
            max_new_tokens=longest,
            min_new_tokens=longest,  # as ignore_eos: every row runs to the longest
            do_sample=args.temperature > 0,
            temperature=args.temperature if args.temperature > 0 else None,
            top_p=None,
            top_k=None,
            pad_token_id=pad,
        )
