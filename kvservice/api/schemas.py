"""The OpenAI-compatible request bodies (pydantic), as OpenAI documents them.

Fields OpenAI defines and the engine does not implement (``logprobs``, ``echo``,
``best_of`` > 1, ``suffix``, ``logit_bias``, ``tools``, non-zero penalties) are refused with
400 naming the field, rather than silently ignored; so is any field OpenAI does not define
(``extra = "forbid"``), except the engine's own ``top_k`` and ``ignore_eos``, which vLLM and
SGLang accept too.
"""

from __future__ import annotations

from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

#: At most this many stop strings (OpenAI allows 4).
MAX_STOP = 4
#: ``n`` at most.
MAX_N = 64


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class Sampling(BaseModel):
    """What both endpoints share."""

    model_config = ConfigDict(extra="forbid")

    model: str
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)            # -1 or 0: off (vLLM's convention)
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    stop: Union[str, list[str], None] = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    user: str | None = None
    # OpenAI fields the engine does not implement: only their neutral values pass.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    logprobs: bool | int | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        return stops

    @field_validator("presence_penalty", "frequency_penalty", "logit_bias", "logprobs")
    @classmethod
    def _neutral(cls, v, info):
        return _unsupported(v, info.field_name)


def _unsupported(value, name: str):
    """Passes a field OpenAI defines and the engine does not implement only at its
    neutral value (0, empty, false, 1 for best_of)."""
    if value and not (name == "best_of" and value == 1):
        raise ValueError(f"{name} is not supported")
    return value


class CompletionRequest(Sampling):
    """``POST /v1/completions``."""

    prompt: Union[str, list[int], list[str]]
    max_tokens: int = Field(16, ge=1)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if isinstance(v, list):
            if not v:
                raise ValueError("the prompt is empty")
            if isinstance(v[0], str):
                if len(v) != 1:
                    raise ValueError(f"one prompt per request, got {len(v)}")
                v = v[0]
        if isinstance(v, str) and not v:
            raise ValueError("the prompt is empty")
        return v

    @field_validator("echo", "best_of", "suffix")
    @classmethod
    def _neutral_too(cls, v, info):
        return _unsupported(v, info.field_name)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[TextPart]]
    name: str | None = None

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(Sampling):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list | None = None

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, v, info):
        return _unsupported(v, info.field_name)
