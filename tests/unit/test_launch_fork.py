"""The fork server (launch/zygote.py, forkserver.py) with the real supervisor: a forked
service runs its `python -m` entry with its own environment, directory and log, in its
own session, as the launcher's child; a killed one is forked again; the switch off (or a
service whose load-time settings differ) gives plain processes."""

from __future__ import annotations

import ctypes
import dataclasses
import importlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hexctl.launch.forkserver import ForkedProcess, ForkServer
from hexctl.launch.supervisor import ProcessSpec, Supervisor, live_processes, tail_lines
from hexctl.launch.zygote import preload

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")

ENTRY = """\
import os, sys, time
print("entry", os.environ["MARK"], os.getcwd(), "preloaded" if "json" in sys.modules else "-",
      "ppid", os.getppid(), "leader", os.getpgrp() == os.getpid(), "args", sys.argv[1:],
      flush=True)
if sys.argv[1:] == ["crash-once"] and not os.path.exists("crashed"):
    open("crashed", "w").close()
    sys.exit(3)
if sys.argv[1:] == ["exit", "5"]:
    sys.exit(5)
time.sleep(60)
"""


def _env(tmp: Path) -> dict[str, str]:
    root = str(Path(__file__).resolve().parents[2])
    return {"PYTHONPATH": f"{tmp}{os.pathsep}{root}"}


def _spec(tmp: Path, name: str, *args: str, **kw: object) -> ProcessSpec:
    work = tmp / "work"
    work.mkdir(exist_ok=True)
    env = {**_env(tmp), "MARK": name}
    cmd = [sys.executable, "-m", "fork_entry", *args]
    return ProcessSpec(name, cmd, tmp / f"{name}.log", env, cwd=str(work), fork=True, **kw)  # type: ignore[arg-type]


def _supervisor(tmp: Path) -> Supervisor:
    (tmp / "fork_entry.py").write_text(ENTRY)
    sup = Supervisor(poll_s=0.05, pid_file=tmp / "pids.json")
    env = {**os.environ, **_env(tmp)}
    sup.attach(ForkServer(tmp, ["json"], env, tmp / "fork-server.log", ready_timeout_s=30))
    return sup


def _wait_log(
    path: Path, text: str, count: int = 1, sup: Supervisor | None = None, timeout_s: float = 20.0
) -> str:
    """The log once it holds `text` `count` times (the supervisor restarting meanwhile)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        log = path.read_text() if path.exists() else ""
        if log.count(text) >= count:
            return log
        if sup is not None:
            assert sup.check() is None
        time.sleep(0.05)
    raise AssertionError(f"{text!r} x{count} not in {path}: {tail_lines(path)}")


@pytest.mark.timeout(60)
def test_forked_service_runs_its_entry_with_its_env_and_log(tmp_path: Path) -> None:
    with _supervisor(tmp_path) as sup:
        m = sup.start(_spec(tmp_path, "inference-0", "a", "b"))
        assert isinstance(m.proc, ForkedProcess) and _subreaper()
        # the whole line: the log may be read while its print is half written
        log = _wait_log(tmp_path / "inference-0.log", "args ['a', 'b']\n")
        line = log.splitlines()[-1]
        # its env, cwd, the parent's imports, the launcher as parent, its own session
        assert f"entry inference-0 {tmp_path / 'work'} preloaded ppid {os.getpid()}" in line
        assert "leader True" in line and "['a', 'b']" in line
        # found as the run's process by the run directory on its command line
        live = live_processes(tmp_path / "pids.json", f"{tmp_path.name}/")
        assert live["inference-0"] == [sup.pid("inference-0")]
        fin = sup.start(_spec(tmp_path, "trainer", "exit", "5", on_exit="finish"))
        out = sup.watch(timeout_s=20)
        assert (out.status, out.name, out.returncode) == ("failed", "trainer", 5)
        assert isinstance(fin.proc, ForkedProcess) and sup.running("inference-0")
        server = sup.pid("inference-0")
    assert server is not None and not sup.running("inference-0")
    assert sup.forker is not None and sup.forker.proc is None  # closed with the supervisor
    assert not _subreaper()  # and this process reaps its orphans no more


def _subreaper() -> bool:
    flag = ctypes.c_int(0)
    ctypes.CDLL("libc.so.6").prctl(37, ctypes.byref(flag))  # PR_GET_CHILD_SUBREAPER
    return bool(flag.value)


@pytest.mark.timeout(60)
def test_killed_forked_service_is_forked_again(tmp_path: Path) -> None:
    with _supervisor(tmp_path) as sup:
        sup.start(_spec(tmp_path, "inference-0", "crash-once", on_exit="restart"))
        log_path = tmp_path / "inference-0.log"
        _wait_log(log_path, "entry inference-0", 2, sup)  # crashed (3), forked again
        first = sup.pid("inference-0")
        assert first is not None
        os.kill(first, signal.SIGKILL)  # bench chaos's fault
        _wait_log(log_path, "entry inference-0", 3, sup)
        assert sup.running("inference-0") and sup.pid("inference-0") != first
        assert isinstance(sup.procs["inference-0"].proc, ForkedProcess)
        exits = [e for _, n, e in sup.events if n == "inference-0" and e.startswith("exit")]
        assert exits == ["exit 3", "exit -9"]
        assert "plain process" not in log_path.read_text()


@pytest.mark.timeout(60)
def test_plain_processes_without_fork_or_with_other_loadtime_env(tmp_path: Path) -> None:
    with _supervisor(tmp_path) as sup:
        plain = sup.start(dataclasses.replace(_spec(tmp_path, "controller"), fork=False))
        other = _spec(tmp_path, "worker-0")
        other.env["OMP_WAIT_POLICY"] = "ACTIVE"
        differs = sup.start(other)
        assert isinstance(plain.proc, subprocess.Popen)
        assert isinstance(differs.proc, subprocess.Popen)
        _wait_log(tmp_path / "controller.log", "entry controller")
        log = _wait_log(tmp_path / "worker-0.log", "entry worker-0")
        assert "a plain process: its load-time environment differs (OMP_WAIT_POLICY)" in log
        assert "entry worker-0" in log and " - ppid" in log  # a fresh interpreter


@pytest.mark.timeout(60)
def test_unsafe_parent_falls_back_to_plain_processes(tmp_path: Path) -> None:
    (tmp_path / "threads_at_import.py").write_text(
        "import threading, time\n"
        "threading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n"
    )
    sup = _supervisor(tmp_path)
    assert sup.forker is not None
    sup.forker.close()
    env = {**os.environ, **_env(tmp_path)}
    sup.forker = ForkServer(tmp_path, ["threads_at_import"], env, tmp_path / "fs.log", 30)
    with sup:
        m = sup.start(_spec(tmp_path, "inference-0"))
        assert isinstance(m.proc, subprocess.Popen)
        assert "2 threads after the imports" in sup.forker.why
        _wait_log(tmp_path / "inference-0.log", "entry inference-0")


def test_switch_marks_the_python_services_to_fork(tmp_path: Path) -> None:
    from areal_hex.config import load_config
    from hexctl.job.layout import build_layout
    from hexctl.launch.fork_services import preload_modules
    from hexctl.launch.run import process_specs

    base = [f"run.output_dir={tmp_path}", "run.run_id=r"]
    config = tmp_path / "r" / "config.yaml"
    for switch, want in (("true", True), ("false", False)):
        cfg = load_config(None, [*base, f"run.fork_services={switch}"])
        specs = {s.name: s.fork for s in process_specs(cfg, build_layout(cfg), config)}
        # Valkey and the controller (no torch) start at once, beside the imports
        assert specs.pop("redis") is False and specs.pop("controller") is False
        assert specs == {"inference-0": want, "trainer": want}
    cpu = load_config(None, base)
    assert "deepspeed" in preload_modules(cpu) and "torch" in preload_modules(cpu)
    assert "-scipy" in preload_modules(cpu)  # transformers' optional import, never used
    gpu = load_config(None, [*base, "trainer.device=cuda"])
    assert "deepspeed" not in preload_modules(gpu)


@pytest.mark.timeout(60)
def test_fork_server_gone_gives_plain_processes(tmp_path: Path) -> None:
    with _supervisor(tmp_path) as sup:
        first = sup.start(_spec(tmp_path, "inference-0"))
        assert isinstance(first.proc, ForkedProcess) and sup.forker is not None
        assert sup.forker.proc is not None
        sup.forker.proc.kill()  # e.g. the kernel's OOM killer
        sup.forker.proc.wait()
        later = sup.start(_spec(tmp_path, "inference-1"))
        assert isinstance(later.proc, subprocess.Popen)
        log = _wait_log(tmp_path / "inference-1.log", "entry inference-1")
        assert "a plain process: the fork server is gone" in log
        assert sup.running("inference-0")  # the forked one is the launcher's, not its


def test_preload_keeps_a_hidden_package_out_of_the_imports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "opt_dep.py").write_text("VALUE = 1\n")
    (tmp_path / "uses_opt.py").write_text(
        "import importlib.util\n"
        "HAS = importlib.util.find_spec('opt_dep') is not None\n"
        "if HAS:\n    import opt_dep\n"
    )
    (tmp_path / "needs_opt.py").write_text("import opt_dep\n")
    (tmp_path / "computed.py").write_text(
        "CALLS = []\n"
        "def __getattr__(name):\n"
        "    if name != 'value':\n"
        "        raise AttributeError(name)\n"
        "    CALLS.append(name)\n"
        "    globals()['value'] = 42\n"
        "    return 42\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    names = ("opt_dep", "uses_opt", "needs_opt", "computed")
    try:
        failed = preload(["-opt_dep", "uses_opt", "needs_opt"])
        # an optional user sees it absent; a hard one fails (its service imports it itself)
        assert sys.modules["uses_opt"].HAS is False and "opt_dep" not in sys.modules
        assert len(failed) == 1 and failed[0].startswith("needs_opt: ModuleNotFoundError")
        assert importlib.import_module("opt_dep").VALUE == 1  # importable afterwards
        assert preload(["-json", "uses_opt"]) == [] and sys.modules["json"] is not None
        # `MODULE:ATTR`: a value the module computes on first use, computed once here
        assert preload(["computed:value", "computed:value"]) == []
        assert sys.modules["computed"].CALLS == ["value"]
        assert preload(["computed:other"])[0].startswith("computed:other: AttributeError")
    finally:
        for name in names:
            sys.modules.pop(name, None)


@pytest.mark.timeout(60)
def test_fork_server_started_before_preparation_serves_the_prepared_run(tmp_path: Path) -> None:
    from areal_hex.config import load_config
    from hexctl.job.layout import build_layout
    from hexctl.launch.early_fork import early_fork_server
    from hexctl.launch.fork_services import attach_fork_server, serves
    from hexctl.launch.run import process_specs

    def specs(cfg):  # ExperimentConfig -> list[ProcessSpec]
        return process_specs(cfg, build_layout(cfg), tmp_path / "r" / "config.yaml")

    base = [f"run.output_dir={tmp_path}", "run.run_id=r"]
    cfg = load_config(None, base)
    # the phases share cores: servers' threads sleep at barriers (a load-time setting)
    colocated = load_config(None, [*base, "workflow.placement=colocated", "run.mode=sync"])
    other_run = load_config(None, [f"run.output_dir={tmp_path}", "run.run_id=q"])
    off = load_config(None, [*base, "run.fork_services=false"])
    assert early_fork_server(off, None) is None
    # a measurement of this machine may come first: no imports beside it
    assert early_fork_server(load_config(None, [*base, "run.profile_first=true"]), None) is None
    early = early_fork_server(cfg, None)
    assert early is not None and early.proc is not None
    try:
        assert serves(early, cfg, specs(cfg))
        for prepared in (colocated, other_run, off):
            assert not serves(early, prepared, specs(prepared))
        with Supervisor(pid_file=tmp_path / "pids.json") as sup:
            attach_fork_server(sup, cfg, specs(cfg), early)
            assert sup.forker is early
            assert (early.started_at, "launcher", "fork server started") in sup.events
        assert early.proc is None  # closed with the supervisor
        again = early_fork_server(cfg, None)
        assert again is not None
        with Supervisor(pid_file=tmp_path / "pids.json") as sup:
            attach_fork_server(sup, colocated, specs(colocated), again)
            assert again.proc is None and sup.forker is not None and sup.forker is not again
            forked = next(s for s in specs(colocated) if s.fork)
            assert forked.env["OMP_WAIT_POLICY"] == "PASSIVE"
            assert not sup.forker.differs({**os.environ, **forked.env})
    finally:
        early.close()


BRANCH_ENTRY = """\
import os, sys, time
loaded = sorted(m for m in ("json", "mod_t", "mod_s") if m in sys.modules)
print("ran", sys.argv[1], "ppid", os.getppid(), loaded, flush=True)
time.sleep(60)
"""


@pytest.mark.timeout(60)
def test_a_branch_forks_the_services_of_its_word_with_its_own_imports(tmp_path: Path) -> None:
    (tmp_path / "branch_entry.py").write_text(BRANCH_ENTRY)
    for name in ("mod_t", "mod_s"):
        (tmp_path / f"{name}.py").write_text("")
    env = {**os.environ, **_env(tmp_path)}
    modules = ["json", "@train", "mod_t", "@", "mod_s"]  # shared, the branch's, its own
    sup = Supervisor(poll_s=0.05, pid_file=tmp_path / "pids.json")
    sup.attach(ForkServer(tmp_path, modules, env, tmp_path / "fork-server.log", 30))

    def spec(name: str, word: str) -> ProcessSpec:
        cmd = [sys.executable, "-m", "branch_entry", word, "c.yaml"]
        log = tmp_path / f"{name}.log"
        return ProcessSpec(name, cmd, log, _env(tmp_path), on_exit="restart", fork=True)

    with sup:
        forked = [sup.start(spec("inference-0", "serve")), sup.start(spec("trainer", "train"))]
        assert all(isinstance(m.proc, ForkedProcess) for m in forked)
        server = _wait_log(tmp_path / "inference-0.log", "ran serve")
        trainer = _wait_log(tmp_path / "trainer.log", "ran train")
        assert f"ppid {os.getpid()} ['json', 'mod_s']" in server  # the launcher's child
        assert f"ppid {os.getpid()} ['json', 'mod_t']" in trainer
        first = sup.pid("trainer")
        assert first is not None
        os.kill(first, signal.SIGKILL)  # forked again, by the same branch
        trainer = _wait_log(tmp_path / "trainer.log", "ran train", 2, sup)
        assert trainer.count(f"ppid {os.getpid()} ['json', 'mod_t']") == 2
    log = (tmp_path / "fork-server.log").read_text()
    assert "fork server (train): 1 modules imported" in log
    assert "fork server: 2 modules imported" in log


@pytest.mark.timeout(60)
def test_an_unsafe_branch_gives_its_services_plain_processes(tmp_path: Path) -> None:
    (tmp_path / "branch_entry.py").write_text(BRANCH_ENTRY)
    (tmp_path / "threads_at_import.py").write_text(
        "import threading, time\n"
        "threading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n"
    )
    env = {**os.environ, **_env(tmp_path)}
    sup = Supervisor(poll_s=0.05, pid_file=tmp_path / "pids.json")
    modules = ["json", "@train", "threads_at_import"]
    sup.attach(ForkServer(tmp_path, modules, env, tmp_path / "fork-server.log", 30))
    with sup:
        started = {}
        for name, word in (("trainer", "train"), ("inference-0", "serve")):
            cmd = [sys.executable, "-m", "branch_entry", word]
            log = tmp_path / f"{name}.log"
            started[name] = sup.start(ProcessSpec(name, cmd, log, _env(tmp_path), fork=True))
        assert isinstance(started["trainer"].proc, subprocess.Popen)  # its branch: unsafe
        assert isinstance(started["inference-0"].proc, ForkedProcess)  # the first: forks
        log = _wait_log(tmp_path / "trainer.log", "ran train")
        assert "a plain process: the fork server refused: its fork server: 2 threads" in log
        _wait_log(tmp_path / "inference-0.log", "ran serve")
