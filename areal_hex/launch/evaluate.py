"""Score a weights version on a dataset split through an inference server: pass@1 with
greedy decoding, pass@k with k samples per problem (unbiased estimator from n ≥ k)."""

from __future__ import annotations

import asyncio
import math
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from areal_hex.config import ExperimentConfig


@dataclass
class EvalOptions:
    weights: str  # a directory, or a version number under inference.weights_dir
    split: str = "test"
    limit: int | None = None  # at most this many problems
    k: int = 1  # pass@k; k > 1 samples n ≥ k answers per problem at rollout.temperature
    n: int | None = None
    server: str | None = None  # use a running server (its weights are reloaded)
    concurrency: int = 32


def resolve_weights(cfg: ExperimentConfig, weights: str) -> Path:
    """`weights` as a directory, or `N`/`vN` under `inference.weights_dir`."""
    path = Path(weights)
    if path.is_dir():
        return path.resolve()
    name = weights if weights.startswith("v") else f"v{weights}"
    if cfg.inference.weights_dir and (Path(cfg.inference.weights_dir) / name).is_dir():
        return (Path(cfg.inference.weights_dir) / name).resolve()
    raise FileNotFoundError(
        f"weights {weights!r}: not a directory, nor a version under inference.weights_dir "
        f"({cfg.inference.weights_dir})"
    )


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct (Chen et al., 2021)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.prod((n - c - i) / (n - i) for i in range(k))


def evaluate(cfg: ExperimentConfig, opts: EvalOptions) -> dict[str, Any]:
    from areal_hex.data import build_prompts, load_problems
    from areal_hex.models import load_tokenizer
    from rollout_service.server import ServerThread, build_server_app

    weights = resolve_weights(cfg, opts.weights)
    tok = load_tokenizer(weights)
    problems = load_problems(cfg.data, opts.split)[: opts.limit]
    prompts = build_prompts(problems, tok, cfg.data).prompts
    with ExitStack() as stack:
        url = opts.server
        if url is None:
            model_cfg = cfg.model.model_copy(update={"path": str(weights), "tokenizer_path": None})
            inf = cfg.inference.model_copy(update={"api_key": None, "weights_dir": None})
            url = stack.enter_context(ServerThread(build_server_app(model_cfg, inf)))
        return asyncio.run(_score(cfg, opts, url, str(weights), prompts, tok))


async def _score(
    cfg: ExperimentConfig, opts: EvalOptions, url: str, weights: str, prompts: list, tok: Any
) -> dict[str, Any]:
    from areal_hex.api import SamplingParams
    from areal_hex.rewards import RewardPool
    from rollout_service.client import InferenceClient

    n = max(opts.n or opts.k, opts.k)
    greedy = opts.k == 1 and opts.n is None
    r = cfg.rollout
    sampling = SamplingParams(
        max_new_tokens=r.max_new_tokens,
        temperature=0.0 if greedy else r.temperature,
        top_p=1.0 if greedy else r.top_p,
        top_k=-1 if greedy else r.top_k,
    )
    rewards = RewardPool(r.reward_workers, r.reward_timeout_s)
    await rewards.start()
    slots = asyncio.Semaphore(opts.concurrency)
    async with InferenceClient(url, api_key=cfg.inference.api_key) as client:
        if opts.server is not None:
            await client.update_weights_from_disk(weights, "eval")

        async def one(prompt: Any) -> int:
            async with slots:
                outs = await asyncio.gather(
                    *[client.generate(prompt.input_ids, sampling) for _ in range(n)]
                )
            texts = [tok.decode(o.output_ids, skip_special_tokens=True) for o in outs]
            return int(sum(await rewards.score_many(texts, prompt.answer)))

        try:
            correct = await asyncio.gather(*[one(p) for p in prompts])
        finally:
            await rewards.aclose()
    scores = [pass_at_k(n, c, opts.k) for c in correct]
    return {
        "weights": weights,
        "split": opts.split,
        "problems": len(prompts),
        "samples_per_problem": n,
        "decoding": "greedy" if greedy else f"temperature {r.temperature}",
        f"pass@{opts.k}": sum(scores) / len(scores) if scores else 0.0,
        "accuracy": sum(correct) / (n * len(prompts)) if prompts else 0.0,
        "reward_failures": rewards.stats.failures,
    }
