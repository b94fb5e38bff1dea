"""Request and response shapes of the inference server: the SGLang native HTTP subset.

Plain pydantic models, one per endpoint body, used by the server (rollout_service/app.py)
to read requests and write responses and by the client (rollout_service/client.py) to
read responses. Like SGLang, requests ignore unknown keys (clients send more than we
use); values we do read are validated and a bad one fails with the field's path (422).

Policy versions are strings on the wire (SGLang's `weight_version`, e.g. "default") and
`int` in Python: `version_from_wire` / `version_to_wire` are the only conversion.
"""

from __future__ import annotations

from functools import cached_property
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    field_validator,
    model_validator,
)

# Union branches are tagged so a validation error names the field, not pydantic's
# internal union member; the app drops these tags from error locations.
SINGLE, BATCH = "<single>", "<batch>"
UNION_TAGS = frozenset({SINGLE, BATCH})


def _one_or_many(value: Any) -> str:
    return BATCH if isinstance(value, list) else SINGLE


def _nested_or_flat(value: Any) -> str:
    return BATCH if isinstance(value, list) and value and isinstance(value[0], list) else SINGLE


class Lenient(BaseModel):
    """Unknown keys are accepted and ignored, as SGLang does."""

    model_config = ConfigDict(extra="ignore")


class SamplingParamsIn(Lenient):
    """The server's one sampling-parameter type: read from the request, kept on the
    engine's request and read by the step loop. A null value means the default, as in
    SGLang. (The client's is areal_hex.api.SamplingParams; `to_wire` writes this shape.)"""

    max_new_tokens: int = Field(128, ge=0)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1)
    min_p: float = Field(0.0, ge=0, le=1)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    n: int = Field(1, ge=1, le=1)  # RL clients send one sample per request

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data

    @field_validator("top_k")
    @classmethod
    def _top_k_nonzero(cls, v: int) -> int:
        if v == 0:
            raise ValueError("top_k must be -1 (all tokens) or >= 1, got 0")
        return v

    def stop_strings(self) -> list[str]:
        return list(self.stop_texts)

    # Read once per generated token by the step loop: computed once per request.
    @cached_property
    def stop_texts(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(s for s in self.stop if s)

    @cached_property
    def stop_ids(self) -> frozenset[int]:
        return frozenset(self.stop_token_ids or ())


def _tagged(single: Any, batch: Any, how: Any = _one_or_many) -> Any:
    return Annotated[
        Annotated[single, Tag(SINGLE)] | Annotated[batch, Tag(BATCH)], Discriminator(how)
    ]


class GenerateReqInput(Lenient):
    text: _tagged(str, list[str]) | None = None  # type: ignore[valid-type]
    input_ids: _tagged(list[int], list[list[int]], _nested_or_flat) | None = None  # type: ignore[valid-type]
    sampling_params: _tagged(SamplingParamsIn, list[SamplingParamsIn]) | None = None  # type: ignore[valid-type]
    return_logprob: _tagged(bool, list[bool]) = False  # type: ignore[valid-type]
    logprob_start_len: _tagged(int, list[int]) = -1  # type: ignore[valid-type]
    top_logprobs_num: _tagged(int, list[int]) = 0  # type: ignore[valid-type]
    return_text_in_logprobs: bool = False
    rid: _tagged(str, list[str]) | None = None  # type: ignore[valid-type]
    stream: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> GenerateReqInput:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("exactly one of input_ids or text is required")
        return self

    @property
    def is_batch(self) -> bool:
        if self.input_ids is not None:
            return bool(self.input_ids) and isinstance(self.input_ids[0], list)
        return isinstance(self.text, list)

    def batch_size(self) -> int:
        if not self.is_batch:
            return 1
        return len(self.input_ids if self.input_ids is not None else self.text or [])

    def item(self, i: int) -> tuple[list[int] | str, SamplingParamsIn, bool, str | None]:
        """(prompt, sampling params, return_logprob, rid) of batch element `i`; checks
        that per-element lists have the batch's length."""
        n = self.batch_size()
        src = self.input_ids if self.input_ids is not None else self.text
        prompt = src[i] if self.is_batch else src  # type: ignore[index]
        return (
            prompt,  # type: ignore[return-value]
            _pick(self.sampling_params, i, n, "sampling_params") or SamplingParamsIn(),
            bool(_pick(self.return_logprob, i, n, "return_logprob")),
            _pick(self.rid, i, n, "rid"),
        )


def _pick(value: Any, i: int, n: int, name: str) -> Any:
    if not isinstance(value, list):
        return value
    if len(value) != n:
        raise ValueError(f"{name}: a list of {len(value)} for a batch of {n}")
    return value[i]


class FinishReason(BaseModel):
    type: Literal["stop", "length", "abort"]
    matched: int | str | None = None
    length: int | None = None
    message: str | None = None

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.type}
        if self.type == "stop":
            out["matched"] = self.matched
        elif self.type == "length":
            out["length"] = self.length
        else:
            out["message"] = self.message or "aborted"
        return out


def version_from_wire(value: Any) -> int | None:
    """A wire version as an int; None when it is not one (SGLang's "default")."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    try:
        return int(str(value))
    except ValueError:
        return None


def version_to_wire(version: int) -> str:
    return str(int(version))


class MetaInfo(Lenient):
    """`meta_info` of a /generate response. Defaults let the client read SGLang versions
    that omit a field; our server always sets every field it has."""

    id: str = ""
    # None only in a streaming chunk of a request that still runs
    finish_reason: dict[str, Any] | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    weight_version: str | int | None = None
    e2e_latency: float = 0.0
    # [[logprob, token_id, text|null], ...] one per output token
    output_token_logprobs: list[list[Any]] | None = None
    input_token_logprobs: list[list[Any]] | None = None
    # ours, beyond SGLang: the weight version that sampled each output token
    output_token_versions: list[str | int] | None = None


class GenerateOutput(Lenient):
    text: str = ""
    output_ids: list[int] | None = None  # some servers leave them to the log-prob tuples
    meta_info: MetaInfo

    def to_wire(self) -> dict[str, Any]:
        """The response body: the fields that were set (a request without log-probs has
        no log-prob keys, as in SGLang)."""
        return self.model_dump(exclude_unset=True)


class UpdateWeightsFromDiskReq(Lenient):
    model_path: str = Field(min_length=1)
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    flush_cache: bool = True


class UpdateWeightsResp(BaseModel):
    success: bool
    message: str
    num_paused_requests: int = 0


class UpdateWeightVersionReq(Lenient):
    new_version: str
    abort_all_requests: bool = False


class PauseReq(Lenient):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class AbortReq(Lenient):
    rid: str | None = None
    abort_all: bool = False


class ModelInfo(BaseModel):
    model_path: str
    tokenizer_path: str | None
    is_generation: bool = True
    weight_version: str
    architectures: list[str] = []
    context_length: int = 0


def error_body(message: str) -> dict[str, Any]:
    """SGLang's error shape."""
    return {"error": {"message": message}}
