"""CPU seconds of the trainer's step, by phase, on one thread: the README job's trainer
(examples/tiny_cpu.yaml's model, DeepSpeed on CPU, one rank) on synthetic groups of the
job's shape. CPU time, not wall time, so a busy machine does not skew it. Besides the
step's phases: decoding the batch's records from their buffer encoding (`decode`), the
step's metrics row (`metrics`), and `process`, the CPU of all the process's threads
over decode, step, publish and metrics (DeepSpeed's and gloo's threads included).

    python scripts/trainer_step_cpu.py MODEL_DIR [--steps 30] [--default-heap] [--profile]

MODEL_DIR: an HF directory of the job's model (a run's weights/v0, or the cached v0).
Prints one JSON object: medians over the steps after the warm-up, per phase.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from cpu_parts import add_heap_flag, answer, one_thread, timed

PHASES = ("prepare", "forward", "loss", "backward", "optimizer", "publish")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model_dir", type=Path)
    p.add_argument("--config", default="examples/tiny_cpu.yaml")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    # a README run's rows: ~34 prompt tokens (chat template), completions of ~19 tokens
    # on average, up to rollout.max_new_tokens (24)
    p.add_argument("--completion", type=int, nargs=2, default=(12, 24), help="length range")
    p.add_argument("--prompt-len", type=int, default=34)
    add_heap_flag(p, "a disaggregated trainer")
    p.add_argument("--profile", action="store_true", help="torch.profiler table of a step")
    answer(_run, p.parse_args())


def _run(args: argparse.Namespace) -> dict[str, Any]:

    one_thread(args)
    from areal_hex.buffer.codec import decode_group, encode_group
    from areal_hex.config import load_config
    from areal_hex.models import load_model
    from trainer_service import step as step_mod
    from trainer_service.engine import build_engine, flush_denormals, init_single_rank
    from trainer_service.publish import full_state_dict, write_model_dir
    from trainer_service.synthetic import synthetic_groups

    cfg = load_config(args.config)
    flush_denormals("cpu")  # as the trainer sets it (trainer_service/main.py)
    init_single_rank("cpu")
    model = load_model(args.model_dir)
    engine = build_engine(model.train(), cfg.trainer, world_size=1)
    t = cfg.trainer
    ctx = step_mod.StepContext(
        engine, cfg.algo, t.micro_batch_tokens, cfg.rollout.max_new_tokens, 0, rank=0,
        world=1, max_new_tokens=cfg.rollout.max_new_tokens,
    )  # fmt: skip
    table: dict[str, float] = defaultdict(float)
    step_mod._prepare = timed(table, "prepare", step_mod._prepare)
    step_mod.token_logprobs = timed(table, "forward", step_mod.token_logprobs)
    step_mod.policy_loss = timed(table, "loss", step_mod.policy_loss)
    engine.backward = timed(table, "backward", engine.backward)
    engine.step = timed(table, "optimizer", engine.step)
    vocab = model.config.vocab_size
    rows: list[dict[str, float]] = []
    tmp = Path(tempfile.mkdtemp())
    for i in range(args.warmup + args.steps):
        groups = synthetic_groups(
            cfg.buffer.groups_per_step, cfg.rollout.group_size, vocab, args.prompt_len,
            tuple(args.completion), seed=i, temperature=cfg.rollout.temperature,
        )  # fmt: skip
        payloads = [encode_group(g) for g in groups]
        table.clear()
        p0 = time.process_time()
        t0 = time.thread_time()
        groups = [decode_group(b) for b in payloads]
        table["decode"] = time.thread_time() - t0
        r0 = resource.getrusage(resource.RUSAGE_THREAD)
        t0 = time.thread_time()
        result = step_mod.optimize(ctx, groups)
        total = time.thread_time() - t0
        r1 = resource.getrusage(resource.RUSAGE_THREAD)
        table["sys"] = r1.ru_stime - r0.ru_stime
        table["minor_faults"] = r1.ru_minflt - r0.ru_minflt
        t1 = time.thread_time()
        tensors = full_state_dict(engine, t.zero_stage, 0)
        assert tensors is not None
        write_model_dir(tensors, args.model_dir, tmp / f"v{i}")
        table["publish"] = time.thread_time() - t1
        t1 = time.thread_time()
        _metrics_row(engine, groups, result, i)
        table["metrics"] = time.thread_time() - t1
        table["process"] = time.process_time() - p0
        table["step"] = total
        table["other"] = total - sum(table[k] for k in PHASES if k != "publish")
        if i >= args.warmup:
            rows.append(dict(table))
    out = {k: round(statistics.median(r[k] for r in rows), 5) for k in rows[0]}
    out["step+publish"] = round(statistics.median(r["step"] + r["publish"] for r in rows), 5)
    out["steps"] = len(rows)
    (Path(tempfile.gettempdir()) / f"trainer_step_cpu_{os.getpid()}.jsonl").unlink()
    if args.profile:
        _profile(step_mod, ctx, vocab, cfg, args)
    return out


def _metrics_row(engine: Any, groups: list, result: Any, step: int) -> None:
    """The trainer's metrics row of a step (loop.Trainer._metrics), written to a file."""
    from types import SimpleNamespace

    from areal_hex.api import Batch
    from areal_hex.run_files import append_row
    from trainer_service.loop import Totals, Trainer

    ids = [f"{step}-{k}" for k in range(len(groups))]
    batch = Batch(entry_ids=ids, groups=groups, version_lags=[0] * len(groups))
    me = SimpleNamespace(state=SimpleNamespace(step=step, version=step, totals=Totals()),
                         ctx=SimpleNamespace(engine=engine))  # fmt: skip
    row = Trainer._metrics(me, batch, result, wait_s=0.0, compute_s=0.05, publish_s=0.0)  # type: ignore[arg-type]
    append_row(Path(tempfile.gettempdir()) / f"trainer_step_cpu_{os.getpid()}.jsonl", row)


def _profile(step_mod: Any, ctx: Any, vocab: int, cfg: Any, args: argparse.Namespace) -> None:
    from torch.profiler import ProfilerActivity, profile

    from trainer_service.synthetic import synthetic_groups

    groups = synthetic_groups(
        cfg.buffer.groups_per_step, cfg.rollout.group_size, vocab, args.prompt_len,
        tuple(args.completion), seed=999,
    )  # fmt: skip
    with profile(activities=[ProfilerActivity.CPU], record_shapes=False) as prof:
        for _ in range(3):
            step_mod.optimize(ctx, groups)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))


if __name__ == "__main__":
    main()
