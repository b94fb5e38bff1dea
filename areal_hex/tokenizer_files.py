"""Loading a saved tokenizer without importing torch, where that gives the same object.

`AutoTokenizer.from_pretrained` reads the model's config first, and transformers' config
module imports torch: two seconds of CPU and more for a process that needs only the
tokenizer (the rollout controller). A directory whose `tokenizer_config.json` names the
generic fast tokenizer class (the tiny model's, as `areal_hex.models` saves it) is loaded
through that class directly, which is the class AutoTokenizer would pick: the same
special tokens, chat template and encodings. Any other directory (a hub name, a model
with its own tokenizer class) goes through AutoTokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

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
