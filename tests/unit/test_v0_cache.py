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


WARM_START_PATH = """
import sys
from areal_hex.config import load_config
from areal_hex.tokenizer_files import TinyChat
from hexctl.job.warm_start import sft_texts
texts = sft_texts(load_config(sys.argv[1]), TinyChat())
assert len(texts) > 100
print(sorted(m for m in ("torch", "transformers", "tokenizers") if m in sys.modules))
"""


def test_the_warm_start_texts_without_the_tokenizer_are_the_same() -> None:
    """The launcher renders the warm start's texts (the v0 cache key) with the tiny chat
    template alone, without importing transformers; they are those the tiny tokenizer
    renders, with the chat template and without, so a cached v0 is found as before."""
    import subprocess
    import sys

    from areal_hex.config import load_config
    from areal_hex.models import build_tokenizer
    from areal_hex.tokenizer_files import TinyChat
    from hexctl.job.warm_start import sft_texts

    path = Path(__file__).resolve().parents[2] / "examples" / "tiny_cpu.yaml"
    tok = build_tokenizer()
    for over in ([], ["data.use_chat_template=false"], ["data.instruction=Think."]):
        cfg = load_config(path, over)
        assert sft_texts(cfg, TinyChat()) == sft_texts(cfg, tok), over
    chat = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    for gen in (False, True):
        want = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
        assert TinyChat().apply_chat_template(chat, add_generation_prompt=gen) == want
    with pytest.raises(ValueError, match="text only"):
        TinyChat().apply_chat_template(chat, tokenize=True)
    code = [sys.executable, "-c", WARM_START_PATH, str(path)]
    out = subprocess.run(code, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
