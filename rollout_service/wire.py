"""Request and response shapes of the inference server: the SGLang native HTTP subset.

Plain pydantic models, one per endpoint body, used by the server (rollout_service/server/app.py)
to read requests and write responses and by the client (rollout_service/client.py) to
read responses. Like SGLang, a request body ignores unknown top-level keys, but
`sampling_params` takes only the keys SGLang defines (SGLang refuses others too), and a
key SGLang defines that the built-in engine does not implement (image inputs, LoRA,
structural tags, ...) is refused when set, never accepted and ignored. Every value
is validated (NaN and infinity included) and a bad one fails with the field's path
(HTTP 400). The shapes of the control endpoints (weight updates, pause, abort, memory,
model info, load) live in rollout_service/control_wire.py, the OpenAI-compatible ones
in rollout_service/openai_wire.py.

Policy versions are strings on the wire (SGLang's `weight_version`, e.g. "default") and
`int` in Python: `version_from_wire` / `version_to_wire` are the only conversion.
"""

from __future__ import annotations

import re
from functools import cached_property
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationInfo,
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


# Below this temperature a request samples greedily (SGLang's threshold).
GREEDY_BELOW = 1e-6
MAX_N = 1024  # samples per prompt in one request
LOGPROB_FLOOR = -9999.0  # written for a log-prob of -inf, which JSON cannot carry (vLLM's choice)
INT32 = 2**31 - 1


def _valid_unicode(value: str) -> str:
    """JSON may carry lone UTF-16 surrogates ("\\ud800"); no tokenizer or response can
    hold them."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = ord(value[exc.start])
        raise ValueError(
            f"not valid Unicode: lone surrogate U+{bad:04X} at character {exc.start}"
        ) from None
    return value


Text = Annotated[str, AfterValidator(_valid_unicode)]


def _nulls_dropped(data: Any) -> Any:
    if isinstance(data, dict):
        return {k: v for k, v in data.items() if v is not None}
    return data


def refuse_if_set(value: Any, info: ValidationInfo) -> Any:
    """A field SGLang defines that this server does not implement: set is a 400."""
    if value not in (None, False, [], {}):
        raise ValueError(f"{info.field_name} is not supported by the built-in engine")
    return value


class Lenient(BaseModel):
    """Unknown keys are accepted and ignored, as SGLang does; NaN and infinity are not
    numbers any field accepts."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class SamplingParamsIn(BaseModel):
    """The server's one sampling-parameter type: read from the request, kept on the
    engine's request and read by the step loop. A null value means the default, as in
    SGLang. (The client's is areal_hex.api.SamplingParams; `to_wire` writes this shape.)
    Ranges are SGLang's."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    max_new_tokens: int = Field(128, ge=0, le=INT32)
    min_new_tokens: int = Field(0, ge=0, le=INT32)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1, le=INT32)
    min_p: float = Field(0.0, ge=0, le=1)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0, le=2)
    logit_bias: dict[Text, float] | None = None  # token id (as a string) -> added logit
    stop: Text | list[Text] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = Field(1, ge=1, le=MAX_N)
    stream_interval: int = Field(1, ge=1, le=INT32)
    # constrained decoding (rollout_service/server/grammar.py): at most one of them
    regex: Text | None = None
    json_schema: Text | None = None  # a JSON schema, as JSON text
    ebnf: Text | None = None  # GBNF or Lark
    # a per-request random generator: the same seed draws the same tokens on the same
    # server (sample j of n > 1 uses seed + j, so the samples differ)
    sampling_seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)
    # SGLang's, not implemented here: refused when set
    structural_tag: Any = None
    stop_regex: Any = None
    custom_params: Any = None

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, data: Any) -> Any:
        return _nulls_dropped(data)

    _unsupported = field_validator(
        "structural_tag",
        "stop_regex",
        "custom_params",
    )(refuse_if_set)

    @field_validator("top_k")
    @classmethod
    def _top_k_nonzero(cls, v: int) -> int:
        if v == 0:
            raise ValueError("top_k must be -1 (all tokens) or >= 1, got 0")
        return v

    @field_validator("spaces_between_special_tokens")
    @classmethod
    def _spaces_default_only(cls, v: bool) -> bool:
        if not v:
            raise ValueError("only true (the default) is supported by the built-in engine")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys_are_ids(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (v or {}).items():
            if not key.strip().lstrip("-").isdigit():
                raise ValueError(f"keys are token ids, got {key!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"biases are in [-100, 100] (OpenAI's range), got {bias}")
        return v

    @model_validator(mode="after")
    def _one_grammar(self) -> SamplingParamsIn:
        given = [k for k in ("regex", "json_schema", "ebnf") if getattr(self, k) is not None]
        if len(given) > 1:
            raise ValueError(f"at most one of regex, json_schema, ebnf; got {', '.join(given)}")
        if given and self.min_new_tokens:
            raise ValueError(f"min_new_tokens cannot be combined with {given[0]}")
        return self

    @property
    def grammar(self) -> tuple[str, str] | None:
        """(kind, text) of the constrained-decoding grammar, if any."""
        for kind in ("regex", "json_schema", "ebnf"):
            text = getattr(self, kind)
            if text is not None:
                return kind, text
        return None

    @model_validator(mode="after")
    def _min_within_max(self) -> SamplingParamsIn:
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens ({self.min_new_tokens}) exceeds max_new_tokens "
                f"({self.max_new_tokens})"
            )
        return self

    def for_sample(self, j: int) -> SamplingParamsIn:
        """The parameters of sample j of a request asked for n times: its own seed."""
        if self.sampling_seed is None or j == 0:
            return self
        return self.model_copy(update={"sampling_seed": self.sampling_seed + j})

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @cached_property
    def shapes_logits(self) -> bool:
        """Whether the step loop must change this row's logits before sampling
        (penalties, logit bias, min_new_tokens): rows without it cost nothing."""
        return bool(
            self.frequency_penalty
            or self.presence_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.min_new_tokens
        )

    @cached_property
    def bias(self) -> dict[int, float]:
        return {int(k): v for k, v in (self.logit_bias or {}).items()}

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


StartLen = Annotated[int, Field(ge=-1, le=INT32)]
TopNum = Annotated[int, Field(ge=0, le=INT32)]


class PromptInput(Lenient):
    """One input or a batch: `text` or `input_ids` (exactly one), and `rid`; the part
    SGLang's GenerateReqInput and EmbeddingReqInput (classify_wire.py) share."""

    text: _tagged(Text, list[Text]) | None = None  # type: ignore[valid-type]
    input_ids: _tagged(list[int], list[list[int]], _nested_or_flat) | None = None  # type: ignore[valid-type]
    rid: _tagged(Text, list[Text]) | None = None  # type: ignore[valid-type]

    @model_validator(mode="after")
    def _one_input(self) -> PromptInput:
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


class GenerateReqInput(PromptInput):
    sampling_params: _tagged(SamplingParamsIn, list[SamplingParamsIn]) | None = None  # type: ignore[valid-type]
    return_logprob: _tagged(bool, list[bool]) = False  # type: ignore[valid-type]
    # first prompt position whose log-prob is returned (-1: output tokens only)
    logprob_start_len: _tagged(StartLen, list[StartLen]) = -1  # type: ignore[valid-type]
    top_logprobs_num: _tagged(TopNum, list[TopNum]) = 0  # type: ignore[valid-type]
    return_text_in_logprobs: bool = False
    stream: bool = False
    # SGLang's, not implemented here: refused when set
    input_embeds: Any = None
    image_data: Any = None
    video_data: Any = None
    audio_data: Any = None
    lora_path: Any = None
    lora_id: Any = None
    custom_logit_processor: Any = None
    session_params: Any = None
    token_ids_logprob: Any = None
    return_hidden_states: Any = None
    return_entropy: Any = None
    bootstrap_host: Any = None
    bootstrap_port: Any = None
    bootstrap_room: Any = None

    _unsupported = field_validator(
        "input_embeds",
        "image_data",
        "video_data",
        "audio_data",
        "lora_path",
        "lora_id",
        "custom_logit_processor",
        "session_params",
        "token_ids_logprob",
        "return_hidden_states",
        "return_entropy",
        "bootstrap_host",
        "bootstrap_port",
        "bootstrap_room",
    )(refuse_if_set)

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

    def logprob_options(self, i: int) -> tuple[int, int]:
        """(logprob_start_len, top_logprobs_num) of batch element `i`."""
        n = self.batch_size()
        return (
            int(_pick(self.logprob_start_len, i, n, "logprob_start_len")),
            int(_pick(self.top_logprobs_num, i, n, "top_logprobs_num")),
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


LogprobEntry = list[Any]  # [logprob | null, token_id, text | null]


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
    output_token_logprobs: list[LogprobEntry] | None = None
    # one per prompt position from logprob_start_len (the first position's logprob null)
    input_token_logprobs: list[LogprobEntry] | None = None
    # per position, the top_logprobs_num most likely tokens (null for prompt position 0)
    output_top_logprobs: list[list[LogprobEntry] | None] | None = None
    input_top_logprobs: list[list[LogprobEntry] | None] | None = None
    # ours, beyond SGLang: the weight version that sampled each output token
    output_token_versions: list[str | int] | None = None
    # SGLang's: tokens inside a reasoning section (no reasoning parser here: 0) and how
    # often the request was retracted (its KV cache recomputed) while it ran
    reasoning_tokens: int = 0
    total_retractions: int = 0


class GenerateOutput(Lenient):
    text: str = ""
    output_ids: list[int] | None = None  # some servers leave them to the log-prob tuples
    meta_info: MetaInfo

    def to_wire(self) -> dict[str, Any]:
        """The response body: the fields that were set (a request without log-probs has
        no log-prob keys, as in SGLang)."""
        return self.model_dump(exclude_unset=True)


_ERROR_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_error",
}
_FIELD = re.compile(r"[A-Za-z_][A-Za-z0-9_.\[\]]*")


def error_body(message: str, status: int = 400, param: str | None = None) -> dict[str, Any]:
    """The error shape of both APIs: OpenAI's `{"error": {message, type, param, code}}`
    (SGLang's native errors carry `message` only; the other keys are extra there).
    `param`: the field at fault; by default the `field:` a message starts with. A
    message quoting a lone surrogate keeps it escaped."""
    head = message.split(": ", 1)[0]
    if param is None and ": " in message and _FIELD.fullmatch(head):
        param = head
    kind = _ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {
        "error": {
            "message": message.encode("utf-8", "backslashreplace").decode("utf-8"),
            "type": kind,
            "param": param,
            "code": "invalid_api_key" if status == 401 else None,
        }
    }
