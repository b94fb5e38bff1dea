"""Compare a finished run's tracker output with its metric files, and optionally saved
scrapes with `areal_hex.prom.METRIC_NAMES`:

    python scripts/check_run_trackers.py RUN_DIR [trainer.prom rollout.prom]

(uses the readers of tests/tracker_files.py; run from the repository root)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from tracker_files import tensorboard_scalars, wandb_history  # noqa: E402

from areal_hex.prom import METRIC_NAMES  # noqa: E402
from areal_hex.run_files import RolloutRow, RunPaths, TrainerRow, read_rows  # noqa: E402
from areal_hex.trackers import scalars  # noqa: E402


def _off(a: float, b: float) -> bool:
    return abs(a - b) > 1e-6 * max(1.0, abs(b))


def main(run: Path, scrapes: list[Path]) -> None:
    paths = RunPaths.at(run)
    rows = read_rows(paths.metrics, TrainerRow)
    expected = {r.step: scalars(r, "trainer") for r in rows}
    tb = tensorboard_scalars(run / "tensorboard" / "trainer")
    bad = sum(_off(tb[k][s], v) for s, vals in expected.items() for k, v in vals.items())
    print("trainer rows", len(rows), "tensorboard tags", len(tb), "mismatches", bad)
    runs = list((run / "wandb").glob("offline-run-*/run-*.wandb"))
    print("wandb offline runs", len(runs))
    for wf in runs:
        h = wandb_history(wf)
        if h and "trainer/loss" in h[0]:
            wbad = sum(_off(x[k], v) for x in h for k, v in expected[int(x["_step"])].items())
            print("wandb trainer history", len(h), "mismatches", wbad)
    rtb = tensorboard_scalars(run / "tensorboard" / "rollout")
    rrows = read_rows(paths.rollout, RolloutRow)
    print("rollout rows", len(rrows), "tensorboard steps", len(rtb["rollout/samples_total"]))
    report = list((run / "tensorboard" / "report").glob("events.*"))
    print("report event files", len(report))
    if scrapes:
        seen = {
            s.name
            for f in scrapes
            for fam in text_string_to_metric_families(f.read_text())
            for s in fam.samples
            if not s.name.endswith("_created")
        }
        print(
            "scraped names",
            len(seen),
            "listed",
            len(METRIC_NAMES),
            "equal",
            seen == set(METRIC_NAMES),
        )


if __name__ == "__main__":
    main(Path(sys.argv[1]), [Path(p) for p in sys.argv[2:]])
