"""Context switches leak nothing: one synchronous run of the job in a placement that
shares devices (colocated: the servers release and resume their memory each step;
hybrid: the lent servers pause and continue), with `--switches` steps, each one switch.
While it runs, the resident memory (RSS) of every server and of the trainer's rank is
sampled; each sample is placed by the steps done so far (the controller's rows).
A process's level is the median RSS over the early switches (after `--settle` of them:
imports, first batches and allocator pools are done) and over the last tenth of them;
it holds when the growth stays within the tolerance (`--tolerance-mib`, or
`--tolerance-pct` of the level, whichever is larger). Requests: those the controller
sent, retried and aborted, and the groups it made against those the run asks for (none
lost: none retried, aborted or failed, and every group made). The baseline, in the same
invocation: the same steps disaggregated (no switch), for what each process grows
anyway (a checkpoint's buffers, the allocator); a process holds when its growth beyond
the baseline's is within the tolerance."""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hexctl.bench.system import DEFAULT_CONFIG, scratch_dir

SAMPLE_S = 0.1  # between two RSS samples
ROW_S = 0.25  # the controller's metrics interval in the run: finer placing of samples


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=DEFAULT_CONFIG, help="experiment YAML (default: tiny)")
    p.add_argument("--switches", type=int, default=50, help="steps of the run, one switch each")
    p.add_argument(
        "--placement",
        choices=("colocated", "hybrid"),
        default="colocated",
        help="colocated (release/resume) or hybrid (the lent servers pause); both sync",
    )
    p.add_argument("--settle", type=int, default=5, help="switches before the first level")
    p.add_argument("--tolerance-mib", type=float, default=16.0, help="growth allowed, MiB")
    p.add_argument("--tolerance-pct", type=float, default=3.0, help="growth allowed, %% of level")
    p.add_argument("--output-dir", default=None, help="keep the run directory here")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides")


@dataclass
class RssSampler:
    """Samples (time, RSS bytes) of this process's descendants: the servers
    (`areal-hex serve ... --index i`) and the trainer's rank, by role."""

    samples: dict[str, list[tuple[float, int]]] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        import psutil

        me = psutil.Process()
        while not self._stop.wait(SAMPLE_S):
            for proc in me.children(recursive=True):
                try:
                    name = _role(proc.cmdline())
                    if name is not None:
                        rss = proc.memory_info().rss
                        self.samples.setdefault(name, []).append((time.time(), rss))
                except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                    continue

    def stop(self) -> None:
        self._stop.set()


def _role(argv: list[str]) -> str | None:
    """ "trainer" (a rank: `trainer_service.main` as the launcher starts it, not the
    launcher itself), "server i", or None for any other process of the run."""
    if "trainer_service.main" in argv:
        launcher = any("launcher" in a or "distributed.run" in a for a in argv)
        return None if launcher else "trainer"
    if "hexctl.cli" not in argv:
        return None
    rest = argv[argv.index("hexctl.cli") + 1 :]
    if rest[:1] == ["serve"] and "--index" in rest:
        return f"server {rest[rest.index('--index') + 1]}"
    return None


def steps_at(rows: list[tuple[float, int]], t: float) -> int:
    """The steps counted by the last row at or before `t` (rows: (time, steps))."""
    n = 0
    for when, count in rows:
        if when > t:
            break
        n = count
    return n


def levels(
    samples: list[tuple[float, int]],
    rows: list[tuple[float, int]],
    settle: int,
    total: int,
    tol_mib: float,
    tol_pct: float,
) -> dict[str, Any]:
    """A process's RSS level early (switches settle..2·settle) and late (the last tenth
    of `total`), in MiB, and whether the growth is within the tolerance."""
    early_hi, late_lo = 2 * settle, max(2 * settle + 1, total - max(1, total // 10))
    early = [r for t, r in samples if settle <= steps_at(rows, t) <= early_hi]
    late = [r for t, r in samples if steps_at(rows, t) >= late_lo]
    if not early or not late:
        return {"samples": len(samples), "error": "too few samples in a window"}
    before, after = statistics.median(early) / 2**20, statistics.median(late) / 2**20
    growth = after - before
    allowed = max(tol_mib, before * tol_pct / 100)
    # a leak grows with every switch; a one-off (a checkpoint's buffers) steps once
    placed = [(steps_at(rows, t), r / 2**10) for t, r in samples]
    settled = [(n, kib) for n, kib in placed if n >= settle]
    slope = None
    if len({n for n, _ in settled}) > 1:
        slope = statistics.linear_regression(*zip(*settled, strict=True)).slope
    return {
        "rss_before_mib": round(before, 2),
        "rss_after_mib": round(after, 2),
        "growth_mib": round(growth, 2),
        "slope_kib_per_switch": None if slope is None else round(slope, 1),
        "allowed_mib": round(allowed, 2),
        "window_switches": [[settle, early_hi], [late_lo, total]],
        "samples": [len(early), len(late)],
        "holds": growth <= allowed,
    }


def requests(final: dict[str, Any], expected_groups: int) -> dict[str, Any]:
    """What the controller sent and got back, from its final row."""
    reasons = final.get("finish_reasons") or {}
    made = int(final.get("groups_produced_total", 0))
    out = {
        "requests_sent": int(final.get("requests_total", 0)),
        "samples_answered": int(sum(reasons.values())),
        "requests_retried": int(final.get("requests_retried_total", 0)),
        "requests_aborted": int(final.get("requests_aborted_total", 0)),
        "groups_failed": int(final.get("groups_failed_total", 0)),
        "groups_made": made,
        "groups_expected": expected_groups,
    }
    out["none_lost"] = (
        out["requests_retried"] == 0
        and out["requests_aborted"] == 0
        and out["groups_failed"] == 0
        and made >= expected_groups
    )
    return out


def _step_rows(run_dir: Path) -> tuple[list[tuple[float, int]], dict[str, Any]]:
    """(time, steps done: the version served, one a step) of every controller row, and
    the final row."""
    from areal_hex.run_files import RolloutRow, RunPaths, read_rows

    rows = read_rows(RunPaths.at(run_dir).rollout, RolloutRow)
    if not rows:
        return [], {}
    return [(r.time, r.version) for r in rows], rows[-1].model_dump()


@dataclass
class Measured:
    samples: dict[str, list[tuple[float, int]]]  # process -> (time, RSS)
    rows: list[tuple[float, int]]  # (time, steps done)
    final: dict[str, Any]  # the controller's last row
    groups_per_step: int


def measured_run(args: argparse.Namespace, name: str, overrides: list[str], out: str) -> Measured:
    """The run of mode `name` (`bench modes`' names) with its processes' RSS sampled."""
    from areal_hex.config import load_config
    from hexctl.bench.system import check_run
    from hexctl.bench.system.e2e import fresh_run_dir
    from hexctl.bench.system.modes import MODES, lent_overrides
    from hexctl.job.prepare import prepare_run
    from hexctl.launch.run import execute

    mode = MODES[name]
    extra = [f"run.output_dir={out}", f"run.run_id=switching-{name}", "run.progress=log"]
    extra.append(f"rollout.metrics_interval_s={ROW_S}")
    # each process's own memory, found by its command line: forked services would share
    # their parent's pages and carry its command line
    extra.append("run.fork_services=false")
    lent = lent_overrides(args.config, overrides, mode)
    cfg = load_config(args.config, [*overrides, *lent, *mode.overrides(), *extra])
    fresh_run_dir(cfg.run.run_dir())
    cfg, path = prepare_run(cfg, None, mode.run_mode)
    sampler = RssSampler()
    thread = threading.Thread(target=sampler.run, daemon=True)
    thread.start()
    try:
        result = execute(cfg, path, None, progress=False)
    finally:
        sampler.stop()
        thread.join()
    check_run(result, f"the {name} run")
    rows, final = _step_rows(cfg.run.run_dir())
    return Measured(sampler.samples, rows, final, cfg.buffer.groups_per_step)


def _levels(args: argparse.Namespace, m: Measured) -> dict[str, dict[str, Any]]:
    tol = (args.tolerance_mib, args.tolerance_pct)
    return {
        name: levels(s, m.rows, args.settle, args.switches, *tol)
        for name, s in sorted(m.samples.items())
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    from areal_hex.config import ConfigError
    from hexctl.bench.system.e2e import initial_weights

    if args.switches < 4 * args.settle:
        raise ConfigError(
            f"--switches {args.switches} with --settle {args.settle}: expected at least "
            f"{4 * args.settle} switches, so that the early and late windows are apart"
        )
    name = f"{args.placement}-sync"  # synchronous: one switch every step
    overrides = [*args.overrides, f"trainer.total_steps={args.switches}"]
    with scratch_dir("areal-hex-bench-switching-", args.output_dir) as out:
        if not any(o.startswith("model.path=") for o in overrides):
            overrides.append(f"model.path={initial_weights(args.config, overrides, Path(out))}")
        shared = measured_run(args, name, overrides, out)
        # the baseline: the same steps with no switch, for what the processes grow anyway
        apart = measured_run(args, "disaggregated-sync", overrides, out)
    procs, base = _levels(args, shared), _levels(args, apart)
    for p, lv in procs.items():
        b = base.get(p, {}).get("growth_mib")
        lv["baseline_growth_mib"] = b
        if b is not None and "growth_mib" in lv:
            lv["growth_beyond_baseline_mib"] = round(lv["growth_mib"] - b, 2)
            lv["holds"] = lv["growth_beyond_baseline_mib"] <= lv["allowed_mib"]
    got = requests(shared.final, args.switches * shared.groups_per_step)
    switches = int(shared.final.get("context_switches_total", 0))
    spent = shared.final.get("context_switch_s_total") or 0.0
    return {
        "placement": args.placement,
        "run_mode": "sync",
        "steps": args.switches,
        "switches": switches,
        "switch_s_total": spent,
        "switch_s_mean": spent / switches if switches else None,
        "processes": procs,
        "baseline": {"mode": "disaggregated-sync", "processes": base},
        "requests": got,
        "leaks_nothing": bool(procs) and all(p.get("holds") for p in procs.values()),
        "no_request_lost": got["none_lost"],
    }
