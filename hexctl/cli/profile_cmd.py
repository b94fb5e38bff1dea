"""`areal-hex profile`: time a model on devices and write a profile for `plan --profile`;
`--local` times the job's own engines on this machine, `--box` inside the nodes of a box."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from areal_hex.config.base import load_yaml_text


def register(sub: argparse._SubParsersAction) -> None:
    q = sub.add_parser(
        "profile",
        help="measure generation and training rates of a model on the devices present",
        description="Times transformers prefill/decode and a torch training step of a model "
        "(default: a tiny Qwen3) on CPU or CUDA and writes a profile for `plan --profile`.",
    )
    q.add_argument("--out", default="profile.yaml", help="profile file to write")
    q.add_argument("--model-config", help="HF config.json to profile (default: tiny Qwen3)")
    q.add_argument(
        "--kind",
        help="GPU kind name to file the rates under (default: CPU or "
        "the CUDA device's catalogue name)",
    )
    q.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    q.add_argument("--batches", default="1,4,16", help="decode batch sizes to time")
    q.add_argument("--context", type=int, default=128, help="context length for decode")
    q.add_argument("--json", action="store_true", help="print the profile as JSON")
    q.add_argument(
        "--local",
        action="store_true",
        help="this machine as a cluster: time the job's own engines on the devices `run` "
        "uses (CPU core groups of run.pin_cores, or the GPUs) and write cluster.yaml, "
        "profile.yaml, workload.yaml and model/ into --out-dir",
    )
    q.add_argument(
        "--box",
        help="a box that is up (`areal-hex box up BOX.yaml`): time each of its kinds inside "
        "one of its nodes, then each again (a second sitting, priced at the mean of both), "
        "and write the box as the inventory (cluster.yaml) into --out-dir",
    )
    q.add_argument("--config", help="--local: the experiment YAML (default: the tiny example)")
    q.add_argument("--out-dir", default="local-profile", help="--local: where to write")
    q.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="--local: config overrides")
    q.set_defaults(func=_profile)


def _profile(args: argparse.Namespace) -> int:
    from hexctl.cli import UsageError
    from hexctl.profile.bare import measure_profile
    from scheduler.profile import save_profile

    try:
        batches = sorted({int(b) for b in args.batches.split(",") if b.strip()})
    except ValueError:
        raise UsageError(f"--batches {args.batches!r}: expected integers like 1,4,16") from None
    if not batches or min(batches) < 1:
        raise UsageError(f"--batches {args.batches!r}: expected positive integers")
    from hexctl.profile.controller import ProfileFailed

    try:
        if args.box:
            return _profile_box(args, batches)
        if args.local:
            return _profile_local(args, batches)
    except ProfileFailed as exc:
        print(f"areal-hex profile: error: {exc}", file=sys.stderr)
        return 1
    if args.overrides or args.config:
        raise UsageError("--config and KEY=VALUE overrides apply to --local only")
    prof = measure_profile(
        Path(args.model_config) if args.model_config else None,
        args.device,
        args.kind,
        batches,
        args.context,
    )
    path = save_profile(prof, args.out)
    if args.json:
        print(json.dumps(prof.model_dump(mode="json"), indent=2))
    else:
        for kind, r in prof.kinds.items():
            steps = ", ".join(f"b={b}: {s * 1e3:.1f} ms" for b, s in r.decode_step_s.items())
            print(
                f"{kind} ({r.device}): decode step {steps}; prefill "
                f"{r.prefill_tokens_per_s:,.0f} tok/s; train {r.train_tokens_per_s:,.0f} tok/s"
            )
        print(f"wrote {path}")
    return 0


def _progress(text: str) -> None:
    """A profile's stage as it begins, on stderr (stdout carries the result)."""
    print(f"areal-hex profile: {text}", file=sys.stderr, flush=True)


def _rewarded(gen: dict) -> str:
    """The rewarded answers' mean length, at which a run is priced (`profile/lengths.py`)."""
    rewarded = gen.get("rewarded_response_tokens")
    return "" if rewarded is None else f" ({rewarded:.1f} rewarded: a run priced at those)"


def _trainer_extras(measured: dict) -> str:
    pub, ckpt = measured.get("train_publish_s"), measured.get("train_checkpoint_s")
    out = "" if pub is None else f", a weight publish {pub * 1e3:.1f} ms of a step"
    return out + ("" if ckpt is None else f", a checkpoint {ckpt * 1e3:.0f} ms")


def _profile_local(args: argparse.Namespace, batches: list[int]) -> int:
    from areal_hex.config import load_config
    from hexctl.bench.system import DEFAULT_CONFIG
    from hexctl.profile.local import profile_local

    cfg = load_config(args.config or DEFAULT_CONFIG, list(args.overrides))
    given = args.batches != "1,4,16"  # the default is for the tiny HF profile
    files = profile_local(cfg, Path(args.out_dir), batches if given else None, say=_progress)
    measured = json.loads(files.measured.read_text())
    if args.json:
        print(json.dumps(measured, indent=2))
        return 0
    gen = measured["generation"]
    steps = ", ".join(f"b={b}: {s * 1e3:.2f} ms" for b, s in gen["decode_step_s"].items())
    dev = measured["devices"]
    reload = f"reload {gen['reload_s'] * 1e3:.1f} ms (idle {gen['reload_idle_s'] * 1e3:.1f})"
    print(
        f"{dev['kind']} x {dev['count']} ({dev['device']}): decode step {steps}; prefill "
        f"{gen['prefill_tokens_per_s']:,.0f} tok/s; train {measured['train_tokens_per_s']:,.0f} "
        f"tok/s{_trainer_extras(measured)}; {reload}; prompt {gen['prompt_tokens']:.0f} and answer "
        f"{gen['response_tokens']:.1f} tokens on average{_rewarded(gen)}; the run's controller "
        "keeping the "
        f"server full: {gen['continuous_samples_per_s']:,.1f} samples/s (efficiency "
        f"{_efficiency(measured)}), {gen['host_cpu_s_per_sample'] * 1e3:.2f} "
        f"ms of controller CPU per sample; a synchronous step's batch "
        f"{gen['sync_cycle_s'] * 1e3:.0f} ms after its publish ("
        f"{measured['sync_cycle_factor']:.2f} x the replay)"
    )
    print(
        f"wrote {files.root}/: cluster.yaml profile.yaml workload.yaml model/\nnext: areal-hex "
        f"plan {files.cluster} --model {files.model} --workload {files.workload} --profile "
        f"{files.profile} --budget {dev['count']} --out plan.yaml"
    )
    return 0


def _scoring(r: dict) -> str:
    """A kind's scoring rates (`hexctl/profile/scoring.py`), where measured."""
    out = ""
    if r.get("score_tokens_per_s"):
        out += f"; scoring {r['score_tokens_per_s']:,.0f} tok/s one at a time"
    if r.get("score_concurrent_tokens_per_s"):
        out += (
            f", {r['score_concurrent_tokens_per_s']:,.0f} with {r['score_concurrency']} in flight"
        )
    if r.get("classify_tokens_per_s"):
        out += (
            f"; reward model /classify {r['classify_tokens_per_s']:,.0f} tok/s with "
            f"{r['classify_concurrency']} in flight"
        )
    return out


def _profile_box(args: argparse.Namespace, batches: list[int]) -> int:

    from areal_hex.config import load_config
    from hexctl.bench.system import DEFAULT_CONFIG
    from hexctl.box import emulate as box
    from hexctl.box.checks import check_fits
    from hexctl.box.profile import profile_box
    from hexctl.box.spec import load_box

    spec = load_box(args.box)
    check_fits(spec)
    box.check_host()
    state = box.load_state(spec.name)
    cfg = load_config(args.config or DEFAULT_CONFIG, list(args.overrides))
    given = args.batches != "1,4,16"
    files = profile_box(
        cfg, spec, state, Path(args.out_dir), batches if given else None, say=_progress
    )
    prof = load_yaml_text(files.profile.read_text(), str(files.profile))
    for kind, r in prof["kinds"].items():
        steps = ", ".join(f"b={b}: {s * 1e3:.2f} ms" for b, s in r["decode_step_s"].items())
        print(
            f"{kind}: decode step {steps}; prefill {r['prefill_tokens_per_s']:,.0f} tok/s; "
            f"train {r['train_tokens_per_s']:,.0f} tok/s; generation efficiency "
            f"{_efficiency(r)}{_scoring(r)}"
        )
    print(
        f"wrote {files.root}/: cluster.yaml profile.yaml workload.yaml model/\nnext: areal-hex "
        f"plan {files.cluster} --model {files.model} --workload {files.workload} --profile "
        f"{files.profile} --budget USD_PER_H --out plan.yaml"
    )
    return 0


def _efficiency(rates: dict[str, Any]) -> str:
    """A kind's generation efficiency: at each batch its loads held, where measured."""
    at = rates.get("generation_efficiency_at")
    if not at or len(at) < 2:
        return f"{rates['generation_efficiency']:.2f}"
    pts = sorted((int(b), float(e)) for b, e in at.items())
    return ", ".join(f"{e:.2f} at {b}" for b, e in pts)
