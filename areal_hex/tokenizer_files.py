"""Loading a saved tokenizer without importing torch, where that gives the same object.

`AutoTokenizer.from_pretrained` reads the model's config first, and transformers' config
module imports torch: two seconds of CPU and more for a process that needs only the
tokenizer (the rollout controller). A directory whose `tokenizer_config.json` names the
generic fast tokenizer class (the tiny model's, as `areal_hex.models` saves it) is loaded
through that class directly, which is the class AutoTokenizer would pick: the same
special tokens, chat template and encodings. Any other directory (a hub name, a model
with its own tokenizer class) goes through AutoTokenizer.

The tiny model's own tokenizer needs not even transformers (half a second of CPU at the
controller's start, beside the starting servers): `TinyChat` renders its chat template
as transformers does, `TinyTokenizer` adds its encodings from the saved `tokenizer.json`
through the `tokenizers` library alone (`load_controller_tokenizer`).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from areal_hex.models import ALPHABET, CHAT_TEMPLATE, IM_END, SPECIAL_TOKENS

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def saved_tokenizer_class(path: str | Path) -> str | None:
    """The `tokenizer_class` of the tokenizer saved at `path`; None when there is none
    (not a directory, no or an unreadable tokenizer_config.json)."""
    try:
        data = json.loads((Path(path) / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None
    name = data.get("tokenizer_class") if isinstance(data, dict) else None
    return name if isinstance(name, str) else None


def load_tokenizer_light(path: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer at `path` as `AutoTokenizer.from_pretrained` loads it, without
    importing torch when it is the generic fast tokenizer."""
    from transformers import PreTrainedTokenizerFast

    generic = {PreTrainedTokenizerFast.__name__, "PreTrainedTokenizerFast"}
    if saved_tokenizer_class(path) in generic:
        return PreTrainedTokenizerFast.from_pretrained(str(path))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


class TinyChat:
    """What the tiny tokenizer (`areal_hex.models.build_tokenizer`) gives a prompt's text:
    its end-of-turn token and its chat template, rendered as transformers renders one (a
    sandboxed Jinja environment, blocks trimmed) but without importing transformers. The
    warm start's texts, and so the v0 cache key, are those the tokenizer gives."""

    chat_template = CHAT_TEMPLATE
    eos_token = IM_END

    def apply_chat_template(
        self,
        messages: list[dict[str, str]],
        tokenize: bool = False,
        add_generation_prompt: bool = False,
    ) -> str:
        if tokenize:
            raise ValueError("TinyChat renders text only: tokenize with TinyTokenizer")
        return str(
            _tiny_template().render(messages=messages, add_generation_prompt=add_generation_prompt)
        )


@functools.cache
def _tiny_template() -> Any:  # jinja2.Template
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(CHAT_TEMPLATE)


class TinyTokenizer(TinyChat):
    """The tiny tokenizer saved at `path`, as the controller uses it: a chat rendered,
    text encoded, ids decoded, the end-of-turn id; the same results as transformers'
    class over the same `tokenizer.json`."""

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(str(Path(path) / "tokenizer.json"))
        self.eos_token_id = self._tok.token_to_id(IM_END)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=False)

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": self._tok.encode(text, add_special_tokens=add_special_tokens).ids}

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens))


def is_tiny_tokenizer(path: str | Path) -> bool:
    """The tokenizer saved at `path` is the tiny one: its vocabulary, end-of-turn token
    and chat template."""
    root = Path(path)
    try:
        config = json.loads((root / "tokenizer_config.json").read_text())
        vocab = json.loads((root / "tokenizer.json").read_text())["model"]["vocab"]
        template = config.get("chat_template")
        if template is None:
            template = (root / "chat_template.jinja").read_text()
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False
    tiny = {tok: i for i, tok in enumerate((*SPECIAL_TOKENS, *ALPHABET))}
    return vocab == tiny and config.get("eos_token") == IM_END and template == CHAT_TEMPLATE


def load_controller_tokenizer(path: str | Path) -> Any:
    """What the controller encodes and decodes with: the tiny tokenizer without
    transformers, any other as `load_tokenizer_light` loads it."""
    return TinyTokenizer(path) if is_tiny_tokenizer(path) else load_tokenizer_light(path)
