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
PACKAGES = ("areal_hex", "rollout_service", "trainer_service", "scheduler")


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


def test_every_core_module_is_in_the_contract() -> None:
    """A new top-level module must take its place in a layer, or nothing checks it."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    layers = cfg["contracts"][0]["layers"]
    named = {n.strip() for layer in layers for n in layer.replace("|", ":").split(":")}
    core = {
        f"areal_hex.{p.stem}" for p in (ROOT / "areal_hex").glob("*.py") if p.stem != "__init__"
    } | {
        f"areal_hex.{p.name}"
        for p in (ROOT / "areal_hex").iterdir()
        if (p / "__init__.py").exists()
    }
    assert sorted(core - named) == []
