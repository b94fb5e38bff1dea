"""The package structure docs/architecture.md describes: the import direction holds and no
module takes part in an import cycle."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("areal_hex", "rollout_service", "trainer_service", "scheduler", "hexctl")


def _cycles(adj: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(adj):
        if root in index:
            continue
        work = [(root, iter(sorted(adj[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(adj.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles() -> None:
    graph = grimp.build_graph(*PACKAGES)
    adj = {m: set(graph.find_modules_directly_imported_by(m)) for m in graph.modules}
    assert _cycles(adj) == []


def test_import_contract_holds() -> None:
    exe = shutil.which("lint-imports") or str(Path(sys.executable).with_name("lint-imports"))
    if not Path(exe).exists():
        pytest.skip("import-linter is not installed (pip install -e '.[dev]')")
    res = subprocess.run([exe], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout[-3000:]
    assert "0 broken" in res.stdout


def _layers() -> list[set[str]]:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    layers = cfg["contracts"][0]["layers"]
    return [{n.strip() for n in layer.replace("|", ":").split(":")} for layer in layers]


def _children(package: str) -> set[str]:
    """The modules and subpackages directly inside a package directory."""
    path = ROOT.joinpath(*package.split("."))
    mods = {
        f"{package}.{p.stem}" for p in path.glob("*.py") if p.stem not in ("__init__", "__main__")
    }
    return mods | {f"{package}.{p.name}" for p in path.iterdir() if (p / "__init__.py").exists()}


def test_every_module_is_in_a_layer() -> None:
    """Every module of the core and every subpackage of the face takes its place in a
    layer of the contract, or nothing checks its imports; the services and the planner
    form one layer each, whole."""
    named = set().union(*_layers())
    assert sorted(_children("areal_hex") - named) == []
    assert sorted(_children("hexctl") - named) == []
    assert {"rollout_service", "trainer_service", "scheduler"} <= named


def test_top_level_floors() -> None:
    """Three floors at the top level, and no import runs back up: the core imports no
    service and nothing of the face; the services and the planner import nothing of the
    face."""
    graph = grimp.build_graph(*PACKAGES)
    floors = {
        "areal_hex": 0,
        "rollout_service": 1,
        "trainer_service": 1,
        "scheduler": 1,
        "hexctl": 2,
    }
    upward = sorted(
        (m, d)
        for m in graph.modules
        for d in graph.find_modules_directly_imported_by(m)
        if floors[d.split(".")[0]] > floors[m.split(".")[0]]
    )
    assert upward == []


def test_rollout_service_is_two_processes() -> None:
    """The inference server and the controller each have a subpackage; at the top of
    rollout_service sit only the modules that join them (wire shapes and the client)."""
    top = {p.stem for p in (ROOT / "rollout_service").glob("*.py")} - {"__init__"}
    assert top == {"wire", "control_wire", "openai_wire", "classify_wire", "client"}
    graph = grimp.build_graph("rollout_service")
    for a, b in (("server", "controller"), ("controller", "server")):
        assert not graph.chain_exists(
            f"rollout_service.{a}", f"rollout_service.{b}", as_packages=True
        )


def test_one_room_per_job() -> None:
    """The box is one subpackage (its command module aside); every benchmark is either a
    whole-system run or a microbenchmark of one service; each command module registers
    one command, named as the module; the planner package times no device."""
    import argparse
    import importlib

    from hexctl.cli import command_modules

    face = ROOT / "hexctl"
    boxy = {str(p.relative_to(ROOT)) for p in face.rglob("*box*.py") if p.parent.name != "box"}
    assert boxy == {"hexctl/cli/box_cmd.py"}
    assert [p.name for p in (face / "bench").glob("*.py")] == ["__init__.py"]
    assert {p.name for p in (face / "bench").iterdir() if p.is_dir()} >= {"system", "micro"}
    for name in command_modules():
        sub = argparse.ArgumentParser().add_subparsers()
        importlib.import_module(name).register(sub)
        assert list(sub.choices) == [name.rsplit(".", 1)[1].removesuffix("_cmd")], name
    timing = [p.name for p in (ROOT / "scheduler").glob("*.py") if "import torch" in p.read_text()]
    assert timing == []
