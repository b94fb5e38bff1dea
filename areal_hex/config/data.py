"""Datasets and prompts."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from areal_hex.config.base import Section


class ArithmeticConfig(Section):
    """Generated GSM8K-format problems ("What is 3 + 4?" -> "3 + 4 = 7\\n#### 7")."""

    num_operands: int = Field(2, ge=2, le=8)
    # Operands are drawn from [0, max_value].
    max_value: int = Field(9, ge=1)
    # Operators to draw from, any of "+", "-", "*".
    ops: str = "+"
    # Share of the problem space that belongs to the test split (chosen by a hash of the
    # problem, so train and test never overlap whatever their sizes).
    test_fraction: float = Field(0.1, gt=0, lt=1)

    @field_validator("ops")
    @classmethod
    def _ops(cls, v: str) -> str:
        if not v or any(c not in "+-*" for c in v):
            raise ValueError("expected a non-empty string of operators from '+', '-', '*'")
        return v


class DataConfig(Section):
    # arithmetic: generated GSM8K-format problems (no downloads).
    dataset: Literal["arithmetic", "gsm8k", "math500"] = "arithmetic"
    # Local parquet/jsonl file (or a directory holding `<split>*.parquet|jsonl`);
    # None for gsm8k/math500 means the HF hub dataset (needs the `datasets` package).
    path: str | None = None
    split: str = "train"
    eval_split: str = "test"
    num_generated: int = Field(2000, gt=0)
    max_prompt_tokens: int = Field(256, gt=0)
    # Prompts longer than max_prompt_tokens: "skip" (counted and logged) or "error".
    overlong: Literal["skip", "error"] = "skip"
    use_chat_template: bool = True
    # Appended to each question; None: the dataset's default (none for arithmetic,
    # "#### N" instruction for gsm8k, \boxed{} instruction for math500).
    instruction: str | None = None
    # How a single file (data.path not a directory) serves a split: "by_name" only the
    # split its file name names (test.jsonl serves "test"); "hash" train/test by a hash of
    # each question (file_test_fraction to test); "as_is" the whole file for any split.
    file_split: Literal["by_name", "hash", "as_is"] = "by_name"
    file_test_fraction: float = Field(0.1, gt=0, lt=1)
    # Use at most this many problems of the split (None: all).
    limit: int | None = Field(None, gt=0)
    shuffle: bool = True
    seed: int = 0
    arithmetic: ArithmeticConfig = ArithmeticConfig()
