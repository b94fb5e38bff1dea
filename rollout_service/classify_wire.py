"""Request and response shapes of a reward-model server's `/classify` (and `/encode`):
SGLang's, where a reward model launched with `--is-embedding` reads an
`EmbeddingReqInput` and answers each input with `{"embedding": [score, ...],
"meta_info": {...}}` (one object for one input, a list for a batch). The built-in
server (rollout_service/server/classify_routes.py) reads and writes them; the
controller's client (rollout_service/controller/reward_model.py) writes the request
and reads the answer, from either server. Differences: docs/api.md.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field, field_validator, model_validator

from rollout_service.wire import (
    Lenient,
    Text,
    _nested_or_flat,
    _tagged,
    refuse_if_set,
)

MAX_BATCH = 4096  # inputs of one request


class ClassifyReq(Lenient):
    """One input (`text` or `input_ids`) or a batch of them; `rid` likewise. SGLang's
    dummy `sampling_params` is accepted and unused; its multimodal inputs are refused."""

    text: _tagged(Text, list[Text]) | None = None  # type: ignore[valid-type]
    input_ids: _tagged(list[int], list[list[int]], _nested_or_flat) | None = None  # type: ignore[valid-type]
    rid: _tagged(Text, list[Text]) | None = None  # type: ignore[valid-type]
    sampling_params: Any = None
    image_data: Any = None
    video_data: Any = None
    audio_data: Any = None
    input_embeds: Any = None
    lora_path: Any = None

    _unsupported = field_validator(
        "image_data", "video_data", "audio_data", "input_embeds", "lora_path"
    )(refuse_if_set)

    @model_validator(mode="after")
    def _one_input(self) -> ClassifyReq:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("exactly one of text or input_ids is required")
        n = len(self.inputs())
        if n == 0:
            raise ValueError("an empty batch: expected at least one input")
        if n > MAX_BATCH:
            raise ValueError(f"a batch of {n} inputs: expected at most {MAX_BATCH}")
        if self.is_batch and self.rid is not None:
            if not isinstance(self.rid, list) or len(self.rid) != n:
                raise ValueError(f"rid: expected a list of {n} ids for a batch of {n}")
        elif self.rid is not None and not isinstance(self.rid, str):
            raise ValueError("rid: expected one id for one input")
        return self

    @property
    def is_batch(self) -> bool:
        if self.input_ids is not None:
            return bool(self.input_ids) and isinstance(self.input_ids[0], list)
        return isinstance(self.text, list)

    def inputs(self) -> list[str | list[int]]:
        """Each input: a text or a token-id list."""
        if self.input_ids is not None:
            return list(self.input_ids) if self.is_batch else [list(self.input_ids)]  # type: ignore[arg-type]
        return list(self.text) if self.is_batch else [self.text]  # type: ignore[arg-type, list-item]

    def rids(self) -> list[str] | None:
        if self.rid is None:
            return None
        return list(self.rid) if isinstance(self.rid, list) else [self.rid]


class ClassifyMeta(Lenient):
    """`meta_info` of one answer: SGLang's keys for an embedding output (no
    completion_tokens: nothing is generated)."""

    id: str = ""
    # SGLang ends every embedding request with {"type": "length", "length": 0}
    finish_reason: dict[str, Any] | None = None
    prompt_tokens: int = 0
    weight_version: str | int | None = None
    total_retractions: int = 0
    e2e_latency: float = 0.0


class ClassifyOut(Lenient):
    """One input's answer: the model's outputs (one per label; a reward model has one,
    its score) and meta_info."""

    embedding: list[float] = Field(min_length=1)
    meta_info: ClassifyMeta = ClassifyMeta()

    @property
    def score(self) -> float:
        return float(self.embedding[0])


def read_answers(body: Any, n: int) -> list[ClassifyOut]:
    """The answers of a request of `n` inputs (a batch answers with a list, one input
    with one object); ValueError when the body is not that."""
    items = body if isinstance(body, list) else [body]
    if len(items) != n:
        raise ValueError(f"{len(items)} answer(s) for {n} input(s)")
    return [ClassifyOut.model_validate(x) for x in items]


class ClassifyInfo(BaseModel):
    """`/get_model_info` of a reward-model server (SGLang's keys)."""

    model_path: str
    tokenizer_path: str | None = None
    is_generation: bool = False
    weight_version: str = "0"
    num_labels: int = 1
    architectures: list[str] = []
