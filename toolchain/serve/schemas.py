"""The OpenAI API's request and response bodies that dstc serves, as pydantic models.

Requests accept the fields OpenAI clients send; unknown fields are ignored (as OpenAI-compatible servers do), known
fields dstc cannot honour (n > 1, logprobs, echo, best_of, penalties, logit_bias, tools, JSON response formats)
are refused with a 400 naming the field rather than silently ignored. ``ignore_eos`` (as in vLLM) keeps generating
past the model's end-of-sequence token, up to ``max_tokens``.

Sampling fields are bounded to what both runtimes take, so that a request the runtime would refuse never reaches a
batch: ``seed`` 0..2**64-1 (openvino_genai's ``rng_seed`` is a size_t; numpy's generator refuses negative seeds),
``top_p`` at least 1e-6 (openvino_genai keeps it as a float32, where smaller values round to 0, which it refuses;
below 1e-6 only the most likely token is kept anyway, with a vocabulary under a million tokens) and ``temperature``
0 (greedy) or 0.01..2 (as vLLM's floor: logits divided by less overflow float32 in the sampler).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, field_validator, model_validator

from toolchain.chat_roles import ChatRole

MAX_STOP_SEQUENCES = 4
MAX_STOP_CHARS = 256  # per stop sequence: holding back a partial match costs its length squared per token
MAX_SEED = 2**64 - 1
MIN_TOP_P = 1e-6
MIN_TEMPERATURE = 0.01
FinishReason = Literal["stop", "length"]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: StrictBool = False
    # as in vLLM: usage so far in every chunk, and a chunk for every engine step that generated a token, also one
    # that adds no text (a byte of a character still incomplete, a token the tokenizer decodes to nothing)
    continuous_usage_stats: StrictBool = False


class _Sampling(_Body):
    model: StrictStr
    max_tokens: StrictInt | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, ge=MIN_TOP_P, le=1.0)
    seed: StrictInt | None = Field(None, ge=0, le=MAX_SEED)
    stop: StrictStr | list[StrictStr] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: StrictInt | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict | None = None
    user: StrictStr | None = None
    ignore_eos: StrictBool = False

    @field_validator("stop")
    @classmethod
    def _stops(cls, value):
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences")
        if any(not s for s in stops):
            raise ValueError("a stop sequence cannot be empty")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"a stop sequence can be at most {MAX_STOP_CHARS} characters")
        return stops

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, value):
        if value is not None and 0 < value < MIN_TEMPERATURE:
            raise ValueError(f"temperature must be 0 (greedy) or between {MIN_TEMPERATURE} and 2")
        return value

    def unsupported(self) -> tuple[str, str] | None:
        """(field, message) of the first field given a value dstc cannot honour."""
        if self.n not in (None, 1):
            return "n", "only n=1 is supported"
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                return name, f"{name} is not supported"
        if self.logit_bias:
            return "logit_bias", "logit_bias is not supported"
        return None


class CompletionRequest(_Sampling):
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    echo: StrictBool = False
    logprobs: StrictInt | None = None
    best_of: StrictInt | None = None
    suffix: StrictStr | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.echo:
            return "echo", "echo is not supported"
        if self.logprobs:
            return "logprobs", "logprobs are not supported"
        if self.best_of not in (None, 1):
            return "best_of", "only best_of=1 is supported"
        if self.suffix:
            return "suffix", "suffix is not supported"
        return super().unsupported()


class ContentPart(_Body):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(_Body):
    role: ChatRole
    content: StrictStr | list[ContentPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = None
    tools: list | None = None
    response_format: dict | None = None

    @model_validator(mode="after")
    def _max_completion_tokens(self):
        if self.max_tokens is None and self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return self

    def unsupported(self) -> tuple[str, str] | None:
        if self.logprobs:
            return "logprobs", "logprobs are not supported"
        if self.tools:
            return "tools", "tools are not supported"
        if self.response_format and self.response_format.get("type") not in (None, "text"):
            return "response_format", "only the text response format is supported"
        return super().unsupported()


# -- responses --------------------------------------------------------------------------------------------------


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: FinishReason | None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: None = None
    finish_reason: FinishReason | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    logprobs: None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "dstc"
    max_model_len: int
    backend: str


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    error: ErrorDetail
