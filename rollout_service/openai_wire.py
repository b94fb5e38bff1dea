"""Request and response shapes of the OpenAI-compatible routes (`/v1/models`,
`/v1/completions`, `/v1/chat/completions`); the SGLang native shapes are in wire.py.

Like SGLang's OpenAI layer, unknown keys are ignored, and SGLang's sampling extensions
(`top_k`, `min_p`, `repetition_penalty`, `min_tokens`, `stop_token_ids`, `ignore_eos`,
`skip_special_tokens`, `no_stop_trim`) are taken. A key OpenAI or SGLang defines that
changes the output and that this server does not implement (`suffix`, tools,
structured output, images) is refused with a 400 naming it.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from rollout_service.wire import (
    INT32,
    MAX_N,
    SamplingParamsIn,
    Text,
    refuse_if_set,
)

MAX_TOP_LOGPROBS = 20


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: Text | None = None  # any name is served by the one model (as SGLang does)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: Text | list[Text] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: dict[Text, float] | None = None
    user: Text | None = None  # metadata only
    # SGLang's extensions
    top_k: int = Field(-1, ge=-1, le=INT32)
    min_p: float = Field(0.0, ge=0, le=1)
    repetition_penalty: float = Field(1.0, gt=0, le=2)
    min_tokens: int = Field(0, ge=0, le=INT32)
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    regex: Text | None = None
    json_schema: Text | None = None
    ebnf: Text | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)  # SGLang's sampling_seed
    # defined by OpenAI or SGLang, not implemented here: refused when set
    lora_path: Any = None

    _unsupported = field_validator("lora_path")(refuse_if_set)

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, data: Any) -> Any:
        # OpenAI clients send null for "not given"; `max_tokens: null` stays meaningful
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None or k == "max_tokens"}
        return data

    def sampling(self, max_new_tokens: int, top_logprobs: int = 0) -> dict[str, Any]:
        """The SamplingParamsIn fields this request asks for (validated by the caller)."""
        return {
            "max_new_tokens": max_new_tokens,
            "min_new_tokens": min(self.min_tokens, max_new_tokens),
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "frequency_penalty": self.frequency_penalty,
            "presence_penalty": self.presence_penalty,
            "repetition_penalty": self.repetition_penalty,
            "logit_bias": self.logit_bias,
            "stop": self.stop,
            "stop_token_ids": self.stop_token_ids,
            "ignore_eos": self.ignore_eos,
            "skip_special_tokens": self.skip_special_tokens,
            "no_stop_trim": self.no_stop_trim,
            "regex": self.regex,
            "json_schema": self.json_schema,
            "ebnf": self.ebnf,
            "sampling_seed": self.seed,
        }

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


Prompt = Text | list[Text] | list[int] | list[list[int]]


class CompletionRequest(_Request):
    prompt: Prompt
    max_tokens: int | None = Field(16, ge=0, le=INT32)  # null: up to the context length
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    best_of: int | None = Field(None, ge=1)
    suffix: Any = None

    _refused = field_validator("suffix")(refuse_if_set)

    @model_validator(mode="after")
    def _best_of_is_n(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of: only best_of == n is supported (every sample returned)")
        return self

    def prompts(self) -> list[str] | list[list[int]]:
        """The request's prompts: texts or token-id lists."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            return []
        if isinstance(p[0], int):
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None
    name: Text | None = None
    tool_calls: Any = None

    _refused = field_validator("tool_calls")(refuse_if_set)

    def for_template(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        out: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            out["name"] = self.name
        return out


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: Text | None = None
    schema_: dict[Text, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """`text`, `json_object` (any JSON object) or `json_schema` (that schema): the JSON
    modes run as SGLang's `json_schema` constrained decoding."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def schema_text(self) -> str | None:
        if self.type == "json_object":
            return '{"type": "object"}'
        if self.type == "json_schema":
            if self.json_schema is None:
                raise ValueError("response_format.json_schema: required for type json_schema")
            return json.dumps(self.json_schema.schema_ or {})
        return None


class ChatRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=0, le=INT32)  # null: up to the context length
    max_completion_tokens: int | None = Field(None, ge=0, le=INT32)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    response_format: ResponseFormat | None = None
    chat_template_kwargs: dict[Text, Any] | None = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None

    @field_validator("tools", "functions", "function_call")
    @classmethod
    def _no_tools(cls, v: Any, info: Any) -> Any:
        return refuse_if_set(v, info)

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice_none(cls, v: Any) -> Any:
        if v is not None and v != "none":
            raise ValueError("only 'none' is supported (no tool calling)")
        return v

    def sampling(self, max_new_tokens: int, top_logprobs: int = 0) -> dict[str, Any]:
        fields = super().sampling(max_new_tokens, top_logprobs)
        schema = self.response_format.schema_text() if self.response_format else None
        if schema is not None:
            if self.json_schema is not None:
                raise ValueError("response_format: give it or json_schema, not both")
            fields["json_schema"] = schema
        return fields

    @property
    def token_limit(self) -> int | None:
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else (self.max_tokens)
        )


# ---------------------------------------------------------------------- responses
class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "areal-hex"
    root: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class CompletionLogprobs(BaseModel):
    """The legacy completions shape: one entry per token."""

    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"; null while streaming
    matched_stop: int | str | None = None  # SGLang's extension


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str
    matched_stop: int | str | None = None


class ChatResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    matched_stop: int | str | None = None


class ChatChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


def to_sampling(fields: dict[str, Any]) -> SamplingParamsIn:
    """SamplingParamsIn from an OpenAI request's fields (ValidationError: refused)."""
    return SamplingParamsIn.model_validate(fields)
