from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

# DeepSpeed JIT-builds its CPU comm op into TORCH_EXTENSIONS_DIR (default: one directory
# per user). Two checkouts testing at once would rebuild it over each other; each
# environment keeps its own build.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
# Profiles `run.profile_first` keeps across runs: one cache per test session, never the
# user's (a run of the suite starts from a machine that has profiled nothing).
os.environ["AREAL_HEX_CACHE_DIR"] = tempfile.mkdtemp(prefix="areal-hex-test-cache-")
atexit.register(shutil.rmtree, os.environ["AREAL_HEX_CACHE_DIR"], ignore_errors=True)


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


# Tests of one machine-wide resource (the network namespaces a box makes, the local
# Slurm cluster) run one after another on one worker when the suite runs in parallel.
_ONE_WORKER = {"test_box.py": "box", "test_slurm.py": "slurm"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        group = _ONE_WORKER.get(item.path.name)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
