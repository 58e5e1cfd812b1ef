"""OpenAI request bodies (pydantic) and OpenAI-shaped errors.

Types are strict where a wrong type is a client bug: "true" for a boolean or "0.5" for a number is a 400, not
coerced (an integer is still a number). Fields the server cannot honour (n > 1, tools, JSON modes, non-text
content parts, echo, suffix) are refused with a 400 naming them; `user` and unknown vendor fields are ignored, as
OpenAI does.
"""
from typing import Annotated, Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, field_validator, model_validator

Number = Annotated[float, Field(strict=True)]  # a JSON number: an int or a float, never a string or a boolean


class StreamOptions(BaseModel):
    include_usage: StrictBool = False           # a last chunk with the request's usage
    continuous_usage_stats: StrictBool = False  # usage (so far) on every chunk too, as vLLM does


class Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: StrictStr | None = None
    max_tokens: StrictInt | None = Field(None, ge=1)
    temperature: Number | None = Field(1.0, ge=0.0, le=2.0)
    top_p: Number | None = Field(1.0, gt=0.0, le=1.0)
    top_k: StrictInt | None = Field(0, ge=-1)       # extension (vLLM, llama.cpp): 0 or -1 = off
    seed: StrictInt | None = Field(None, ge=0, lt=2**63)
    stop: StrictStr | list[StrictStr] | None = None
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool | None = False            # extension: never stop at an end-of-sequence token
    n: StrictInt | None = 1
    presence_penalty: Number | None = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: Number | None = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: Number | None = Field(1.0, gt=0.0, le=2.0)  # extension (vLLM, HF): 1 = off

    @field_validator("n")
    @classmethod
    def one_choice(cls, v):
        if v not in (None, 1):
            raise ValueError(f"only n=1 is supported, got {v}")
        return v

    @property
    def logprobs_k(self) -> int | None:
        """Top alternatives to return per token, or None for no logprobs."""
        return None


def unicode_text(v: str) -> str:
    """v if it is Unicode text a tokenizer can read; JSON's \\ud800-style escapes can make a lone surrogate, which
    is not: a ValueError naming where."""
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"is not valid Unicode text: a lone surrogate (U+{ord(v[exc.start]):04X}) at character "
                         f"{exc.start}") from None
    return v


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: StrictStr | list[TextPart]

    @field_validator("content", mode="before")
    @classmethod
    def text_content(cls, v):
        """A string or text parts; any other part (image, audio, file...) is refused by name."""
        if isinstance(v, str):
            return unicode_text(v)
        if not isinstance(v, list):
            raise ValueError("must be a string or a list of content parts")
        for part in v:
            part_type = part.get("type") if isinstance(part, dict) else None
            if part_type != "text":
                raise ValueError(f"content parts of type {part_type!r} are not supported: this model reads text only")
            if not isinstance(part.get("text"), str):
                raise ValueError("a text content part needs a 'text' string")
            unicode_text(part["text"])
        return v

    def text(self) -> dict:
        """{role, content} with content parts joined into one string (the chat template's input)."""
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": self.role, "content": content}


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: StrictStr

    @field_validator("type")
    @classmethod
    def text_only(cls, v):
        if v != "text":
            raise ValueError(f"response_format {v!r} is not supported (no constrained decoding); use 'text'")
        return v


class ChatRequest(Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: StrictBool | None = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None

    @model_validator(mode="after")
    def refuse_tools(self):
        if self.tools or self.functions or self.tool_choice not in (None, "none") \
                or self.function_call not in (None, "none"):
            raise ValueError("tools, tool_choice and functions are not supported: this server has no tool calling")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @property
    def logprobs_k(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(Sampling):
    prompt: str | list[int]
    logprobs: StrictInt | None = Field(None, ge=0, le=20)   # the chosen token's logprob and this many top ones
    echo: StrictBool | None = False
    suffix: StrictStr | None = None
    best_of: StrictInt | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def one_prompt(cls, v):
        if isinstance(v, str):
            if not v:
                raise ValueError("must not be empty")
            return unicode_text(v)
        if isinstance(v, list) and v and all(type(t) is int for t in v):
            return v
        if isinstance(v, list) and not v:
            raise ValueError("must not be an empty list")
        if isinstance(v, list) and all(isinstance(t, (str, list)) for t in v):
            raise ValueError("one prompt per request: a string or a list of token ids, not a batch")
        raise ValueError("must be a string or a list of integer token ids")

    @model_validator(mode="after")
    def refuse_unsupported(self):
        if self.echo:
            raise ValueError("echo is not supported")
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of not in (None, 1):
            raise ValueError("only best_of=1 is supported")
        return self

    @property
    def logprobs_k(self) -> int | None:
        return self.logprobs


def error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
          code: str | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status, headers=headers)
