"""`areal-hex run` refuses a config that cannot work before it starts anything: exit 2,
one message saying what is wrong and what was expected, no run directory left."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from areal_hex.config import load_config
from hexctl.cli import main
from hexctl.job.prepare import choose_ports


@pytest.fixture
def taken_port() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def _run(tmp_path: Path, *overrides: str) -> list[str]:
    return ["run", "--no-progress", f"run.output_dir={tmp_path}", "run.run_id=r", *overrides]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["redis.url=redis://127.0.0.1:{port}/0"],
            "redis.url redis://127.0.0.1:{port}/0 is unreachable",
        ),
        (["model.path={tmp}/no-such-model"], "model.path {tmp}/no-such-model: does not exist"),
        (["trainer.checkpoint_every=200"], "buffer.max_pending (1024)"),
        (
            ["buffer.groups_per_step=50", "data.limit=20", "buffer.max_pending=5000"],
            "more than the 20 prompts",
        ),
        (["redis.port={port}"], "redis.port {port} is taken"),
    ],
)
def test_bad_config_exits_2_before_anything_starts(
    tmp_path: Path,
    taken_port: int,
    capsys: pytest.CaptureFixture[str],
    overrides: list[str],
    message: str,
) -> None:
    fill = {"port": taken_port, "tmp": tmp_path}
    # a port with a listener that is not Redis is as unreachable as a closed one
    args = _run(tmp_path, *(o.format(**fill) for o in overrides))
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message.format(**fill) in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "r").exists()


def test_resume_needs_a_run_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--resume", str(tmp_path / "nowhere")]) == 2
    assert "no config.yaml there" in capsys.readouterr().err


def test_taken_ports_are_replaced_and_named(taken_port: int) -> None:
    cfg = load_config(None, ["run.run_id=r", f"inference.base_port={taken_port}"])
    cfg.run.embedded_redis = True
    cfg.redis.port = taken_port
    said: list[str] = []
    choose_ports(cfg, said.append)
    assert cfg.redis.port != taken_port and cfg.inference.base_port != taken_port
    assert (
        said[0]
        == f"redis.port {taken_port} is taken; the embedded Valkey uses {cfg.redis.port} instead"
    )
    base = cfg.inference.base_port
    assert (
        said[1]
        == f"inference.base_port: port(s) {taken_port} taken; the servers use {base}-{base} instead"
    )


def test_an_interrupt_while_preparing_leaves_no_run_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Ctrl-C, or SIGTERM, which `run` turns into it, while v0 is written: the run's
    directory, named by the run itself (no run.run_id), is removed and the run says so."""
    import hexctl.job.prepare as prepare

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(prepare, "materialize_v0", interrupted)
    example = Path(__file__).resolve().parents[2] / "examples" / "tiny_cpu.yaml"
    args = ["run", "--no-progress", str(example), f"run.output_dir={tmp_path}"]
    assert main(args) == 130
    assert "areal-hex run: interrupted" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
