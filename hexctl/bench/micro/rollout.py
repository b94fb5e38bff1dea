"""Rollout generation throughput: the built-in server (continuous batching) vs HF generate.

`areal-hex bench rollout --json` sends N requests of mixed prompt and output lengths
(`ignore_eos`, so each produces exactly the tokens asked for) to a real server process,
all at once, and measures useful tokens/s and per-request latency. The baseline, in the
same run, is plain `model.generate` on the same prompts and lengths in static batches of
the server's batch size (a batch runs until its longest member is done).

The two alternate for `--rounds` rounds (server, baseline, server, ...) and each side
reports its best round, so a burst of load from other processes on the machine skews
neither side alone; every round's figure is in the output too.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from areal_hex.net import WaitAborted, async_wait_until, free_port
from hexctl.bench import BenchFailed
from hexctl.job.processes import stop_process

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
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds (default 2)")
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
    from areal_hex.errors import UsageError

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
    baseline = _hf_baseline(args, model_cfg, tok, work)
    rounds = _server_rounds(args, work, context, baseline)
    best = max((srv for srv, _ in rounds), key=lambda r: r["server_tokens_per_s"])
    hf = max(tps for _, tps in rounds)
    return {
        "requests": args.requests,
        "batch_size": args.batch_size,
        "device": args.device,
        "model_size": args.model_size,
        "threads": args.threads,
        "rounds": len(rounds),
        "useful_tokens": sum(n for _, n in work),
        **best,
        "hf_generate_tokens_per_s": hf,
        "ratio": best["server_tokens_per_s"] / hf if hf else 0.0,
        "server_tokens_per_s_rounds": [srv["server_tokens_per_s"] for srv, _ in rounds],
        "hf_generate_tokens_per_s_rounds": [tps for _, tps in rounds],
    }


class _StartFailed(RuntimeError):
    """The server process exited before it answered /health (e.g. its port was taken)."""


def _server_rounds(
    args: argparse.Namespace,
    work: list[tuple[list[int], int]],
    context: int,
    baseline: Callable[[], float],
) -> list[tuple[dict[str, Any], float]]:
    """Start `areal-hex serve` in a subprocess; per round, send every request at once,
    then run the baseline (the server idles meanwhile)."""
    cfg = {
        "model": _model_config(args),
        "inference": {
            "device": args.device,
            "max_running_requests": args.batch_size,
            "context_length": context,
            "seed": args.seed,
            "num_threads": args.threads,
        },
        # Only the server runs: the controller's prompt + answer budget just has to fit
        # the context the config checks it against.
        "data": {"max_prompt_tokens": context // 2},
        "rollout": {"max_new_tokens": context - context // 2},
    }
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [_root(), os.environ.get("PYTHONPATH")])),
    )
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bench.yaml"
        path.write_text(yaml.safe_dump(cfg))
        for attempt in range(3):  # a free port can be taken before the server binds it
            port = free_port()
            cmd = [sys.executable, "-m", "hexctl.cli", "serve", str(path), "--port", str(port)]
            with open(Path(tmp) / f"server{attempt}.log", "w+b") as log:
                proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
                try:
                    url = f"http://127.0.0.1:{port}"
                    return asyncio.run(_drive(url, args, work, proc, baseline))
                except _StartFailed:
                    log.seek(0)
                    tail = log.read().decode(errors="replace")[-2000:]
                    if attempt == 2:
                        raise BenchFailed(f"the bench server did not start:\n{tail}") from None
                finally:
                    stop_process(proc)
    raise AssertionError("not reached")


def _root() -> str:
    return str(Path(__file__).resolve().parents[3])


async def _drive(
    url: str,
    args: argparse.Namespace,
    work: list[tuple[list[int], int]],
    proc: subprocess.Popen,
    baseline: Callable[[], float],
) -> list[tuple[dict[str, Any], float]]:
    from areal_hex.api import SamplingParams
    from rollout_service.client import InferenceClient

    async with InferenceClient(url, timeout_s=None) as client:
        try:
            up = await async_wait_until(
                client.health, 120, interval_s=0.2, alive=lambda: proc.poll() is None
            )
        except WaitAborted:
            up = False
        if not up:
            raise _StartFailed()
        # warm-up: one short request (first-call allocations, lazy imports)
        await client.generate(work[0][0], SamplingParams(max_new_tokens=4, ignore_eos=True))

        async def one(prompt: list[int], n: int) -> tuple[float, int]:
            t0 = time.perf_counter()
            sp = SamplingParams(max_new_tokens=n, temperature=args.temperature, ignore_eos=True)
            res = await client.generate(prompt, sp)
            return time.perf_counter() - t0, len(res.output_ids)

        rounds = []
        for _ in range(max(1, args.rounds)):
            rounds.append((await _server_round(client, work, one), baseline()))
    return rounds


async def _server_round(
    client: Any, work: list[tuple[list[int], int]], one: Callable[..., Any]
) -> dict[str, Any]:
    before = _counters(await client.metrics_text())
    t0 = time.perf_counter()
    results = await asyncio.gather(*(one(p, n) for p, n in work))
    wall = time.perf_counter() - t0
    after = _counters(await client.metrics_text())
    lat = sorted(r[0] for r in results)
    tokens = sum(r[1] for r in results)
    return {
        "server_tokens": tokens,
        "server_wall_s": wall,
        "server_tokens_per_s": tokens / wall,
        "p50_latency_s": _pct(lat, 0.50),
        "p99_latency_s": _pct(lat, 0.99),
        "server_prefill_batches": after["prefill"] - before["prefill"],
        "server_decode_steps": after["decode"] - before["decode"],
    }


def _counters(metrics: str) -> dict[str, int]:
    names = {"sglang:prefill_batches_total": "prefill", "sglang:decode_steps_total": "decode"}
    out = {}
    for line in metrics.splitlines():
        name, _, value = line.partition(" ")
        if name in names:
            out[names[name]] = int(float(value))
    return out


def _pct(sorted_values: list[float], q: float) -> float:
    idx = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[idx]


def _hf_baseline(
    args: argparse.Namespace, model_cfg: Any, tok: Any, work: list[tuple[list[int], int]]
) -> Callable[[], float]:
    """A function measuring useful tokens/s of `model.generate` over static batches in
    submission order (the model is built and warmed up once, here)."""
    import torch

    from areal_hex import models

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    model = models.build_tiny_model(model_cfg.tiny, tok, seed=model_cfg.seed)
    model = model.to(device=args.device, dtype=models.torch_dtype(model_cfg.dtype)).eval()
    pad = int(tok.pad_token_id)
    _hf_batch(model, [work[0]], pad, args)  # warm-up, as for the server

    def measure() -> float:
        useful = 0
        t0 = time.perf_counter()
        for i in range(0, len(work), args.batch_size):
            chunk = work[i : i + args.batch_size]
            _hf_batch(model, chunk, pad, args)
            useful += sum(n for _, n in chunk)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        return useful / (time.perf_counter() - t0)

    return measure


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
