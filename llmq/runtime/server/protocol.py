"""OpenAI-compatible request bodies, the error body and the exception that carries one to the client.

Field names follow the OpenAI API. Unknown fields are ignored (as OpenAI does), but known fields are validated
strictly: a string where a number belongs is a 400, not a silent coercion. `top_k`, `ignore_eos`,
`stop_token_ids`, `skip_special_tokens`, `return_tokens_as_token_ids` and `prompt_logprobs` are vLLM-style
extensions. A log-probability
count of -1 asks for the whole vocabulary; the server's `Limits.max_logprobs` bounds every count.
"""

from __future__ import annotations

import json
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..sampling import SEED_RANGE, TOP_K_MAX


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False


class SamplingFields(_Body):
    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=TOP_K_MAX)] | None = None
    seed: Annotated[int, Field(ge=SEED_RANGE[0], le=SEED_RANGE[1])] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True  # False: special tokens stay in the text (an eval reading harmony's markers)
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    return_tokens_as_token_ids: bool = False  # logprobs name tokens "token_id:<id>" (vLLM's extension)
    logit_bias: dict | None = None  # refused when given (Frontend.params): never silently ignored


LogprobCount = Annotated[int, Field(ge=-1)]


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: Annotated[int, Field(ge=0)] | None = None  # 0: the prompt alone, with echo or prompt_logprobs
    logprobs: LogprobCount | None = None
    prompt_logprobs: LogprobCount | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ImageURL(_Body):
    url: str
    detail: str | None = None


class ImagePart(_Body):
    """An image as a data: URL (runtime.images: remote URLs are refused, nothing is fetched)."""

    type: Literal["image_url"]
    image_url: ImageURL


class ChatMessage(BaseModel):
    """Extra keys (name, tool_call_id, ...) pass through to the chat template."""

    model_config = ConfigDict(extra="allow", strict=True)
    role: str
    content: str | list[Annotated[TextPart | ImagePart, Field(discriminator="type")]] | None = None

    def image_urls(self) -> list[str]:
        if not isinstance(self.content, list):   # text: never walked character by character
            return []
        return [p.image_url.url for p in self.content if isinstance(p, ImagePart)]

    def template_dict(self) -> dict:
        """The message as chat templates take it: text parts joined, or where it holds images its parts in order
        ({"type": "text", "text"} / {"type": "image"}, as vision-language templates read them)."""
        d = self.model_dump(exclude_none=True)
        c = self.content
        if self.image_urls():
            d["content"] = [{"type": "text", "text": p.text} if isinstance(p, TextPart) else {"type": "image"}
                            for p in c]
        else:
            d["content"] = "" if c is None else c if isinstance(c, str) else "".join(p.text for p in c)
        calls = d.get("tool_calls")
        if isinstance(calls, list):  # an assistant's earlier calls: templates write their arguments with tojson
            d["tool_calls"] = [_call_arguments(tc) for tc in calls]
        return d


def _call_arguments(tc):
    """A call's arguments as an object, where OpenAI sends them as JSON text."""
    fn = tc.get("function") if isinstance(tc, dict) else None
    if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
        try:
            return {**tc, "function": {**fn, "arguments": json.loads(fn["arguments"])}}
        except ValueError:
            pass
    return tc


class FunctionDefinition(_Body):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]  # OpenAI's rule for function names
    description: str | None = None
    parameters: dict | None = None  # a JSON Schema (server.tools checks it)
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionChoice(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: FunctionChoice


class JsonSchemaFormat(_Body):
    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)
    name: str = "response"
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: LogprobCount | None = None
    echo: bool = False  # vLLM's chat extensions that /v1/completions alone supports here: refused when given
    prompt_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class APIError(Exception):
    """A request answered with an OpenAI-style error body and `status` (the app's exception handler sends it)."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.body, self.headers = status, error_body(message, type_, param, code), headers


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 400 naming the offending field (`param`)."""
    return APIError(400, message, param=param, code=code)
