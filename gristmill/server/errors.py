"""Every error the server sends, in OpenAI's envelope, mapped in one place."""

from __future__ import annotations

import json

from fastapi.responses import JSONResponse

from gristmill.errors import EngineOverloadedError, GristmillError, RequestError

RETRY_AFTER_S = 1


class ModelNotFoundError(RequestError):
    """The request names a model this server does not serve."""

    http_status = 404
    #: OpenAI's envelope `code` for it (other errors send their HTTP status).
    code = "model_not_found"


def envelope(message: str, type_: str, param: str | None = None, code: str | int | None = None) -> dict:
    return {"error": {"message": message or type_, "type": type_, "param": param, "code": code}}


def error_response(status: int, message: str, type_: str, param: str | None = None,
                   code: str | int | None = None, headers: dict | None = None) -> JSONResponse:
    """`code` defaults to the status, as every other error of the server sends it."""
    return JSONResponse(envelope(message, type_, param, status if code is None else code), status_code=status,
                        headers=headers)


def exception_status_and_body(exc: BaseException, retry_after: int | None = None
                              ) -> tuple[int, dict, dict | None]:
    """(HTTP status, envelope, headers) for any exception; `retry_after` (seconds), or
    the error's own `retry_after_s`, adds a Retry-After header."""
    if isinstance(exc, GristmillError):
        if retry_after is None:
            overloaded = isinstance(exc, EngineOverloadedError)
            retry_after = RETRY_AFTER_S if overloaded else getattr(exc, "retry_after_s", None)
        headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
        code = getattr(type(exc), "code", exc.http_status)
        body = envelope(exc.message, exc.error_type, getattr(exc, "param", None), code)
        return exc.http_status, body, headers
    message = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    return 500, envelope(f"internal error: {message}", "internal_error", None, 500), None


def exception_response(exc: BaseException, retry_after: int | None = None) -> JSONResponse:
    status, body, headers = exception_status_and_body(exc, retry_after)
    return JSONResponse(body, status_code=status, headers=headers)


def error_event(exc: BaseException) -> str:
    """The one SSE event a stream that fails after it started sends (then `[DONE]`)."""
    _, body, _ = exception_status_and_body(exc)
    return f"data: {json.dumps(body)}\n\n"


def validation_param(loc: tuple) -> str | None:
    """The request field a pydantic error location points at ('body', 'messages', 0, ...),
    without the union branch it was tried as ('prompt', 'list[int]')."""
    parts = [str(p) for p in loc if p != "body" and not _is_branch(p)]
    return ".".join(parts) if parts else None


def validation_message(errors: list[dict]) -> str:
    """pydantic's errors, one per field: a value no branch of a union takes is said once."""
    by_field: dict[str, list[dict]] = {}
    for error in errors:
        by_field.setdefault(validation_param(error.get("loc", ())) or "body", []).append(error)
    return "; ".join(f"{field}: {found[0].get('msg')}" if len(found) == 1 else
                     f"{field}: {str(found[0].get('input'))[:60]!r} is none of the types it takes"
                     for field, found in by_field.items())


_BRANCH_NAMES = {"str", "int", "float", "bool", "dict", "list", "none", "bytes"}


def _is_branch(part) -> bool:
    """A location part that names a type pydantic tried, not a field ('list[int]', 'str')."""
    return isinstance(part, str) and ("[" in part or part in _BRANCH_NAMES)
