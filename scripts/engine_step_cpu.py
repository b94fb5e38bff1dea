"""CPU seconds of the built-in inference server per 1000 generated tokens, by part, at
the README job's shape (examples/tiny_cpu.yaml): groups of 16 samples of one ~34-token
chat prompt, one `/generate` call per group as the controller sends it, up to 24 groups
in flight, temperature 1.2, up to 24 new tokens, 64 running requests. The server runs
in this process (uvicorn on a loopback port, the engine's step-loop thread, one torch
thread); the load generator runs here too, and its thread is not counted. CPU time per
thread (/proc), not wall time, so a busy machine does not skew it.

    python scripts/engine_step_cpu.py MODEL_DIR [--groups 120] [--repeats 3] [--default-heap]
        [--max-running 64] [--min-admit N]

MODEL_DIR: an HF directory of the job's model (a run's weights/v0, or the cached v0).
Prints one JSON object: per repeat and the median, CPU s per 1000 generated tokens of
prefill, decode forward, sampling, upkeep (new rows into the running batch, `admit`, and
finished ones out, `remove`), advance (appending each token to its request and checking
its stop rules), scheduling (the rest of the step loop), HTTP/JSON (the uvicorn thread
less the tokenizer) and tokenizer (decoding the outputs' text), and the process's minor
page faults per 1000 tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from cpu_parts import add_heap_flag, answer, one_thread, timed

PARTS = (
    "prefill",
    "decode",
    "sampling",
    "upkeep",
    "advance",
    "scheduling",
    "http_json",
    "tokenizer",
)


def _thread_cpu(tid: int) -> float:
    """CPU seconds (user + system) of thread `tid` of this process."""
    with open(f"/proc/self/task/{tid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _minor_faults() -> int:
    """Minor page faults of this process so far (a fresh mapping faults each page in)."""
    with open("/proc/self/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])


def _instrument(table: dict[str, float]) -> None:
    """Time the engine's parts on the thread that runs them."""
    from rollout_service.server import batching, generate_routes, step_loop

    step_loop.batching.prefill_keep = timed(table, "prefill", batching.prefill_keep)
    step_loop.batching.decode_step = timed(table, "decode", batching.decode_step)
    step_loop.Core._sample = timed(table, "sampling", step_loop.Core._sample)
    step_loop.batching.admit = timed(table, "upkeep", batching.admit)
    step_loop.batching.remove = timed(table, "upkeep", batching.remove)
    step_loop.Core._advance = timed(table, "advance", step_loop.Core._advance)
    step_loop.Core.tick = timed(table, "tick", step_loop.Core.tick)
    generate_routes.trimmed_text = timed(table, "tokenizer", generate_routes.trimmed_text)


def _prompts(tokenizer: Any, n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(0, 19), rng.randint(0, 19)
        msgs = [{"role": "user", "content": f"What is {a} + {b}?"}]
        text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        out.append(list(tokenizer(text, add_special_tokens=False)["input_ids"]))
    return out


async def _load(url: str, prompts: list[list[int]], concurrent: int, group: int) -> int:
    """Send one group per prompt, `concurrent` at a time; returns the generated tokens."""
    from areal_hex.api import SamplingParams
    from rollout_service.client import InferenceClient

    sampling = SamplingParams(max_new_tokens=24, temperature=1.2)
    todo = iter(enumerate(prompts))
    tokens = 0
    async with InferenceClient(url, max_inflight=concurrent) as client:

        async def worker() -> None:
            nonlocal tokens
            for i, p in todo:
                rids = [f"g{i}-{j}-{time.monotonic_ns()}" for j in range(group)]
                res = await client.generate_batch([p] * group, sampling, rids)
                tokens += sum(len(r.output_ids) for r in res)

        await asyncio.gather(*(worker() for _ in range(concurrent)))
    return tokens


def _engine_tid(name: str) -> int:
    for t in threading.enumerate():
        if t.name == name and t.native_id is not None:
            return t.native_id
    raise RuntimeError(f"no thread {name!r}")


def _repeat(url: str, server: Any, prompts: list[list[int]], table: dict[str, float]) -> dict:
    ids = {"engine": _engine_tid("engine-scheduler"), "http": server.thread.native_id}
    before = {k: _thread_cpu(v) for k, v in ids.items()}
    faults = _minor_faults()
    table.clear()
    tokens = asyncio.run(_load(url, prompts, 24, 16))
    cpu = {k: _thread_cpu(v) - before[k] for k, v in ids.items()}
    faults = _minor_faults() - faults
    t = dict(table)
    per = 1000.0 / tokens
    engine_rest = t["tick"] - t["prefill"] - t["decode"] - t["sampling"]
    engine_rest -= t["upkeep"] + t["advance"]
    out = {
        "prefill": t["prefill"],
        "decode": t["decode"],
        "sampling": t["sampling"],
        "upkeep": t["upkeep"],
        "advance": t["advance"],
        "scheduling": engine_rest + max(0.0, cpu["engine"] - t["tick"]),
        "http_json": cpu["http"] - t["tokenizer"],
        "tokenizer": t["tokenizer"],
    }
    res = {k: round(v * per, 4) for k, v in out.items()}
    res["total"] = round(sum(out.values()) * per, 4)
    res["tokens"] = tokens
    res["minor_faults"] = round(faults * per)  # the load generator's included
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model_dir", type=Path)
    p.add_argument("--groups", type=int, default=120, help="groups per repeat")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--port", type=int, default=0, help="loopback port (0: any free one)")
    p.add_argument(
        "--max-running", type=int, default=64, help="inference.max_running_requests (the job's: 64)"
    )
    p.add_argument(
        "--min-admit", type=int, default=None, help="inference.min_admit (the job's: unset)"
    )
    add_heap_flag(p, "a CPU server")
    answer(_run, p.parse_args())


def _run(args: argparse.Namespace) -> dict[str, Any]:
    one_thread(args)  # as `serve` runs a CPU server (with --num-threads 1)
    from areal_hex.config import InferenceConfig, ModelConfig
    from rollout_service.server.app import create_app
    from rollout_service.server.main import ServerThread, build_engine, server_settings

    table: dict[str, float] = defaultdict(float)
    _instrument(table)
    inf = InferenceConfig(
        max_running_requests=args.max_running,
        min_admit=args.min_admit,
        context_length=128,
        num_threads=1,
    )
    model_cfg = ModelConfig(path=str(args.model_dir))
    engine = build_engine(model_cfg, inf)
    app = create_app(engine, server_settings(model_cfg, inf))
    runs = []
    server = ServerThread(app, port=args.port)
    with server as url:
        prompts = _prompts(engine.tokenizer, args.groups * (args.repeats + 1), 0)
        asyncio.run(_load(url, prompts[: args.groups // 4], 24, 16))  # warm-up
        for r in range(args.repeats):
            part = prompts[(r + 1) * args.groups : (r + 2) * args.groups]
            runs.append(_repeat(url, server, part, table))
    median = {k: statistics.median(r[k] for r in runs) for k in (*PARTS, "total", "minor_faults")}
    return {"unit": "CPU s per 1000 generated tokens", "median": median, "runs": runs}


if __name__ == "__main__":
    main()
