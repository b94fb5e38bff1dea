"""What the CPU-per-phase scripts (trainer_step_cpu.py, engine_step_cpu.py) share: a
timer of a function's thread CPU time, the heap flag, and the JSON answer on stdout."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Callable
from typing import Any


def timed(table: dict[str, float], name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn`, adding its calls' CPU time on the calling thread to table[name]."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            table[name] += time.thread_time() - t0

    return wrapper


def add_heap_flag(p: argparse.ArgumentParser, who: str) -> None:
    p.add_argument(
        "--default-heap",
        action="store_true",
        help=f"glibc's heap defaults (not keep_heap, which {who} sets)",
    )


def one_thread(args: argparse.Namespace) -> None:
    """One torch thread, and the heap kept unless --default-heap."""
    import torch

    torch.set_num_threads(1)
    if not args.default_heap:
        from areal_hex.heap import keep_heap

        keep_heap()


def answer(run: Callable[[argparse.Namespace], Any], args: argparse.Namespace) -> None:
    """Print run(args) as JSON on stdout; what it prints goes to stderr."""
    with contextlib.redirect_stdout(sys.stderr):
        out = run(args)
    print(json.dumps(out, indent=1))
