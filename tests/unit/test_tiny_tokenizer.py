"""The tiny model's tokenizer without transformers (the controller's, at its start):
the same chats, encodings, decodings and ids as transformers' class over the same files;
any other tokenizer still goes through transformers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from areal_hex.models import build_tokenizer
from areal_hex.tokenizer_files import (
    TinyTokenizer,
    is_tiny_tokenizer,
    load_controller_tokenizer,
)

TEXTS = [
    "What is 13 + 4?\n13 + 4 = 17\n#### 17<|im_end|>",
    "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n",
    "caf\u00e9 \u2014 tabs\tand <|pad|><|endoftext|> unknown \u00fc",
    "",
]


@pytest.fixture()
def saved(tmp_path: Path) -> Path:
    build_tokenizer().save_pretrained(tmp_path)
    return tmp_path


def test_tiny_tokenizer_is_transformers_on_the_same_files(saved: Path) -> None:
    from transformers import AutoTokenizer

    tiny, auto = TinyTokenizer(saved), AutoTokenizer.from_pretrained(str(saved))
    assert (tiny.eos_token_id, tiny.vocab_size) == (auto.eos_token_id, auto.vocab_size)
    assert tiny.chat_template == auto.chat_template
    for text in TEXTS:
        for add in (True, False):
            ids = tiny(text, add_special_tokens=add)["input_ids"]
            assert ids == auto(text, add_special_tokens=add)["input_ids"], (text, add)
            for skip in (True, False):
                got = tiny.decode(ids, skip_special_tokens=skip)
                assert got == auto.decode(ids, skip_special_tokens=skip), (text, skip)
    chat = [
        {"role": "system", "content": "Add."},
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "5"},
    ]
    for gen in (False, True):
        want = auto.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
        assert tiny.apply_chat_template(chat, add_generation_prompt=gen) == want


def test_only_the_tiny_tokenizer_skips_transformers(saved: Path, tmp_path: Path) -> None:
    assert is_tiny_tokenizer(saved)
    assert isinstance(load_controller_tokenizer(saved), TinyTokenizer)
    code = (
        "import sys\n"
        "from areal_hex.tokenizer_files import load_controller_tokenizer\n"
        "tok = load_controller_tokenizer(sys.argv[1])\n"
        "print(type(tok).__name__, tok('1 + 2')['input_ids'], 'transformers' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(saved)], capture_output=True, text=True, check=True
    )
    ids = TinyTokenizer(saved)("1 + 2")["input_ids"]
    assert out.stdout.split(" ", 1) == ["TinyTokenizer", f"{ids} False\n"]
    assert not is_tiny_tokenizer(tmp_path / "none")
    (saved / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    assert not is_tiny_tokenizer(saved)
    assert not isinstance(load_controller_tokenizer(saved), TinyTokenizer)
