"""Host steadiness: how far this machine's own speed moves over a run's length.

The same fixed work on one thread (a 256 x 256 float32 matmul for `--probe` seconds, then
a pure-Python loop) is timed every `--every` seconds for `--seconds`, with nothing else of
ours running. Each sample is a rate (matmul GFLOP/s, Python loop M iterations/s); the
baseline is the run's own median. Averaged over windows of `--window` seconds (a plan's
run in `bench hetero` lasts about 80 s), the spread of the window means is the part of a
measured rate that no cost model can predict: on a shared virtual machine the host's
other tenants take cores away from one minute to the next, invisibly (no steal time is
reported). Run it alone, on a quiet machine, before trusting a fidelity figure there.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from typing import Any

LOOP_ITERATIONS = 2_000_000


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seconds", type=float, default=300.0, help="how long to sample")
    p.add_argument("--every", type=float, default=5.0, help="seconds from one sample to the next")
    p.add_argument("--probe", type=float, default=1.0, help="seconds of matmul per sample")
    p.add_argument("--window", type=float, default=80.0, help="seconds averaged per window")


def _check(args: argparse.Namespace) -> None:
    for name in ("seconds", "every", "probe", "window"):
        if getattr(args, name) <= 0:
            sys.exit(f"areal-hex bench host: --{name} must be above 0, got {getattr(args, name)}")
    if args.probe >= args.every:
        sys.exit(
            f"areal-hex bench host: --probe ({args.probe} s) must be shorter than --every "
            f"({args.every} s): a sample's work has to fit between two samples"
        )


def sample(probe_s: float, threads: int = 1) -> tuple[float, float]:
    """(matmul GFLOP/s over `probe_s` on `threads` threads, Python loop M iterations/s)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(256, 256), torch.randn(256, 256)
        for _ in range(5):
            a @ b
        n, t0 = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - t0) < probe_s:
            for _ in range(20):
                a @ b
            n += 20
        gflops = n * 2 * 256**3 / elapsed / 1e9
    finally:
        torch.set_num_threads(before)
    x, t0 = 0, time.perf_counter()
    for i in range(LOOP_ITERATIONS):
        x += i
    return gflops, LOOP_ITERATIONS / 1e6 / (time.perf_counter() - t0)


def windows(
    samples: list[dict[str, float]], key: str, window_s: float, every_s: float
) -> list[float]:
    """Means of `key` over every window of `window_s` seconds that starts at a sample and
    lies within the run (one mean of everything if the run is shorter than a window)."""
    end = samples[-1]["t"] + every_s
    starts = [s["t"] for s in samples if s["t"] + window_s <= end + 1e-9] or [samples[0]["t"]]
    return [statistics.mean(x[key] for x in samples if t <= x["t"] < t + window_s) for t in starts]


def spread(values: list[float]) -> dict[str, float]:
    mid = statistics.median(values)
    return {
        "median": mid,
        "min": min(values),
        "max": max(values),
        "low": min(values) / mid - 1,
        "high": max(values) / mid - 1,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    _check(args)
    import torch  # noqa: F401  (imported before the clock starts)

    samples: list[dict[str, float]] = []
    start = time.perf_counter()
    while (t := time.perf_counter() - start) < args.seconds:
        gflops, loop = sample(args.probe)
        samples.append({"t": t, "matmul_gflops": gflops, "python_m_per_s": loop})
        if not args.json:
            print(
                f"bench host: {t:5.0f} s  matmul {gflops:6.1f} GFLOP/s  python {loop:5.1f} M/s",
                file=sys.stderr,
                flush=True,
            )
        # the next sample on the grid of `--every` (one that ran long skips a slot)
        late = time.perf_counter() - start
        time.sleep(max(0.0, math.floor(late / args.every + 1) * args.every - late))
    out: dict[str, Any] = {"seconds": args.seconds, "every_s": args.every, "window_s": args.window}
    for key in ("matmul_gflops", "python_m_per_s"):
        values = [s[key] for s in samples]
        out[key] = {
            "samples": spread(values),
            "windows": spread(windows(samples, key, args.window, args.every)),
        }
    out["samples"] = [{k: round(v, 3) for k, v in s.items()} for s in samples]
    return out
