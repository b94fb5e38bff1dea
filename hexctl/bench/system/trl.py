"""TRL's GRPOTrainer on the same work: the README's tiny job under `areal-hex run` and under
trl.GRPOTrainer, from the same v0 weights on disk; samples/s and held-out pass@1 of both.

One invocation writes v0 once (the tiny Qwen3 of the config, its character tokenizer and
its supervised warm start, `hexctl.job.prepare.materialize_v0`, as `areal-hex run`
does), then for each seed (`--seeds N`: 0..N-1) and repeat (`--repeats N`), back to back:

1. `areal-hex run CONFIG model.path=V0 --profile PROFILE --no-progress` in a subprocess
   (seed s: `run.seed=s inference.seed=s`; the data and its order stay those of
   `data.seed`). PROFILE is `areal-hex profile --local` of the job, taken once before
   the first run and outside every window (`profile_seconds`), as the README's run
   reuses the profile it keeps: with it `run.host_cores: auto` can put Valkey and the
   controller where the profile measured them faster. `--no-profile`: runs with
   `run.profile_first=false` instead;
2. TRL's GRPOTrainer in a fresh process (`hexctl.bench.system.trl_worker`) on a copy of V0, with
   the controller's prompts in the controller's order (`areal_hex.data.build_prompts` of
   the train split, then `iterate_prompts(data.seed)`: the rendered chat-template text,
   checked there to tokenize to the same ids) and its reward
   (`areal_hex.rewards.math_reward` against the gold answer), `seed=s`;
3. `areal-hex eval RUN/config.yaml --weights W --json` (greedy pass@1 on
   `data.eval_split`) of both final models and of v0, the same code and config for all.

The two sides alternate which goes first (even runs areal-hex first) so that a machine
getting busier or quieter does not favour one side.

Rate (the same definition on both sides): trained samples / seconds of the RL part.
areal-hex: `samples_per_s_wall` of its summary.json, groups trained x G over
`active_time_s` (services ready to the end of the job, so the asynchronous head start
and the trainer's start-up are inside it); TRL: max_steps x generation batch over the
wall time of `trainer.train()` (the model and trainer built before it, as areal-hex's
services start before its window). `steady_samples_per_s`, between the first and the
last optimizer step, is given for both as well.

Hyper-parameter mapping (`grpo_config_kwargs`; a setting with no faithful TRL
counterpart is refused, exit 2):

    rollout.group_size 16              -> num_generations
    buffer.groups_per_step x group_size -> per_device_train_batch_size (one generation
                                           batch, one optimizer step per batch:
                                           gradient_accumulation_steps 1, num_iterations 1)
    rollout.max_new_tokens, temperature, top_p -> max_completion_length, temperature, top_p
    rollout.top_k -1 (off)             -> top_k 0 (off)
    trainer.total_steps                -> max_steps
    trainer.lr, lr_schedule, warmup_steps -> learning_rate, lr_scheduler_type
                                           (constant[_with_warmup] / linear / cosine),
                                           warmup_steps
    trainer.adam_betas, adam_eps, weight_decay, grad_clip -> adam_beta1/2, adam_epsilon,
                                           weight_decay, max_grad_norm (AdamW both sides)
    trainer.device cpu (fp32)          -> use_cpu, bf16 False (TRL's default is bf16)
    trainer.gradient_checkpointing     -> gradient_checkpointing (TRL's default is on)
    algo.advantage grpo + std_normalize -> scale_rewards "group"; drgrpo -> "none"
    algo.aggregation token_mean        -> loss_type "dapo" (token mean over the step);
                     seq_mean_token_mean -> "grpo"; fixed_len -> "dr_grpo"
    algo.objective ppo / gspo          -> importance_sampling_level token / sequence
    algo.clip_low, clip_high, dual_clip -> epsilon, epsilon_high, delta
    algo.kl_coef (k3 estimator)        -> beta (TRL's KL is k3)
    algo.entropy_coeff                 -> entropy_coef
    algo.overlong_mask                 -> mask_truncated_completions
    the data order                     -> shuffle_dataset False on the controller's order

No counterpart, left to TRL's defaults: the staleness bound and the decoupled weight
(TRL without vLLM is synchronous and on-policy: the behaviour and proximal policies are
the same weights, which is areal-hex at eta = 0); the group std (areal-hex: population
std + algo.std_eps; TRL: sample std + 1e-4); the generation engine (TRL:
`model.generate`; areal-hex: its inference server), the optimizer implementation
(TRL's default `optim`) and torch threads (TRL: torch's default in one process,
`--trl-threads` to set; areal-hex: one core each for server and trainer, `run.pin_cores`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from areal_hex.config import ConfigError, ExperimentConfig, load_config
from areal_hex.errors import UsageError
from hexctl.bench import BenchFailed
from hexctl.bench.system import DEFAULT_CONFIG

ROOT = Path(__file__).resolve().parents[3]
TRL_VERSION = "1.16.0"  # the version the mapping was read from (pyproject's `trl` extra)
RATE_DEFINITION = (
    "trained samples / seconds of the RL part: areal-hex summary.json samples_per_s_wall "
    "(groups trained x G / active_time_s, services ready to job end); TRL max_steps x "
    "batch / wall time of trainer.train(). startup_s: the side's command started to its "
    "first optimizer step; wall_s: the whole command (v0's warm start made once for "
    "both, v0_seconds, outside it)"
)

_AGGREGATION_TO_LOSS = {"token_mean": "dapo", "seq_mean_token_mean": "grpo", "fixed_len": "dr_grpo"}
_SCHEDULES = {"constant": "constant", "linear": "linear", "cosine": "cosine"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=DEFAULT_CONFIG, help="experiment YAML (default: tiny)")
    p.add_argument("--steps", type=int, default=None, help="trainer.total_steps (both sides)")
    p.add_argument("--seeds", type=int, default=1, help="seeds 0..N-1 (default 1)")
    p.add_argument("--repeats", type=int, default=1, help="runs per seed, back to back")
    p.add_argument("--trl-threads", type=int, default=None, help="torch threads of TRL's run")
    p.add_argument("--output-dir", default=None, help="keep v0, the runs and TRL's models here")
    p.add_argument(
        "--no-profile",
        action="store_true",
        help="areal-hex runs without a profile of this machine (run.profile_first=false; "
        "by default the machine is profiled once for the job, outside every window, and "
        "each run is given it with --profile, as a run reuses its kept profile)",
    )
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides")


# ---------------------------------------------------------------- the mapping
def unmappable(cfg: ExperimentConfig) -> list[str]:
    """Settings of `cfg` TRL's GRPOTrainer cannot reproduce (each: key, value, why)."""
    a, t = cfg.algo, cfg.trainer
    out = []
    if a.advantage not in ("grpo", "drgrpo"):
        out.append(f"algo.advantage={a.advantage}: TRL has only group-mean baselines")
    if a.batch_normalize:
        out.append("algo.batch_normalize=true: TRL's 'batch' scaling keeps the group mean")
    if a.objective == "cispo":
        out.append("algo.objective=cispo: TRL's cispo clips with other bounds")
    if a.aggregation not in _AGGREGATION_TO_LOSS:
        out.append(f"algo.aggregation={a.aggregation}: no TRL loss_type aggregates so")
    if a.aggregation == "fixed_len" and a.fixed_len not in (None, cfg.rollout.max_new_tokens):
        out.append("algo.fixed_len: TRL's dr_grpo divides by max_completion_length")
    if a.kl_coef > 0 and (a.kl_estimator != "k3" or a.kl_in_reward or a.kl_clamp is not None):
        out.append("algo.kl_*: TRL's KL is an unclamped k3 term in the loss")
    if a.overlong_buffer is not None:
        out.append("algo.overlong_buffer: TRL has no soft overlong penalty")
    if a.ppo_minibatches != 1:
        out.append("algo.ppo_minibatches: one update per batch is mapped (num_iterations 1)")
    if a.denominator != "all":
        out.append("algo.denominator=informative: TRL counts every completion")
    if t.lr_schedule != "constant" and t.min_lr_ratio > 0:
        out.append("trainer.min_lr_ratio > 0: TRL's linear/cosine schedules decay to 0")
    if t.num_ranks != 1 or t.device != "cpu":
        out.append("trainer.num_ranks/device: the comparison is one CPU process per side")
    if cfg.rollout.dynamic_sampling:
        out.append("rollout.dynamic_sampling: TRL trains on every group")
    return out


def grpo_config_kwargs(cfg: ExperimentConfig, seed: int, output_dir: str) -> dict[str, Any]:
    """trl.GRPOConfig arguments for the job of `cfg` (see the module docstring)."""
    bad = unmappable(cfg)
    if bad:
        raise ConfigError("bench trl cannot map to TRL:\n  " + "\n  ".join(bad))
    a, t, ro = cfg.algo, cfg.trainer, cfg.rollout
    schedule = _SCHEDULES[t.lr_schedule]
    if schedule == "constant" and t.warmup_steps:
        schedule = "constant_with_warmup"
    return {
        "output_dir": output_dir,
        "seed": seed,
        "use_cpu": True,
        "bf16": False,
        "gradient_checkpointing": t.gradient_checkpointing,
        "max_steps": t.total_steps,
        "num_generations": ro.group_size,
        "per_device_train_batch_size": cfg.buffer.groups_per_step * ro.group_size,
        "gradient_accumulation_steps": 1,
        "num_iterations": 1,
        "max_completion_length": ro.max_new_tokens,
        "temperature": ro.temperature,
        "top_p": ro.top_p,
        "top_k": max(ro.top_k, 0),
        "learning_rate": t.lr,
        "lr_scheduler_type": schedule,
        "warmup_steps": t.warmup_steps,
        "adam_beta1": t.adam_betas[0],
        "adam_beta2": t.adam_betas[1],
        "adam_epsilon": t.adam_eps,
        "weight_decay": t.weight_decay,
        "max_grad_norm": t.grad_clip,
        "scale_rewards": "group" if a.advantage == "grpo" and a.std_normalize else "none",
        "loss_type": _AGGREGATION_TO_LOSS[a.aggregation],
        "importance_sampling_level": "sequence" if a.objective == "gspo" else "token",
        "epsilon": a.clip_low,
        "epsilon_high": a.clip_high,
        "delta": a.dual_clip,
        "beta": a.kl_coef,
        "entropy_coef": a.entropy_coeff,
        "mask_truncated_completions": a.overlong_mask,
        "shuffle_dataset": False,
        # bookkeeping only: a reward per step (for final_reward), no checkpoints, no bars
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "disable_tqdm": True,
    }


def prompt_rows(cfg: ExperimentConfig, tokenizer: Any, n: int) -> list[dict[str, Any]]:
    """The first `n` prompts the rollout controller would send, in its order: the rendered
    text (what TRL tokenizes), its token ids (checked against TRL's tokenization) and the
    gold answer the reward compares with."""
    import itertools

    from areal_hex.data import build_prompts, iterate_prompts, load_problems

    prompts = build_prompts(load_problems(cfg.data, cfg.data.split), tokenizer, cfg.data).prompts
    order = itertools.islice(iterate_prompts(prompts, cfg.data.seed), n)
    return [{"prompt": p.text, "answer": p.answer, "ids": list(p.input_ids)} for _, p in order]


# ---------------------------------------------------------------- the two sides
def _env() -> dict[str, str]:
    """This tree first on the children's path (a worktree's code, not the installed one)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return env


def _child(argv: list[str], what: str, log: Path) -> None:
    """Run `python -m ...argv` with its output in `log`; a failure names it and its tail."""
    with log.open("w") as f:
        rc = subprocess.call([sys.executable, "-m", *argv], stdout=f, stderr=subprocess.STDOUT,
                             env=_env(), cwd=ROOT)  # fmt: skip
    if rc != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
        raise BenchFailed(f"{what} failed (exit {rc}); last lines of {log}:\n{tail}")


def profile_machine(config: str, overrides: list[str], out: Path) -> tuple[Path, float]:
    """`areal-hex profile --local` for the job (once, before the runs, outside every
    window): its directory and seconds."""
    argv = ["hexctl.cli", "profile", "--local", "--config", config, "--out-dir",
            str(out / "profile"), *overrides]  # fmt: skip
    t0 = time.perf_counter()
    _child(argv, "areal-hex profile --local", out / "profile.log")
    return out / "profile", time.perf_counter() - t0


def run_areal(
    config: str, overrides: list[str], out: Path, run_id: str, profile: Path | None = None
) -> dict[str, Any]:
    """`areal-hex run` as a user runs it (`--profile`: on a machine profiled for the job,
    as the README's run is once its profile is kept); its summary.json and timings."""
    first = ["--profile", str(profile)] if profile is not None else ["run.profile_first=false"]
    argv = ["hexctl.cli", "run", config, *overrides, f"run.output_dir={out}",
            f"run.run_id={run_id}", *first, "--no-progress"]  # fmt: skip
    t_launch, t0 = time.time(), time.perf_counter()
    _child(argv, "areal-hex run", out / f"{run_id}.log")
    wall = time.perf_counter() - t0
    run_dir = out / run_id
    s = json.loads((run_dir / "summary.json").read_text())
    first = first_step_time(run_dir / "metrics.jsonl")
    return {
        "run_dir": str(run_dir),
        "samples_per_s": s["samples_per_s_wall"],
        "steady_samples_per_s": s["samples_per_s"],
        "startup_s": None if first is None else round(first - t_launch, 2),
        "rl_s": s.get("active_time_s"),  # the ledger's; absent in a report from files alone
        "wall_s": round(wall, 2),
        "startup": s.get("startup"),  # the run's own timeline (which process ready when)
        "steps": s["steps"],
        "samples_trained": s["groups_trained"] * s["group_size"],
        "final_reward": s["final_reward"],
        "groups_lost": s.get("groups_lost"),
        "max_version_lag": s["max_version_lag"],
    }


def first_step_time(metrics: Path) -> float | None:
    """The time of a run's first optimizer step (its first metrics.jsonl row)."""
    with contextlib.suppress(OSError, ValueError, KeyError):
        with metrics.open() as f:
            return float(json.loads(f.readline())["time"])
    return None


def run_trl(spec: dict[str, Any], out: Path, name: str) -> dict[str, Any]:
    """TRL's GRPOTrainer in a fresh process (`hexctl.bench.system.trl_worker`); its
    start-up is timed from here, as areal-hex's is (`t_launch`)."""
    spec_path = out / f"{name}.spec.json"
    spec_path.write_text(json.dumps({**spec, "t_launch": time.time()}))
    t0 = time.perf_counter()
    _child(
        ["hexctl.bench.system.trl_worker", str(spec_path)], "TRL GRPOTrainer", out / f"{name}.log"
    )
    wall = time.perf_counter() - t0
    r = json.loads(Path(spec["result"]).read_text())
    return {**r, "wall_s": round(wall, 2)}


def evaluate(config_yaml: Path, weights: str, log: Path) -> float:
    """Held-out greedy pass@1 of `weights` by `areal-hex eval`."""
    argv = ["hexctl.cli", "eval", str(config_yaml), "--weights", weights, "--json"]
    _child(argv, "areal-hex eval", log)
    lines = [ln for ln in log.read_text().splitlines() if ln.startswith("{")]
    return float(json.loads(lines[-1])["pass@1"])


# ---------------------------------------------------------------- one comparison
def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def one_run(
    cfg: ExperimentConfig, args: argparse.Namespace, overrides: list[str], v0: Path,
    rows: Path, out: Path, seed: int, index: int, profile: Path | None,
) -> dict[str, Any]:  # fmt: skip
    """areal-hex and TRL on the same work (alternating which goes first), then eval."""
    name = f"s{seed}-r{index}"
    trl_dir = out / f"trl-{name}"
    spec = {
        "v0": str(v0),
        "rows": str(rows),
        "final": str(trl_dir / "final"),
        "result": str(trl_dir / "result.json"),
        "threads": args.trl_threads,
        "grpo": grpo_config_kwargs(cfg, seed, str(trl_dir / "trainer")),
    }
    trl_dir.mkdir(parents=True)
    seeded = [*overrides, f"model.path={v0}", f"run.seed={seed}", f"inference.seed={seed}"]
    load_before = _load()
    if index % 2 == 0:
        ours = run_areal(args.config, seeded, out, f"areal-{name}", profile=profile)
        theirs = run_trl(spec, out, f"trl-{name}")
    else:
        theirs = run_trl(spec, out, f"trl-{name}")
        ours = run_areal(args.config, seeded, out, f"areal-{name}", profile=profile)
    load_after = _load()
    config_yaml = Path(ours["run_dir"]) / "config.yaml"
    ours["pass@1"] = evaluate(config_yaml, "latest", out / f"eval-areal-{name}.log")
    theirs["pass@1"] = evaluate(config_yaml, spec["final"], out / f"eval-trl-{name}.log")
    result = {
        "seed": seed,
        "first": "areal-hex" if index % 2 == 0 else "trl",
        "load_before": load_before,
        "load_after": load_after,
        "areal_hex": ours,
        "trl": theirs,
        "ratio": ours["samples_per_s"] / theirs["samples_per_s"],
        "steady_ratio": ours["steady_samples_per_s"] / theirs["steady_samples_per_s"],
        "wall_ratio": theirs["wall_s"] / ours["wall_s"],  # > 1: areal-hex's command is faster
    }
    print(json.dumps(result), file=sys.stderr, flush=True)  # the runs are long: each as it ends
    return result


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians and ranges over the runs (each a ratio measured within one run)."""
    ratios = [r["ratio"] for r in runs]
    steady = [r["steady_ratio"] for r in runs]
    walls = [r["wall_ratio"] for r in runs]
    ours = [r["areal_hex"]["pass@1"] for r in runs]
    theirs = [r["trl"]["pass@1"] for r in runs]
    return {
        "ratio_median": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "ratios": ratios,
        "steady_ratio_median": statistics.median(steady),
        "steady_ratios": steady,
        "wall_ratio_median": statistics.median(walls),
        "wall_ratios": walls,
        "areal_hex_samples_per_s": [r["areal_hex"]["samples_per_s"] for r in runs],
        "trl_samples_per_s": [r["trl"]["samples_per_s"] for r in runs],
        "areal_hex_startup_s": [r["areal_hex"].get("startup_s") for r in runs],
        "trl_startup_s": [r["trl"].get("startup_s") for r in runs],
        "areal_hex_pass@1": ours,
        "trl_pass@1": theirs,
        "pass@1_areal_hex_mean": statistics.fmean(ours),
        "pass@1_trl_mean": statistics.fmean(theirs),
    }


def require_trl() -> str:
    """TRL's version; without TRL a usage error that says how to install it."""
    try:
        import trl
    except ImportError:
        raise UsageError(
            f"bench trl needs TRL ({TRL_VERSION}), which the default install leaves out: "
            "pip install -e .[trl]"
        ) from None
    return str(trl.__version__)


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.seeds < 1 or args.repeats < 1:
        raise UsageError(f"--seeds {args.seeds} --repeats {args.repeats}: expected N >= 1")
    version = require_trl()
    overrides = list(args.overrides)
    if args.steps is not None:
        overrides.append(f"trainer.total_steps={args.steps}")
    cfg = load_config(args.config, overrides)
    grpo_config_kwargs(cfg, 0, "")  # refuse an unmappable config before any work
    from areal_hex.models import load_tokenizer
    from hexctl.job.prepare import check_model_path, materialize_v0

    check_model_path(cfg)  # as `areal-hex run` does: a missing model.path, said in one line

    with tempfile.TemporaryDirectory(prefix="areal-hex-bench-trl-") as tmp:
        out = Path(args.output_dir or tmp).resolve()
        out.mkdir(parents=True, exist_ok=True)
        if any(p.name.startswith(("areal-", "trl-")) for p in out.iterdir()):
            raise UsageError(f"--output-dir {out} holds an earlier bench's runs; give a new one")
        t0 = time.perf_counter()
        # stdout carries the JSON: what saving the model logs (DeepSpeed's accelerator
        # line, printed to stdout by the import it triggers) goes to stderr
        with contextlib.redirect_stdout(sys.stderr):
            v0 = materialize_v0(cfg, out / "initial")  # the same v0 `areal-hex run` writes
            tokenizer = load_tokenizer(v0)
        v0_s = time.perf_counter() - t0
        n = cfg.trainer.total_steps * cfg.buffer.groups_per_step
        rows = out / "prompts.jsonl"
        rows.write_text("".join(json.dumps(r) + "\n" for r in prompt_rows(cfg, tokenizer, n)))
        profile, profile_s = None, None
        if not args.no_profile:
            profile, profile_s = profile_machine(args.config, [*overrides, f"model.path={v0}"], out)
        runs = [
            one_run(cfg, args, overrides, v0, rows, out, seed, i * args.seeds + seed, profile)
            for i in range(args.repeats)
            for seed in range(args.seeds)
        ]
        cfg_yaml = Path(runs[0]["areal_hex"]["run_dir"]) / "config.yaml"
        v0_pass = evaluate(cfg_yaml, str(v0), out / "eval-v0.log")
    return {
        "config": args.config,
        "trl_version": version,
        "steps": cfg.trainer.total_steps,
        "group_size": cfg.rollout.group_size,
        "groups_per_step": cfg.buffer.groups_per_step,
        "rate": RATE_DEFINITION,
        "cpu_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "v0_seconds": round(v0_s, 1),
        "profile_seconds": None if profile_s is None else round(profile_s, 1),
        "v0_pass@1": v0_pass,
        "grpo_config": grpo_config_kwargs(cfg, 0, "<per run>"),
        **summarise(runs),
        "runs": runs,
    }
