"""Execution modes: the same job in every placement and staleness mode, from the same v0
for the same steps, in one invocation; each mode's predicted and measured samples/s,
the planner's pick and the measured ranking.

Modes: disaggregated async (the config's η), disaggregated sync, colocated sync, hybrid
async and sync (`workflow.placement`, docs/modes.md; hybrid: the config's servers plus
`workflow.lent_servers` on the trainer's devices). Each runs the config's
`trainer.total_steps` (the README job's 80; `--steps` overrides). Measured: trained
samples/s over the same window of steps in every run, from step η + 1 of the async run
(the config's η) to the last, by the rule a run's own `summary.json` measures its
fidelity with (`hexctl/report/fidelity.py:measured_rates`), so a mode's figure and the
README run's are the same measure; each mode also reports the components it measured
there (training, generation, weight-sync pause, and the mean answer length trained on)
beside those predicted, and the side its host's work ran on (`host_cores`). Predicted:
the cost model's pipeline rate for the run's layout in its mode (`prediction.json`), from
the machine's one profile of the job (`run.profile_first`: the config's unless overridden;
`--profile-first` takes it where this machine has none, before the first mode;
`--profile-fresh` measures one for this invocation only, so that the predictions price
the machine as it is while the modes run, not as it was when it was cached): every
mode keys the same profile (`hexctl/profile/cache.py:profiled_job`), the colocated run
priced from its rates on every core. The planner's pick is the mode with the highest
prediction; `unpredicted` names the modes without one (the pick is then over the rest)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hexctl.bench.system import DEFAULT_CONFIG, scratch_dir


@dataclass(frozen=True)
class Mode:
    placement: str
    run_mode: str

    def overrides(self) -> list[str]:
        return [f"workflow.placement={self.placement}", f"run.mode={self.run_mode}"]


MODES: dict[str, Mode] = {
    "disaggregated-async": Mode("disaggregated", "async"),
    "disaggregated-sync": Mode("disaggregated", "sync"),
    "colocated-sync": Mode("colocated", "sync"),
    "hybrid-async": Mode("hybrid", "async"),
    "hybrid-sync": Mode("hybrid", "sync"),
}


def lent_overrides(config: str, overrides: list[str], mode: Mode) -> list[str]:
    """Hybrid: the config's servers stay on their own devices and the lent ones come on
    top (`inference.num_servers` + `workflow.lent_servers`); other modes: nothing."""
    if mode.placement != "hybrid":
        return []
    from areal_hex.config import load_config

    base = load_config(config, overrides)
    return [f"inference.num_servers={base.inference.num_servers + base.workflow.lent_servers}"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config", default=None, help="experiment YAML (default: tiny; on a box: tiny_box)"
    )
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help="trainer.total_steps of every run (default: the config's, the README job's 80;"
        " box: 60)",
    )
    p.add_argument(
        "--modes",
        default=None,
        help=f"comma-separated subset of {', '.join(MODES)} (default: all; on a box: all "
        "it can run)",
    )
    p.add_argument(
        "--profile-first",
        action="store_true",
        help="profile this machine for each mode's job where it has no profile yet",
    )
    p.add_argument(
        "--profile-fresh",
        action="store_true",
        help="measure the profile anew at the start of this invocation, for its modes only"
        " (the machine's cached profile is neither used nor replaced): every prediction"
        " then prices the machine as it is while the modes run",
    )
    p.add_argument("--output-dir", default=None, help="keep the run directories here")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides")


def chosen_modes(text: str | None) -> list[str]:
    """The modes `--modes` names (None: all)."""
    if text is None:
        return list(MODES)
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in MODES]
    if unknown or not names:
        from areal_hex.config import ConfigError

        raise ConfigError(
            f"--modes {text!r}: unknown {', '.join(unknown) or '(none given)'}: expected a "
            f"comma-separated subset of {', '.join(MODES)}"
        )
    return names


def error(predicted: float | None, measured: float | None) -> float | None:
    """(predicted - measured) / measured, as the fidelity report; None without both."""
    if predicted is None or not measured:
        return None
    return (predicted - measured) / measured


def ranking(rates: dict[str, float | None]) -> list[str]:
    """Names by rate, fastest first; those without a rate are left out."""
    known = {k: v for k, v in rates.items() if v is not None}
    return sorted(known, key=lambda k: (-known[k], k))


def report(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The benchmark's JSON from each mode's {predicted, measured, ...}."""
    modes = {
        name: {
            "predicted_samples_per_s": r.get("predicted"),
            "measured_samples_per_s": r.get("measured"),
            "error": error(r.get("predicted"), r.get("measured")),
            **{k: v for k, v in r.items() if k not in ("predicted", "measured")},
        }
        for name, r in runs.items()
    }
    predicted = ranking({n: r.get("predicted") for n, r in runs.items()})
    measured = ranking({n: r.get("measured") for n, r in runs.items()})
    pick = predicted[0] if predicted else None
    best = measured[0] if measured else None
    pick_rate = runs[pick].get("measured") if pick else None
    best_rate = runs[best].get("measured") if best else None
    return {
        "modes": modes,
        "planner_pick": pick,
        "measured_ranking": measured,
        "predicted_ranking": predicted,
        "unpredicted": [n for n, r in runs.items() if r.get("predicted") is None],
        # the pick's measured rate over the fastest's: 1.0 when the pick is the fastest
        "pick_vs_fastest": (pick_rate / best_rate) if pick_rate and best_rate else None,
    }


def run_mode(
    config: str, overrides: list[str], name: str, out: str, profile_first: bool
) -> dict[str, Any]:
    """One mode's run; its summary's figures."""
    from areal_hex.config import load_config
    from hexctl.bench.system import check_run
    from hexctl.bench.system.e2e import fresh_run_dir
    from hexctl.job.prepare import prepare_run
    from hexctl.launch.run import execute

    mode = MODES[name]
    first = ["run.profile_first=true"] if profile_first else []
    extra = [f"run.output_dir={out}", f"run.run_id=bench-{name}", "run.progress=log"]
    lent = lent_overrides(config, overrides, mode)
    cfg = load_config(config, [*first, *overrides, *lent, *mode.overrides(), *extra])
    fresh_run_dir(cfg.run.run_dir())
    cfg, path = prepare_run(cfg, None, mode.run_mode)
    result = execute(cfg, path, None, progress=False)
    check_run(result, f"the {name} run")
    s = result.summary
    predicted = (s.get("fidelity") or {}).get("predicted") or {}
    return {
        **host_side_of(cfg.run.run_dir()),
        "run_dir": str(cfg.run.run_dir()),
        "max_staleness": s.get("max_staleness"),
        "group_size": s.get("group_size"),
        "steps": s.get("steps"),
        "wall_time_s": s.get("wall_time_s"),
        "final_reward": s.get("final_reward"),
        "predicted": predicted.get("pipeline_samples_per_s"),
        "predicted_components": {k: v for k, v in predicted.items() if k in COMPONENTS},
    }


COMPONENTS = ("generation_samples_per_s", "training_samples_per_s", "weight_sync_s")


def host_side_of(run_dir: Path | str) -> dict[str, Any]:
    """Where the run put Valkey, the controller and its rewards (`host_cores`: trainer
    or inference) and, where `run.host_cores: auto` chose, each side's predicted
    pipeline (`host_cores_candidates`), from its `prediction.json`; {} without one."""
    from areal_hex.run_files import RunPaths

    path = RunPaths.at(Path(run_dir)).prediction
    if not path.is_file():
        return {}
    import json

    pred = json.loads(path.read_text())
    return {k: pred[k] for k in ("host_cores", "host_cores_candidates") if k in pred}


@contextmanager
def invocation_cache(root: Path | None) -> Iterator[None]:
    """With `root`, profiles are looked up and kept under it while the modes run (the
    first mode measures one; the others reuse it); without, the machine's cache."""
    if root is None:
        yield
        return
    before = os.environ.get("AREAL_HEX_CACHE_DIR")
    os.environ["AREAL_HEX_CACHE_DIR"] = str(root)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("AREAL_HEX_CACHE_DIR", None)
        else:
            os.environ["AREAL_HEX_CACHE_DIR"] = before


def window_rates(run_dir: Path, group_size: int, from_step: int) -> dict[str, float | None]:
    """The run's rates from step `from_step` to its last, as its summary's fidelity
    block measures them: the pipeline's and each component's; and the mean answer
    length trained on there (`answer_tokens`)."""
    from dataclasses import asdict

    from areal_hex.run_files import RolloutRow, RunPaths, TrainerRow, read_rows
    from hexctl.report.fidelity import measured_rates

    paths = RunPaths.at(run_dir)
    metrics = read_rows(paths.metrics, TrainerRow)
    rates = measured_rates(metrics, read_rows(paths.rollout, RolloutRow), group_size, from_step)
    return {**asdict(rates), "answer_tokens": trained_answer_tokens(metrics, from_step)}


def trained_answer_tokens(metrics: list[Any], from_step: int) -> float | None:
    """Mean answer length the steps from `from_step` on trained on (completion tokens
    over sequences), beside the length the prediction priced (the profile's
    `workload.yaml`); None without such a step."""
    rows = [r for r in metrics if r.step >= from_step and r.sequences > 0]
    seqs = sum(r.sequences for r in rows)
    return sum(r.completion_tokens for r in rows) / seqs if seqs else None


def run(args: argparse.Namespace) -> dict[str, Any]:
    from hexctl.bench.system.e2e import initial_weights

    args.config = args.config or DEFAULT_CONFIG
    names = chosen_modes(args.modes)
    overrides = list(args.overrides)
    if args.steps is not None:
        overrides.append(f"trainer.total_steps={args.steps}")
    runs: dict[str, dict[str, Any]] = {}
    with scratch_dir("areal-hex-bench-modes-", args.output_dir) as out:
        v0 = initial_weights(args.config, overrides, Path(out) / "initial")
        overrides.append(f"model.path={v0}")
        with invocation_cache(Path(out) / "cache" if args.profile_fresh else None):
            for name in names:
                first = args.profile_first or args.profile_fresh
                runs[name] = run_mode(args.config, overrides, name, out, first)
        # the same window in every run: after the async run's head start of η + 1 steps
        skip = max(int(r["max_staleness"] or 0) for r in runs.values()) + 1
        for r in runs.values():
            rates = window_rates(Path(r.pop("run_dir")), int(r["group_size"]), skip)
            r["measured"] = rates.pop("pipeline_samples_per_s")
            r["measured_components"] = rates
    out_json = report(runs)
    steps = sorted({r.get("steps") for r in runs.values()}, key=str)
    out_json.update(
        {
            "config": args.config,
            "steps": steps[0] if len(steps) == 1 else steps,
            "window_from_step": skip,
        }
    )
    return out_json
