"""Bytes per sample on the head node's flows for a job, measured on the real parts.

    python scripts/wire_bytes.py examples/box/tiny_box.yaml --groups 40

Starts the built-in inference server on the job's model, sends N of the job's prompts
as groups through the real client (rollout_service/client.py: one batched /generate
per group), records each call's request and response bodies, encodes each group as the
controller writes it (areal_hex/buffer/codec.py), and fits per flow bytes = a per sample
+ b per prompt token + c per output token (least squares). The cost model's constants
(`CostConstants.http_*`, `record_*`, scheduler/workload.py) come from this.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from areal_hex.api import SamplingParams
from areal_hex.buffer.codec import encode_group
from areal_hex.config import ExperimentConfig, ModelConfig, load_config
from areal_hex.data import Prompt, build_prompts, load_problems
from areal_hex.models import load_tokenizer, materialize
from areal_hex.record import Completion, GroupRecord
from rollout_service.client import InferenceClient
from rollout_service.server.main import ServerThread, build_server_app


def _record(cfg: ExperimentConfig, pr: Prompt, res: list[Any], texts: list[str], url: str):
    def versions(r: Any) -> np.ndarray:
        vs = r.token_versions or [r.weight_version] * len(r.output_ids)
        return np.array([v or 0 for v in vs], dtype=np.int32)

    return GroupRecord(
        prompt_id=pr.id,
        prompt_ids=pr.input_ids,
        completions=[
            Completion(
                np.array(r.output_ids, dtype=np.int32),
                np.array(r.logprobs, dtype=np.float32),
                versions(r),
                r.finish_reason,
                1.0,
                text,
                url,
                "kind",
            )
            for r, text in zip(res, texts, strict=True)
        ],
        temperature=cfg.rollout.temperature,
        created_at=1.7e9,
        finished_at=1.7e9,
        metadata={"seq": "0", "epoch": "0", "put_token": "1a2b3c4d-0", "answer": pr.answer},
    )


async def _measure(cfg: ExperimentConfig, url: str, prompts: list[Prompt], tok: Any) -> list:
    rows, sent = [], []
    g = cfg.rollout.group_size
    sp = SamplingParams(
        max_new_tokens=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature
    )
    async with InferenceClient(url) as c:
        call = c._call

        async def recorded(method: str, path: str, body: Any = None, timeout: Any = ...) -> Any:
            r = await call(method, path, body, timeout)
            if path == "/generate":  # the client's body as aiohttp sends it (json.dumps)
                sent.append((len(json.dumps(body).encode()), len(r.content)))
            return r

        c._call = recorded  # type: ignore[method-assign]
        for i, pr in enumerate(prompts):
            res = await c.generate_batch(
                [list(pr.input_ids)] * g, sp, [f"r{i}_{j}" for j in range(g)]
            )
            texts = [tok.decode(r.output_ids, skip_special_tokens=True) for r in res]
            record = len(encode_group(_record(cfg, pr, res, texts, url)))
            tokens = sum(len(r.output_ids) for r in res)
            rows.append((len(pr.input_ids), tokens, *sent[-1], record))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config")
    ap.add_argument("--groups", type=int, default=40)
    args = ap.parse_args()
    cfg = load_config(args.config)
    model = materialize(cfg.model, Path(tempfile.mkdtemp()) / "v0")
    tok = load_tokenizer(model)
    prompts = build_prompts(load_problems(cfg.data, "train"), tok, cfg.data).prompts
    app = build_server_app(ModelConfig(path=str(model)), cfg.inference)
    with ServerThread(app) as url:
        rows = asyncio.run(_measure(cfg, url, prompts[: args.groups], tok))
    a, g = np.array(rows, dtype=float), cfg.rollout.group_size
    x = np.stack([np.full(len(a), g), a[:, 0] * g, a[:, 1]], axis=1)
    for col, name in ((2, "request"), (3, "response"), (4, "record")):
        coef = np.linalg.lstsq(x, a[:, col], rcond=None)[0]
        print(
            f"{name}: {coef[0]:.1f} B per sample, {coef[1]:.2f} per prompt token and sample, "
            f"{coef[2]:.2f} per output token; {a[:, col].mean():.0f} B per group"
        )
    print(
        f"{len(a)} groups of {g}: {a[:, 0].mean():.1f} prompt tokens, "
        f"{a[:, 1].mean() / g:.2f} output tokens per sample"
    )


if __name__ == "__main__":
    main()
