"""The group record: one prompt and its G scored completions, as the buffer carries it.

A group's version is the oldest policy version among its generated tokens: that is the
version the staleness rules compare against. Each completion names the inference server
that produced its last tokens and that server's GPU kind (the trainer reports the
train-inference mismatch by both).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

# 2: each completion's `server` and `gpu_kind` are fields (schema 1 carried them as
# comma-joined group metadata). A completion's `ref_logprobs` is optional within
# schema 2: a record without it (every record written before it existed) still decodes.
SCHEMA_VERSION = 2

FINISH_REASONS = ("stop", "length", "abort")


@dataclass
class Completion:
    token_ids: np.ndarray  # (T,) int32, generated tokens only
    logprobs: np.ndarray  # (T,) float32, behaviour log-prob of each token as sampled
    versions: np.ndarray  # (T,) int32, policy version that produced each token
    finish_reason: str  # one of FINISH_REASONS
    reward: float
    text: str = ""
    server: str = ""  # URL of the inference server of its last tokens ("": not recorded)
    gpu_kind: str = ""  # that server's GPU kind (`inference.gpu_kinds`; "": not given)
    # (T,) float32, log-prob of each token under the reference policy (π_ref, the initial
    # weights) at the group's temperature, scored by the workflow's reference task;
    # None: not scored (the trainer computes it, when its objective needs it)
    ref_logprobs: np.ndarray | None = None

    def __post_init__(self) -> None:
        self.token_ids = np.asarray(self.token_ids, dtype=np.int32)
        self.logprobs = np.asarray(self.logprobs, dtype=np.float32)
        self.versions = np.asarray(self.versions, dtype=np.int32)
        if self.ref_logprobs is not None:
            self.ref_logprobs = np.asarray(self.ref_logprobs, dtype=np.float32)
        n = len(self.token_ids)
        ref = n if self.ref_logprobs is None else len(self.ref_logprobs)
        if len(self.logprobs) != n or len(self.versions) != n or ref != n:
            raise ValueError(
                f"completion lengths differ: token_ids={n} logprobs={len(self.logprobs)} "
                f"versions={len(self.versions)} ref_logprobs={ref}"
            )
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"finish_reason {self.finish_reason!r} not in {FINISH_REASONS}")

    @classmethod
    def from_checked(
        cls,
        token_ids: np.ndarray,
        logprobs: np.ndarray,
        versions: np.ndarray,
        finish_reason: str,
        reward: float,
        text: str,
        server: str,
        gpu_kind: str,
        ref_logprobs: np.ndarray | None = None,
    ) -> Completion:
        """A completion from fields a decoder has already checked (int32/float32 arrays
        of one length, a known finish reason): skips the conversions of `__init__`, which
        would dominate decoding a group of many short completions."""
        c = cls.__new__(cls)
        c.token_ids, c.logprobs, c.versions = token_ids, logprobs, versions
        c.finish_reason, c.reward, c.text = finish_reason, reward, text
        c.server, c.gpu_kind, c.ref_logprobs = server, gpu_kind, ref_logprobs
        return c


@dataclass
class GroupRecord:
    prompt_id: str
    prompt_ids: np.ndarray  # (P,) int32
    completions: list[Completion]
    # Sampling temperature the completions were drawn at (the trainer applies it too).
    temperature: float = 1.0
    created_at: float = 0.0  # unix seconds when the first request was sent
    finished_at: float = 0.0  # unix seconds when the last reward was computed
    metadata: dict[str, str] = field(default_factory=dict)
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        self.prompt_ids = np.asarray(self.prompt_ids, dtype=np.int32)
        if not self.completions:
            raise ValueError(f"group {self.prompt_id!r} has no completions")

    @classmethod
    def from_checked(
        cls,
        prompt_id: str,
        prompt_ids: np.ndarray,
        completions: list[Completion],
        temperature: float,
        created_at: float,
        finished_at: float,
        metadata: dict[str, str],
    ) -> GroupRecord:
        """A group from fields a decoder has already checked (an int32 prompt, at least
        one completion): skips `__post_init__`, as `Completion.from_checked` does."""
        g = cls.__new__(cls)
        g.prompt_id, g.prompt_ids, g.completions = prompt_id, prompt_ids, completions
        g.temperature, g.created_at, g.finished_at = temperature, created_at, finished_at
        g.metadata, g.schema_version = metadata, SCHEMA_VERSION
        return g

    @property
    def version(self) -> int:
        """Oldest policy version among the group's tokens (a group with no tokens: -1)."""
        mins = [int(c.versions.min()) for c in self.completions if len(c.versions)]
        return min(mins) if mins else -1

    @property
    def has_ref_logprobs(self) -> bool:
        """Whether every completion carries the reference policy's log-probs."""
        return all(c.ref_logprobs is not None for c in self.completions)

    @property
    def rewards(self) -> np.ndarray:
        return np.array([c.reward for c in self.completions], dtype=np.float32)

    @property
    def num_tokens(self) -> int:
        return sum(len(self.prompt_ids) + len(c.token_ids) for c in self.completions)
