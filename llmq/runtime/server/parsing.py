"""Reading a request: the body as JSON whatever its Content-Type, within its size limit, validated by its pydantic
model; and pydantic's validation errors as one OpenAI-style message naming the offending field."""

from __future__ import annotations

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from .protocol import APIError


async def read_body(model: type[BaseModel], request: Request, limit: int):
    """The body as JSON whatever its Content-Type (`curl -d` sends a form type; where the browser guard is on it
    has refused any type but JSON already), validated by `model`; 413 beyond
    `limit` bytes, checked while reading so an oversized body is never held whole."""
    size = request.headers.get("content-length", "")
    if size.isdigit() and int(size) > limit:
        raise _too_large(limit)
    chunks, n = [], 0
    try:
        async for chunk in request.stream():
            n += len(chunk)
            if n > limit:
                raise _too_large(limit)
            chunks.append(chunk)
    except ClientDisconnect:
        raise APIError(499, "the client closed the connection", code="client_closed") from None
    try:
        return model.model_validate_json(b"".join(chunks))
    except ValidationError as e:
        raise RequestValidationError(e.errors()) from None


def body_doc(model: type[BaseModel]) -> dict:
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than {limit} bytes", code="request_too_large")


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict"}


def _param(loc) -> str:
    """`prompt` from ('body', 'prompt', 'list[int]', 0): field names only, without pydantic's union-member tags."""
    return ".".join(p for p in loc if isinstance(p, str) and p != "body" and p.isidentifier() and p not in _TYPE_TAGS)


def validation_message(errs: list[dict]) -> tuple[str, str | None]:
    """(message, param) of a RequestValidationError's errors: the first one, or, where every error is about one field
    (a value none of a union's members accept), that field's type."""
    first = errs[0] if errs else {}
    if first.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}", None
    param = _param(first.get("loc", ())) or None
    if all(_param(x.get("loc", ())) == (param or "") for x in errs[1:]) and len(errs) > 1:
        return f"{param}: {type(first.get('input')).__name__} is none of the accepted types", param
    return f"{param or 'body'}: {first.get('msg', 'invalid value')}", param
