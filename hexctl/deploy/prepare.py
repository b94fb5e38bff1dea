"""Write a deployed run's initial weights `v0`, once, before any service starts.

    python3 -m hexctl.deploy.prepare CONFIG [--source Qwen/Qwen3-8B] [--tokenizer-source T]
        [--prediction /etc/areal-hex/prediction.json]

`areal-hex run` does this in-process before it starts the services; a deployment runs
it as a one-shot job (a Kubernetes Job, a compose service the others wait for). The
deployed config's `model.path` already names `<run_dir>/weights/v0`; `--source` is the
model the experiment config named (HF hub name or a directory on the shared volume; none:
the tiny model). Idempotent: an existing `v0` is kept. `--prediction` copies the
rendered plan's prediction into the run directory (`prediction.json`, as `areal-hex run`
writes it), where the trainer's /metrics and the report find it.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path


def check_config(cfg) -> str | None:  # cfg: ExperimentConfig
    """Why this job cannot run on `cfg`, or None; `areal-hex deploy` asks before rendering."""
    if cfg.model.path is None:
        return "model.path (the v0 directory) is not set"
    return None


def install_prediction(cfg, source: Path) -> Path:  # cfg: ExperimentConfig
    """The rendered `prediction.json` into the run directory, where the trainer's
    /metrics (`prom.prediction_collectors`) and the report read it."""
    from areal_hex.run_files import RunPaths

    dest = RunPaths.of(cfg).prediction
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, dest)
    return dest


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m hexctl.deploy.prepare")
    p.add_argument("config", help="the deployed config (model.path = the v0 directory)")
    p.add_argument("--source", default=None, help="model to start from (default: tiny)")
    p.add_argument("--tokenizer-source", default=None, help="tokenizer, if not the model's")
    p.add_argument("--prediction", default=None, help="prediction.json to put in the run dir")
    args = p.parse_args(argv)

    from areal_hex.config import ConfigError, load_config
    from areal_hex.models import materialize

    try:
        cfg = load_config(args.config)
    except ConfigError as exc:
        print(f"prepare: error: {exc}", file=sys.stderr)
        return 2
    problem = check_config(cfg)
    if problem is not None:
        print(f"prepare: error: {problem}", file=sys.stderr)
        return 2
    if args.prediction is not None:
        install_prediction(cfg, Path(args.prediction))
    source = cfg.model.model_copy(
        update={"path": args.source, "tokenizer_path": args.tokenizer_source}
    )
    texts = None
    if source.path is None and source.tiny is not None and source.tiny.sft_steps > 0:
        from areal_hex.models import build_tokenizer
        from hexctl.job.warm_start import sft_texts

        texts = sft_texts(cfg, build_tokenizer())  # the same warm start as `areal-hex run`
    out = materialize(source, cfg.model.path, sft_texts=texts)
    print(f"initial weights ready at {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
