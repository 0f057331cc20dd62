"""Every error the server answers is OpenAI's shape, {"error": {"message", "type", "param", "code"}}, so that an
OpenAI client raises its own typed exception (BadRequestError, NotFoundError, ...) with a readable message, whatever
went wrong: a bad parameter (400), an unknown model (404), an unknown route (404) or a wrong method (405) (FastAPI's
own handlers would answer those with {"detail": ...}), a full queue (429), an internal failure (500), shutting down
(503).
"""

from __future__ import annotations

import json
from typing import Callable, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException


def body(message: str, kind: str = "invalid_request_error", param: Optional[str] = None,
         code: Optional[str] = None) -> dict:
    """The JSON of one error (also what a stream's final error event carries)."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class ApiError(Exception):
    """An OpenAI-style error response."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return body(self.message, self.kind, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(status_code=self.status, content=self.body())


# What a request still running when the server's --drain-timeout ends gets: a whole one as a 503, a stream as its
# final event.
SHUTDOWN = ApiError(503, "the server shut down before this request finished (--drain-timeout)", None,
                    "shutting_down", "server_error")


def from_validation(e: ValidationError) -> ApiError:
    """The first pydantic error as one line naming the parameter (its dotted path inside the body)."""
    err = e.errors()[0]
    # A Union reports each alternative's failure ('prompt', 'list[int]', 0): name the field itself, and inside the
    # list of messages the message and its field ('messages[1].content').
    loc = err["loc"]
    param = str(loc[0]) if loc else None
    if len(loc) >= 3 and isinstance(loc[1], int):
        param = f"{loc[0]}[{loc[1]}].{loc[2]}"
    elif len(loc) == 2 and isinstance(loc[1], int):
        param = f"{loc[0]}[{loc[1]}]"
    if err["type"] == "missing":
        return ApiError(400, f"missing required parameter: '{param}'", param, "missing_parameter")
    if err["type"] == "extra_forbidden":
        return ApiError(400, f"unrecognized request argument: '{param}'", param, "unknown_parameter")
    value = err.get("input")
    shown = json.dumps(value)[:80] if isinstance(value, (int, float, str, bool, type(None))) else type(value).__name__
    return ApiError(400, f"invalid value for '{param}' ({shown}): {err['msg']}", param, "invalid_value")


def install(app: FastAPI, on_error: Callable[[], None] = lambda: None) -> None:
    """OpenAI-shaped handlers for ApiError and in place of FastAPI's 404 / 405 / 422 / 500 ones. on_error: called for
    each rejected request (the metrics' counter)."""

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError):
        on_error()
        return e.response()

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, e: HTTPException):
        on_error()
        where = f"{request.method} {request.url.path}"
        if e.status_code == 404:
            return JSONResponse(status_code=404, content=body(f"unknown route: {where} (this server has "
                                                              "/v1/completions, /v1/chat/completions, /v1/models, "
                                                              "/health, /metrics)", code="not_found"))
        if e.status_code == 405:
            return JSONResponse(status_code=405, headers=e.headers,
                                content=body(f"method {request.method} is not allowed for {request.url.path}"
                                             + (f" (allowed: {e.headers['Allow']})" if e.headers and
                                                "Allow" in e.headers else ""), code="method_not_allowed"))
        kind = "server_error" if e.status_code >= 500 else "invalid_request_error"
        return JSONResponse(status_code=e.status_code, headers=e.headers, content=body(str(e.detail), kind))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        on_error()
        err = (e.errors() or [{}])[0]
        param = ".".join(str(x) for x in err.get("loc", ())[1:]) or None
        return JSONResponse(status_code=400, content=body(f"invalid value for '{param}': {err.get('msg', e)}",
                                                          param=param, code="invalid_value"))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, e: Exception):
        # Starlette still logs the traceback (a bug to report); the client gets a one-line 500 in OpenAI's shape.
        return JSONResponse(status_code=500, content=body(
            f"internal server error: {type(e).__name__}: {' '.join(str(e).split())[:300]}", "server_error",
            code="internal_error"))
