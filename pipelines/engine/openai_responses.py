"""The parts of OpenAI-compatible responses that ``endpoints`` reads, as small strict pydantic models.

Why strict: a server's answer is data from outside. A number where text belongs, a list where an object
belongs or a string where a log-prob belongs must be refused with the field's path, not coerced (pydantic's
lax mode turns 5 into "5") nor left to fail later as a TypeError deep in the scorer. Unknown fields are
ignored: servers add their own. Non-finite log-probs pass the models (JSON from Python's json module may hold
NaN and Infinity) and are checked by the reader, which can name the token.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, ValidationError


class _Part(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)


class TopLogprob(_Part):
    token: str
    logprob: float


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] | None = None


class ChatLogprobs(_Part):
    content: list[TokenLogprob] | None = None


class ChatMessage(_Part):
    content: str | None = None


class ChatChoice(_Part):
    message: ChatMessage | None = None
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class CompletionLogprobs(_Part):
    tokens: list[str] | None = None
    token_logprobs: list[float | None] | None = None
    top_logprobs: list[dict[str, float] | None] | None = None


class CompletionChoice(_Part):
    text: str | None = None
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class ChatResponse(_Part):
    choices: list[ChatChoice] = Field(min_length=1)


class CompletionResponse(_Part):
    choices: list[CompletionChoice] = Field(min_length=1)


class ModelEntry(_Part):
    id: str


class ModelList(_Part):
    data: list[ModelEntry]


def first_problem(exc: ValidationError) -> str:
    """The first thing wrong with a response, as ``where: what (got ...)`` in one short line."""
    error = exc.errors()[0]
    where = ".".join(str(part) for part in error["loc"]) or "the response"
    got = repr(error.get("input"))
    return f"{where}: {error['msg']} (got {got[:60]}{'...' if len(got) > 60 else ''})"
