"""Every `from PACKAGE.module import name` in the project's code names something that
exists, the imports inside functions included (those run only on their path: a profile
stage, a bench, a deploy target, which a unit test may not reach)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("areal_hex", "rollout_service", "trainer_service", "scheduler", "hexctl")


def _project_imports() -> list[tuple[str, int, str, str]]:
    found = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, ast.ImportFrom) or node.level or not node.module:
                    continue
                if node.module.split(".")[0] not in PACKAGES:
                    continue
                rel = str(path.relative_to(ROOT))
                found += [(rel, node.lineno, node.module, a.name) for a in node.names]
    return found


def test_every_imported_name_exists() -> None:
    imports = _project_imports()
    assert len(imports) > 500  # the walk found the code
    missing = []
    for where, line, module, name in imports:
        mod = importlib.import_module(module)
        if name == "*" or hasattr(mod, name):
            continue
        try:  # a submodule of a package
            importlib.import_module(f"{module}.{name}")
        except ImportError:
            missing.append(f"{where}:{line}: from {module} import {name}")
    assert missing == []
