"""A bench on a box (`bench hetero`, `bench tasks`, `bench modes --box`): the box brought
up, the job's initial weights written once, the kinds profiled or a profile reused, and
the box taken down at the end, whatever ends the bench (SIGTERM ends it as Ctrl-C does).
What each bench plans and runs on it is its own module's."""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class BoxSession:
    spec: Any  # hexctl.box.spec.Box
    state: Any  # hexctl.box.emulate.BoxState
    out: Path  # the bench's directory: initial weights, profile, plans, runs
    overrides: list[str]  # the job's, with the steps, the box and the initial weights
    load_start: float  # the machine's load average when the box came up

    def profile(self, args: argparse.Namespace, say: Callable[[str], None]) -> Any:
        """The box profile's files: `--profile-dir`'s, else the kinds profiled now."""
        from areal_hex.config import load_config
        from hexctl.box.profile import profile_box
        from hexctl.job.predict import LocalProfileFiles

        if args.profile_dir:
            return LocalProfileFiles(Path(args.profile_dir).resolve())
        cfg = load_config(args.config, self.overrides)
        return profile_box(cfg, self.spec, self.state, self.out / "profile", None, say=say)


@contextlib.contextmanager
def box_session(args: argparse.Namespace, spec: Any, prefix: str) -> Iterator[BoxSession]:
    """The box `spec` up for the bench `args` describe (`--config`, `--steps`,
    `--output-dir`, overrides), down when it ends. Every refusal comes before this."""
    from hexctl.bench.system import scratch_dir
    from hexctl.bench.system.e2e import initial_weights
    from hexctl.box import emulate as box
    from hexctl.job.processes import sigterm_as_ctrl_c

    # SIGTERM (a scheduler's stop, `kill`) ends the bench as Ctrl-C does: through the
    # `finally` below, which takes the box down
    sigterm_as_ctrl_c()
    overrides = [*args.overrides, f"trainer.total_steps={args.steps}", f"run.box={spec.name}"]
    load_start = os.getloadavg()[0]
    state = box.up(spec)
    try:
        with scratch_dir(prefix, args.output_dir) as scratch:
            out = Path(scratch).resolve()
            v0 = initial_weights(args.config, overrides, out / "initial")
            overrides.append(f"model.path={v0}")
            yield BoxSession(spec, state, out, overrides, load_start)
    finally:
        box.down(spec.name)
