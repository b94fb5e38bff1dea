"""The warm-started v0 is built once per key and copied into later runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from areal_hex.config import ModelConfig, TinyModelConfig
from hexctl.job import v0_cache


def test_second_run_copies_the_cached_v0(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import areal_hex.models as models

    monkeypatch.setenv("AREAL_HEX_CACHE_DIR", str(tmp_path / "cache"))
    model = ModelConfig(tiny=TinyModelConfig(num_layers=1, sft_steps=2, sft_batch_size=2))
    texts = ["1 + 2 = 3\n#### 3", "4 + 5 = 9\n#### 9"]
    first = v0_cache.warm_started_v0(model, texts, tmp_path / "a" / "v0")
    built = {p.name: p.read_bytes() for p in first.iterdir() if p.is_file()}
    assert "config.json" in built

    def no_build(*a: object, **k: object) -> None:
        raise AssertionError("v0 was built again")

    monkeypatch.setattr(models, "materialize", no_build)
    second = v0_cache.warm_started_v0(model, texts, tmp_path / "b" / "v0")
    assert {p.name: p.read_bytes() for p in second.iterdir() if p.is_file()} == built
    # other texts or another model: another key, so the cache is not used
    key = v0_cache.v0_key(model, texts)
    assert v0_cache.v0_key(model, texts[:1]) != key
    other = ModelConfig(tiny=TinyModelConfig(num_layers=1, sft_steps=3, sft_batch_size=2))
    assert v0_cache.v0_key(other, texts) != key
    with pytest.raises(AssertionError, match="built again"):
        v0_cache.warm_started_v0(other, texts, tmp_path / "c" / "v0")
