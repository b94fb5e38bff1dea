"""A benchmark whose run fails ends with one JSON object naming what failed and exit 1,
not a traceback; an interrupted run ends it as interrupted (exit 130)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from hexctl.bench import BenchFailed
from hexctl.bench.system import check_run
from hexctl.cli import main
from hexctl.launch.run import RunResult
from hexctl.launch.supervisor import Outcome


def test_a_failed_run_names_the_process_its_code_and_its_log(tmp_path: Path) -> None:
    failed = RunResult(tmp_path, Outcome("failed", "trainer", 3, "ValueError: bad batch"))
    with pytest.raises(BenchFailed) as err:
        check_run(failed, "the async run")
    msg = str(err.value)
    assert msg.startswith("the async run failed: trainer exited with code 3")
    assert "ValueError: bad batch" in msg and "trainer.log" in msg
    with pytest.raises(KeyboardInterrupt):
        check_run(RunResult(tmp_path, Outcome("interrupted")), "the async run")
    check_run(RunResult(tmp_path, Outcome("finished")), "the async run")  # nothing raised


def test_bench_prints_the_failure_as_json_and_exits_1(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import hexctl.bench.system.e2e as e2e

    def fails(args: object) -> dict[str, object]:
        raise BenchFailed("the sync run failed: inference-0 exited with code 1")

    monkeypatch.setattr(e2e, "run", fails)
    assert main(["bench", "e2e", "--json"]) == 1
    out, err = capsys.readouterr()
    assert json.loads(out) == {
        "bench": "e2e",
        "error": "the sync run failed: inference-0 exited with code 1",
    }
    assert "Traceback" not in err
    assert err.strip() == (
        "areal-hex bench e2e: failed: the sync run failed: inference-0 exited with code 1"
    )

    def interrupted(args: object) -> dict[str, object]:
        raise KeyboardInterrupt

    monkeypatch.setattr(e2e, "run", interrupted)
    assert main(["bench", "e2e", "--json"]) == 130


def test_a_failed_benchmarks_runs_are_kept_where_its_error_says(tmp_path: Path) -> None:
    from hexctl.bench.system import scratch_dir

    with scratch_dir("areal-hex-test-") as ok:
        Path(ok, "trainer.log").write_text("fine")
    assert not Path(ok).exists()  # a benchmark that ends well leaves nothing
    with pytest.raises(ValueError), scratch_dir("areal-hex-test-") as other:
        raise ValueError("not a run's failure")
    assert not Path(other).exists()
    with pytest.raises(BenchFailed) as err, scratch_dir("areal-hex-test-") as failed:
        Path(failed, "trainer.log").write_text("ValueError: bad batch")
        raise BenchFailed(f"the async run failed: see {failed}/trainer.log")
    assert Path(failed, "trainer.log").read_text() == "ValueError: bad batch"
    assert str(err.value).endswith(f"(the runs are kept in {failed})")
    shutil.rmtree(failed)
    # --output-dir: the runs are there; no other directory is made or named
    given = tmp_path / "runs"
    with pytest.raises(BenchFailed) as err, scratch_dir("areal-hex-test-", given) as out:
        Path(out).mkdir()
        Path(out, "trainer.log").write_text("boom")
        raise BenchFailed(f"the async run failed: see {out}/trainer.log")
    assert out == str(given) and Path(out, "trainer.log").exists()
    assert "kept in" not in str(err.value)
    with scratch_dir("areal-hex-test-", given) as out:
        pass
    assert Path(out, "trainer.log").exists()  # a benchmark that ends well keeps them too
