"""The engine of a reward-model server: a sequence classifier that scores whole inputs
(no generation, no KV cache). Texts are tokenized here; forwards of at most `max_batch`
inputs run one at a time in a worker thread, so the event loop keeps answering health
checks while a batch is scored.

    clf = Classifier(model, tokenizer, "path/to/rm", max_batch=64)
    [(scores, prompt_tokens), ...] = await clf.classify(["prompt + answer", [1, 2, 3]])
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from areal_hex.reward_model import score_ids
from rollout_service.server.requests import EngineError


@dataclass
class ClassifierStats:
    requests: int = 0
    inputs: int = 0
    tokens: int = 0
    seconds: float = 0.0  # in forward passes


class Classifier:
    def __init__(
        self,
        model: Any,
        tokenizer: Any | None,
        model_path: str,
        weight_version: str = "0",
        max_batch: int = 64,
        context_length: int | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.model_path = model_path
        self.weight_version = weight_version
        self.max_batch = max_batch
        limit = getattr(model.config, "max_position_embeddings", None) or 1 << 30
        self.context_length = min(context_length or limit, limit)
        self.vocab_size = int(model.config.vocab_size)
        self.stats = ClassifierStats()
        self._lock = threading.Lock()

    @property
    def num_labels(self) -> int:
        return int(self.model.config.num_labels)

    def alive(self) -> bool:
        return True

    def encode(self, inputs: Sequence[str | list[int]]) -> list[list[int]]:
        """Token ids of each input, refused (400, naming the input) when empty, over the
        context, out of the vocabulary, or text without a tokenizer."""
        out = []
        for i, x in enumerate(inputs):
            if isinstance(x, str):
                if self.tokenizer is None:
                    raise EngineError(f"input {i}: text needs a tokenizer; send input_ids")
                ids = list(self.tokenizer(x, add_special_tokens=False)["input_ids"])
            else:
                ids = list(x)
                bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
                if bad is not None:
                    raise EngineError(
                        f"input {i}: token id {bad} is outside the vocabulary "
                        f"(0..{self.vocab_size - 1})"
                    )
            if not ids:
                raise EngineError(f"input {i}: empty; expected at least one token")
            if len(ids) > self.context_length:
                raise EngineError(
                    f"input {i}: {len(ids)} tokens exceed the context length {self.context_length}"
                )
            out.append(ids)
        return out

    async def classify(self, inputs: Sequence[str | list[int]]) -> list[tuple[list[float], int]]:
        """(the model's outputs, token count) of each input."""
        ids = self.encode(inputs)
        scores = await asyncio.to_thread(self._forward, ids)
        return [(s, len(x)) for s, x in zip(scores, ids, strict=True)]

    def _forward(self, ids: list[list[int]]) -> list[list[float]]:
        import time

        with self._lock:
            t0 = time.perf_counter()
            scores = score_ids(self.model, self.tokenizer_or_pad(), ids, self.max_batch)
            self.stats.seconds += time.perf_counter() - t0
            self.stats.requests += 1
            self.stats.inputs += len(ids)
            self.stats.tokens += sum(len(x) for x in ids)
        return scores

    def tokenizer_or_pad(self) -> Any:
        """What `score_ids` pads with: the tokenizer, else the model's pad token id."""
        if self.tokenizer is not None and self.tokenizer.pad_token_id is not None:
            return self.tokenizer
        return _Pad(int(self.model.config.pad_token_id))


@dataclass(frozen=True)
class _Pad:
    pad_token_id: int
