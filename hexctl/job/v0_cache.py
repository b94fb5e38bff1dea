"""The tiny model's warm-started v0, kept across runs: the supervised warm start is most
of a small run's launch (tens of seconds on a 2-core machine), and the same config gives
the same weights, so it is made once per machine and copied into each later run.

The key is a hash of what the weights depend on: the model section (without its paths),
the warm-start texts themselves (data, split, instruction, fractions and seed are all in
them), the sources that build and train the tiny model (`areal_hex/models.py`) and the
torch and transformers versions. Entries live under `<cache>/v0/<key>`, the cache
directory of the profiles (`$AREAL_HEX_CACHE_DIR`, else `$XDG_CACHE_HOME/areal-hex`,
else `~/.cache/areal-hex`); removing one makes the next run build it again.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path

from areal_hex.config import ModelConfig


def cache_root() -> Path:
    env = os.environ.get("AREAL_HEX_CACHE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "areal-hex"


def v0_key(model: ModelConfig, texts: Sequence[str]) -> str:
    import areal_hex.models as models_src

    fields = model.model_dump(mode="json", exclude={"path", "tokenizer_path"})
    h = hashlib.sha256(json.dumps(fields, sort_keys=True).encode())
    for text in texts:
        h.update(text.encode())
        h.update(b"\0")
    h.update(Path(models_src.__file__).read_bytes())
    for pkg in ("torch", "transformers"):
        h.update(f"{pkg}={metadata.version(pkg)}".encode())
    return h.hexdigest()[:24]


def warm_started_v0(model: ModelConfig, texts: Sequence[str], out: Path) -> Path:
    """`out` holds the warm-started tiny model: copied from the cache, else built (and
    then stored; a cache that cannot be written only costs the next run the build)."""
    from areal_hex.models import materialize

    if (out / "config.json").is_file():
        return out
    entry = cache_root() / "v0" / v0_key(model, texts)
    if (entry / "config.json").is_file():
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(entry, tmp)
        tmp.replace(out)
        return out
    materialize(model, out, sft_texts=texts)
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}-", dir=entry.parent))
        shutil.copytree(out, tmp, dirs_exist_ok=True)
        try:
            tmp.rename(entry)
        except OSError:  # stored meanwhile by another run: keep that one
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError:
        pass
    return out
