"""The start-up path: a named command builds only its own parser, the launcher looks up
its profile and the train command reaches its only rank without heavy imports, and a
local run's processes start on every core and move to their planned cores at the first
step (every thread of every process in the group)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hexctl.cli import build_parser, command_modules
from hexctl.launch.startup_cores import StartupCores
from hexctl.launch.supervisor import ProcessSpec, Supervisor

# a process with a second thread and a child process (its group), all asleep
FAMILY = (
    "import subprocess, sys, threading, time\n"
    "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
    "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
    "print('up', flush=True); time.sleep(60)\n"
)


def commands(parser) -> list[str]:  # argparse.ArgumentParser
    sub = next(a for a in parser._actions if a.dest == "command")
    return list(sub.choices)


def test_a_named_command_builds_only_its_parser() -> None:
    every = [m.rsplit(".", 1)[1].removesuffix("_cmd") for m in command_modules()]
    assert commands(build_parser()) == every
    assert commands(build_parser(only="serve")) == ["serve"]
    assert commands(build_parser(only="nosuch")) == every  # a typo gets every choice
    args = build_parser(only="serve").parse_args(["serve", "c.yaml", "--index", "1"])
    full = build_parser().parse_args(["serve", "c.yaml", "--index", "1"])
    assert vars(args) == vars(full)


TRAIN_PATH = """
import sys
from hexctl.cli import build_parser
from hexctl.cli.train_cmd import launcher_env, preflight, rank_env, single_rank
words = ["train", sys.argv[1], "run.run_id=r", "redis.url=redis://127.0.0.1:1/0"]
cfg = preflight(build_parser(only="train").parse_args(words))
env = {**launcher_env(cfg), **rank_env(cfg)}
assert single_rank(cfg) and env["DS_ACCELERATOR"] == "cpu" and env["OMP_NUM_THREADS"]
print(sorted(m for m in ("torch", "deepspeed", "transformers") if m in sys.modules))
"""


def test_the_train_command_reaches_its_only_rank_without_torch() -> None:
    """`areal-hex train` runs a one-rank job's rank in its own process (no second
    interpreter importing the CLI and config again), which it can only do while torch is
    not imported: the thread settings it sets are read at torch's import."""
    config = str(Path(__file__).resolve().parents[2] / "examples" / "tiny_cpu.yaml")
    out = subprocess.run(
        [sys.executable, "-c", TRAIN_PATH, config], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"


LAUNCH_PATH = """
import io, sys
from pathlib import Path
from areal_hex.config import load_config
from hexctl.launch.first_profile import profile_first
import hexctl.launch.run
cfg = load_config(sys.argv[1], ["run.profile_first=cached"])
out = io.StringIO()
assert profile_first(cfg, Path(sys.argv[2]), out)[0] is None, out.getvalue()
assert "no profile for this job" in out.getvalue()
heavy = ("torch", "transformers", "numpy", "rollout_service.client", "hexctl.profile.local")
print(sorted(m for m in heavy if m in sys.modules))
"""


def test_the_launcher_looks_up_its_profile_without_the_profilers_imports(tmp_path: Path) -> None:
    """Before the services start, the launcher looks up the job's kept profile; the
    profiler's client and servers (numpy, aiohttp) are imported only to measure one."""
    config = str(Path(__file__).resolve().parents[2] / "examples" / "tiny_cpu.yaml")
    env = {**os.environ, "AREAL_HEX_CACHE_DIR": str(tmp_path / "cache")}
    code = [sys.executable, "-c", LAUNCH_PATH, config, str(tmp_path / "run")]
    out = subprocess.run(code, capture_output=True, text=True, check=True, env=env)
    assert out.stdout.strip() == "[]"


def _threads(pid: int) -> list[int]:
    return [int(t.name) for t in Path(f"/proc/{pid}/task").iterdir()]


def _group(pid: int) -> list[int]:
    from areal_hex.lifetime import group_members

    return [p for p, _ in group_members(pid)]


def _start_family(sup: Supervisor, spec: ProcessSpec) -> int:
    """Start `spec` (a FAMILY) and wait until its thread and child are up; its pid."""
    sup.start(spec)
    pid = sup.pid(spec.name)
    assert pid is not None
    deadline = time.monotonic() + 20
    while "up" not in spec.log_path.read_text() or len(_group(pid)) < 2:
        assert time.monotonic() < deadline, "the process did not start its family"
        time.sleep(0.05)
    return pid


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs sched_setaffinity")
@pytest.mark.timeout(30)
def test_unpinned_start_then_planned_cores_at_the_first_step(tmp_path: Path) -> None:
    every = os.sched_getaffinity(0)
    one = {min(every)}
    planned = ProcessSpec("svc", [sys.executable, "-c", FAMILY], tmp_path / "svc.log", cpus=one)
    other = ProcessSpec("free", [sys.executable, "-c", "1"], tmp_path / "free.log")
    cores = StartupCores([planned, other])
    started = cores.unpinned([planned, other])
    assert started[0].cpus is None and started[1] is other and planned.cpus == one
    with Supervisor(poll_s=0.05) as sup:
        pid = _start_family(sup, started[0])
        assert os.sched_getaffinity(pid) == every
        assert not cores.check(sup, 0)  # the first value seen: the start goes on
        assert not cores.check(sup, 0)
        assert cores.check(sup, 1)  # the first step: pinned
        members = _group(pid)
        assert len(members) == 2
        for p in members:
            for tid in _threads(p):
                assert os.sched_getaffinity(tid) == one, (p, tid)
        assert sup.procs["svc"].spec.cpus == one  # a restart starts pinned
        assert not cores.check(sup, 2)  # once


def test_nothing_planned_starts_as_given(tmp_path: Path) -> None:
    spec = ProcessSpec("svc", [sys.executable, "-c", "1"], tmp_path / "svc.log")
    cores = StartupCores([spec])
    assert cores.unpinned([spec]) == [spec] and cores.done
    assert not cores.check(Supervisor(), 5)


def test_light_tokenizer_is_what_autotokenizer_loads(tmp_path: Path) -> None:
    """The tiny tokenizer saved to a directory loads through its own class, without the
    model config, and equals AutoTokenizer's; a directory without a config, or naming
    another class, goes through AutoTokenizer."""
    import json

    from transformers import AutoTokenizer

    from areal_hex.models import build_tokenizer
    from areal_hex.tokenizer_files import load_tokenizer_light, saved_tokenizer_class

    build_tokenizer().save_pretrained(tmp_path)
    light, auto = load_tokenizer_light(tmp_path), AutoTokenizer.from_pretrained(str(tmp_path))
    assert type(light) is type(auto)
    for key in ("special_tokens_map", "chat_template", "padding_side", "all_special_ids"):
        assert getattr(light, key) == getattr(auto, key), key
    text = "What is 13 + 4?\n13 + 4 = 17\n#### 17<|im_end|>"
    assert light(text)["input_ids"] == auto(text)["input_ids"]
    chat = [{"role": "user", "content": "What is 2 + 3?"}]
    kw = {"add_generation_prompt": True, "tokenize": False}
    assert light.apply_chat_template(chat, **kw) == auto.apply_chat_template(chat, **kw)
    assert saved_tokenizer_class(tmp_path / "none") is None
    cfg = tmp_path / "tokenizer_config.json"
    cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "tokenizer_class": "Other"}))
    assert saved_tokenizer_class(tmp_path) == "Other"
    cfg.write_text("not json")
    assert saved_tokenizer_class(tmp_path) is None


def test_the_reserved_core_is_outside_the_host_side() -> None:
    from hexctl.launch.startup_cores import reserved_core

    assert reserved_core({0, 1}, {1}) == 0
    assert reserved_core({0, 1}, {0}) == 1
    assert reserved_core({0, 1, 2, 3}, None) == 3
    assert reserved_core({0, 1}, {0, 1}) == 1  # colocated: every core is the host's
    assert reserved_core({4}, None) is None and reserved_core(None) is None


@pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs sched_setaffinity and two cores",
)
@pytest.mark.timeout(30)
def test_plain_processes_keep_off_the_reserved_core_until_released(tmp_path: Path) -> None:
    """While a fork server imports, the plain processes (and their threads and children)
    run on every core but the reserved one; once the forked services are started they
    are back on every core, restarts too; without a fork server nothing is held."""
    every = os.sched_getaffinity(0)
    reserve = max(every)
    plain = ProcessSpec("svc", [sys.executable, "-c", FAMILY], tmp_path / "svc.log")
    forked = ProcessSpec("srv", [sys.executable, "-c", "1"], tmp_path / "srv.log", fork=True)
    cores = StartupCores([plain, forked], reserve, set(every))
    assert cores.unpinned([plain, forked]) == [plain, forked] and not cores.held
    started = cores.unpinned([plain, forked], forking=True)
    assert started[0].cpus == every - {reserve} and started[1] is forked
    assert cores.held == {"svc"}
    with Supervisor(poll_s=0.05) as sup:
        pid = _start_family(sup, started[0])
        for p in _group(pid):
            assert all(os.sched_getaffinity(t) == every - {reserve} for t in _threads(p))
        assert cores.release(sup) >= 3  # two threads and the child
        for p in _group(pid):
            assert all(os.sched_getaffinity(t) == every for t in _threads(p)), p
        assert sup.procs["svc"].spec.cpus is None and not cores.held
        assert [e[1:] for e in sup.events if e[1] == "launcher"] == [
            ("launcher", "the fork server's core shared again")
        ]
        assert cores.release(sup) == 0 and len(sup.events) == 2  # once: its start and this
