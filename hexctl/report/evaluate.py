"""`areal-hex eval`: score a published weights version on a dataset split.

pass@1 is greedy decoding (one answer per problem); pass@k draws k samples per problem at
`rollout.temperature` and counts a problem solved if any of them is right. Every problem
of the split is in the denominator: a prompt over `data.max_prompt_tokens`
(`skipped_overlong`) or one the server refuses as too long for its context
(`refused`, HTTP 400) scores 0 and is counted, so `problems` is always the split's size.
Prompts come from the controller's data module and answers are checked by its reward
function in `rollout.reward_workers` processes, served by the same inference server code
the run uses (a built-in server started here with the weights, or a running server given
by URL).
"""

from __future__ import annotations

import asyncio
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from areal_hex.config import ExperimentConfig
from areal_hex.run_files import RunPaths, version_dir, versions_in


class EvalError(ValueError):
    """Bad eval input (weights not found, empty split); the message says what and where."""


@dataclass
class EvalOptions:
    weights: str | None  # a directory, "latest", "vN" or "N" (None: --server-url as is)
    split: str | None = None  # default: data.eval_split
    k: int = 1
    n: int | None = None  # at most this many problems
    server_url: str | None = None
    concurrency: int = 64
    skipped: int = 0  # problems of the split never sent (prompt too long): scored 0


def weights_root(cfg: ExperimentConfig) -> Path:
    if cfg.inference.weights_dir:
        return Path(cfg.inference.weights_dir)
    if cfg.run.run_id is None:
        raise EvalError(
            "--weights names a version but the config has no run (pass the run directory's "
            "config.yaml, or a weights directory)"
        )
    return RunPaths.of(cfg).weights_dir


def resolve_weights(cfg: ExperimentConfig, spec: str) -> tuple[Path, str]:
    """(directory, version label) for `spec`: a directory, `latest`, `vN` or `N`."""
    p = Path(spec)
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise EvalError(f"--weights {spec}: no config.json in that directory (not HF format)")
        label = p.name[1:] if p.name[:1] == "v" and p.name[1:].isdigit() else p.name
        return p, label
    root = weights_root(cfg)
    have = versions_in(root, complete_only=True)
    if spec == "latest":
        if not have:
            raise EvalError(f"--weights latest: no published versions in {root}")
        v = have[-1]
    else:
        digits = spec[1:] if spec.startswith("v") else spec
        if not digits.isdigit():
            raise EvalError(
                f"--weights {spec!r}: expected a weights directory, 'latest', 'vN' or 'N'"
            )
        v = int(digits)
        if v not in have:
            raise EvalError(f"--weights {spec}: version {v} not in {root} (have {have or 'none'})")
    return version_dir(root, v), str(v)


def pass_at_k(correct: list[list[bool]]) -> float:
    """Fraction of problems with at least one correct sample."""
    return sum(any(c) for c in correct) / max(len(correct), 1)


async def _score_all(
    url: str,
    api_key: str | None,
    prompts: list[Any],
    cfg: ExperimentConfig,
    opts: EvalOptions,
    decode: Any,
) -> dict[str, Any]:
    from areal_hex.api import SamplingParams
    from areal_hex.rewards import RewardPool
    from rollout_service.client import GenerationError, InferenceClient

    ro = cfg.rollout
    greedy = SamplingParams(max_new_tokens=ro.max_new_tokens, temperature=0.0)
    sampled = SamplingParams(
        max_new_tokens=ro.max_new_tokens, temperature=ro.temperature, top_p=ro.top_p, top_k=ro.top_k
    )
    sem = asyncio.Semaphore(opts.concurrency)
    rewards = RewardPool(ro.reward_workers, ro.reward_timeout_s)
    await rewards.start()
    refused: set[str] = set()
    async with InferenceClient(url, api_key=api_key, timeout_s=ro.request_timeout_s) as client:

        async def one(prompt: Any, sp: SamplingParams, rid: str) -> float:
            async with sem:
                try:
                    res = await client.generate(prompt.input_ids, sp, rid=rid)
                except GenerationError as exc:
                    if exc.status != 400:  # only a refusal is an answer; outages surface
                        raise
                    refused.add(prompt.id)
                    return 0.0
            return await rewards.score(decode(res.output_ids), prompt.answer)

        try:
            first = await asyncio.gather(
                *[one(p, greedy, f"eval-{i}-g") for i, p in enumerate(prompts)]
            )
            samples: list[list[float]] = []
            if opts.k > 1:
                flat = await asyncio.gather(
                    *[
                        one(p, sampled, f"eval-{i}-s{j}")
                        for i, p in enumerate(prompts)
                        for j in range(opts.k)
                    ]
                )
                samples = [list(flat[i * opts.k : (i + 1) * opts.k]) for i in range(len(prompts))]
            version = await client.weight_version()
        finally:
            await rewards.aclose()
    # problems skipped before generation count as wrong: the denominator is the split
    total = len(prompts) + opts.skipped
    out: dict[str, Any] = {
        "pass@1": sum(first) / max(total, 1),
        "weight_version": version,
        "refused": len(refused),
    }
    if samples:
        rows = [[s > 0 for s in row] for row in samples] + [[False]] * opts.skipped
        out[f"pass@{opts.k}"] = pass_at_k(rows)
        out["sampled_accuracy"] = sum(map(sum, samples)) / (total * opts.k)
    return out


def evaluate(cfg: ExperimentConfig, opts: EvalOptions) -> dict[str, Any]:
    """Score the weights of `opts` on the split; returns the result object."""
    from areal_hex.data import build_prompts, load_problems
    from areal_hex.models import build_tokenizer, load_tokenizer

    if opts.k < 1:
        raise EvalError(f"--k {opts.k}: expected k >= 1")
    if opts.weights is None and opts.server_url is None:
        raise EvalError("give --weights (a directory or version) or --server-url")
    split = opts.split or cfg.data.eval_split
    weights_dir, label = (None, None)
    if opts.weights is not None:
        weights_dir, label = resolve_weights(cfg, opts.weights)
    tok_path = weights_dir or cfg.model.tokenizer_path or cfg.model.path
    tokenizer = load_tokenizer(tok_path) if tok_path else build_tokenizer()
    problems = load_problems(cfg.data, split)
    if opts.n is not None:
        problems = problems[: opts.n]
    built = build_prompts(problems, tokenizer, cfg.data)
    prompts = built.prompts
    opts = replace(opts, skipped=built.skipped_overlong)
    t0 = time.perf_counter()
    with _server(cfg, weights_dir, label, opts.server_url) as url:
        scores = asyncio.run(
            _score_all(
                url,
                cfg.inference.api_key,
                prompts,
                cfg,
                opts,
                lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
            )
        )
    return {
        "weights": str(weights_dir) if weights_dir else opts.server_url,
        "version": label if label is not None else scores["weight_version"],
        "dataset": cfg.data.dataset,
        "split": split,
        "problems": len(problems),
        "skipped_overlong": built.skipped_overlong,
        "k": opts.k,
        **{k: v for k, v in scores.items() if k != "weight_version"},
        "seconds": round(time.perf_counter() - t0, 2),
    }


def _server(
    cfg: ExperimentConfig, weights: Path | None, label: str | None, url: str | None
) -> AbstractContextManager[str]:
    """A running server's URL as is, or a built-in server on a free port with `weights`."""
    if url is not None and weights is None:
        return nullcontext(url)
    if url is not None:
        raise EvalError("give either --server-url (a server as it runs) or --weights, not both")
    from rollout_service.server.main import ServerThread, build_server_app

    assert weights is not None
    model = cfg.model.model_copy(update={"path": str(weights), "tokenizer_path": None})
    inf = cfg.inference.model_copy(
        update={"weight_version": label or "0", "device": cfg.inference.device, "api_key": None}
    )
    cfg.inference.api_key = None  # the local server is open; the client sends no token
    return ServerThread(build_server_app(model, inf))


def format_table(result: dict[str, Any]) -> str:
    width = max(len(k) for k in result)
    return "\n".join(
        f"{k:<{width}}  {v:.4f}" if isinstance(v, float) else f"{k:<{width}}  {v}"
        for k, v in result.items()
    )
