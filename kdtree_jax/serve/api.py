"""The HTTP side: an OpenAI-compatible /v1/completions (streamed as server-sent events, or whole), /v1/models,
/health and /metrics, on FastAPI.

A handler validates the request (pydantic, then the limits that need the model: context, pool), tokenizes it and
submits a `scheduler.Request` whose `emit` puts the decode thread's events on this request's asyncio queue. Text is
made here, not in the decode thread: each time tokens arrive the handler decodes all of the request's tokens and
sends what is new, holding back a trailing partial UTF-8 character and any end that could start a stop string; a
stop string found ends the request (scheduler.cancel(..., "stop")). A client that goes away cancels its request, so
its batch row and KV slots are freed after the chunk in flight.

Every error is OpenAI's shape, {"error": {"message", "type", "param", "code"}}, with 400 for a bad request, 404 for
an unknown model, 429 for a full queue and 503 while shutting down.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Optional, Union

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kdtree_jax.serve import scheduler as sched

MAX_STOPS = 4  # OpenAI's limit on stop strings

# What a whole (non-streamed) request still running when the server's --drain-timeout ends gets, as a 503: uvicorn
# cancels its handler then, which would otherwise be a 500 and a logged traceback. (A stream's cancellation reaches
# starlette's own tasks first: its connection is closed.)
SHUTDOWN = {"message": "the server shut down before this request finished (--drain-timeout)", "type": "server_error",
            "param": None, "code": "shutting_down"}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class CompletionRequest(BaseModel):
    """The /v1/completions body. Parameters OpenAI defines but this server does not implement are accepted only at
    their neutral values (so a client that sends its defaults works) and are a 400 otherwise."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    prompt: Union[str, list[int], list[str]]
    max_tokens: int = Field(16, ge=1)  # OpenAI's default
    temperature: float = Field(1.0, ge=0.0, le=2.0)  # OpenAI's default (0: greedy)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stop: Union[str, list[str], None] = None
    seed: Optional[int] = Field(None, ge=-(2 ** 63), lt=2 ** 64)
    n: int = 1
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    echo: bool = False
    user: Optional[str] = None
    # not implemented: only their neutral values
    logprobs: Optional[int] = None
    best_of: Optional[int] = None
    suffix: Optional[str] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Optional[dict] = None


class ApiError(Exception):
    """An OpenAI-style error response."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def response(self) -> JSONResponse:
        return JSONResponse(status_code=self.status, content={"error": {
            "message": self.message, "type": self.kind, "param": self.param, "code": self.code}})


def _validation_error(e: ValidationError) -> ApiError:
    """The first pydantic error as one line naming the parameter."""
    err = e.errors()[0]
    # A Union reports each alternative's failure ('prompt', 'list[int]', 0): name the field itself.
    param = str(err["loc"][0]) if err["loc"] else None
    if err["type"] == "missing":
        return ApiError(400, f"missing required parameter: '{param}'", param, "missing_parameter")
    if err["type"] == "extra_forbidden":
        return ApiError(400, f"unrecognized request argument: '{param}'", param, "unknown_parameter")
    value = err.get("input")
    shown = json.dumps(value)[:80] if isinstance(value, (int, float, str, bool, type(None))) else type(value).__name__
    return ApiError(400, f"invalid value for '{param}' ({shown}): {err['msg']}", param, "invalid_value")


class TextStream:
    """A request's tokens -> its text, piece by piece: decode everything so far, send what is new, except a trailing
    U+FFFD (a character whose last bytes are still to come) and an end that may begin a stop string."""

    def __init__(self, tokenizer, stops: list[str]):
        self.tokenizer, self.stops = tokenizer, stops
        self.ids: list[int] = []
        self.sent = ""
        self.stopped = False

    def feed(self, ids: list[int]) -> str:
        """The new text after these tokens ('' while held back); sets `stopped` once a stop string appears."""
        self.ids.extend(ids)
        text = self.tokenizer.decode(self.ids).rstrip("\ufffd")
        cut = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if cut:
            text, self.stopped = text[:min(cut)], True
        else:
            hold = max((k for s in self.stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
            text = text[:len(text) - hold]
        return self._new(text)

    def finish(self) -> str:
        """The rest of the text at the end (what was held back, unless it is a stop string's start that never
        completed... which is then text after all)."""
        if self.stopped:
            return ""
        text = self.tokenizer.decode(self.ids)
        return self._new(text)

    def _new(self, text: str) -> str:
        if text.startswith(self.sent) and len(text) > len(self.sent):
            new, self.sent = text[len(self.sent):], text
            return new
        return ""


def create_app(scheduler: "sched.Scheduler", tokenizer, metrics, *, model_name: str, info: dict) -> FastAPI:
    """The FastAPI app over a started scheduler. info: what /health and /v1/models say about the decoding."""
    app = FastAPI(title="kdtree-jax", description="DDTree speculative decoding, OpenAI-compatible completions")
    created = int(time.time())
    vocab = scheduler.target.cfg.vocab_size

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError):
        metrics.add("requests_rejected")
        return e.response()

    @app.get("/health")
    async def health():
        # With the adaptive budget, what it did since start (metrics.budget_policy: the steps per budget, predicted vs
        # observed tau, each bucket's cost model), from the counters the decode thread copies once a chunk.
        policy = metrics.budget_policy()
        extra = {} if policy is None else {"budget_policy": policy}
        if scheduler.error is not None:
            return JSONResponse({"status": "degraded", "last_error": scheduler.error, **info, **extra})
        return {"status": "ok", **info, **extra}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                             "owned_by": "kdtree-jax", **info}]}

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    def parse(body: bytes) -> CompletionRequest:
        try:
            data = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the request body is not valid JSON ({e})", None, "invalid_json") from None
        if not isinstance(data, dict):
            raise ApiError(400, "the request body must be a JSON object", None, "invalid_json")
        try:
            req = CompletionRequest.model_validate(data)
        except ValidationError as e:
            raise _validation_error(e) from None
        if req.model != model_name:
            raise ApiError(404, f"the model '{req.model}' does not exist; this server serves '{model_name}'",
                           "model", "model_not_found")
        if req.n != 1:
            raise ApiError(400, f"n must be 1 (one completion per request); got {req.n}", "n", "unsupported_value")
        # OpenAI parameters this server does not implement: accepted at their neutral values only
        neutral = {"logprobs": (None, 0), "best_of": (None, 1), "suffix": (None,), "presence_penalty": (0,),
                   "frequency_penalty": (0,), "logit_bias": (None, {})}
        for name, values in neutral.items():
            if getattr(req, name) not in values:
                raise ApiError(400, f"'{name}' is not supported by this server", name, "unsupported_parameter")
        return req

    def prompt_ids(req: CompletionRequest) -> tuple[list[int], str]:
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise ApiError(400, f"one prompt per request; got {len(prompt)}", "prompt", "unsupported_value")
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids, text = tokenizer.encode(prompt), prompt
        else:
            bad = [t for t in prompt if not 0 <= t < vocab]
            if bad:
                raise ApiError(400, f"prompt token ids must be in [0, {vocab}); got {bad[0]}", "prompt", "invalid_value")
            ids, text = list(prompt), tokenizer.decode(list(prompt))
        if not ids:
            raise ApiError(400, "the prompt is empty (it must encode to at least one token)", "prompt", "invalid_value")
        context = scheduler.target.cfg.max_position_embeddings
        if len(ids) >= context:
            raise ApiError(400, f"the prompt has {len(ids)} tokens; the model's context is {context} tokens",
                           "prompt", "context_length_exceeded")
        limit = scheduler.max_tokens_for(len(ids))
        if limit < 1:
            raise ApiError(400, f"the prompt has {len(ids)} tokens; this server's rows hold at most "
                                f"{len(ids) + limit - 1} (--max-len {scheduler.settings.max_len} less one verify tree)",
                           "prompt", "context_length_exceeded")
        if req.max_tokens > limit:
            raise ApiError(400, f"max_tokens is {req.max_tokens} but a {len(ids)}-token prompt leaves room for at most "
                                f"{limit} (the model's context and this server's --max-len {scheduler.settings.max_len})",
                           "max_tokens", "context_length_exceeded")
        return ids, text

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = parse(await request.body())
        ids, prompt_text = prompt_ids(req)
        stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if len(stops) > MAX_STOPS or any(not s for s in stops):
            raise ApiError(400, f"stop must be up to {MAX_STOPS} non-empty strings", "stop", "invalid_value")

        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def emit(kind, value):  # on the decode thread: hand the event to this request's handler
            try:
                loop.call_soon_threadsafe(events.put_nowait, (kind, value))
            except RuntimeError:  # the event loop is closed (shutting down): nobody is listening
                pass

        job = sched.Request(prompt=ids, max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p,
                            seed=req.seed, emit=emit)
        try:
            scheduler.submit(job)
        except sched.QueueFull as e:
            raise ApiError(429, f"the server is busy: {e}; retry later", None, "queue_full",
                           "rate_limit_exceeded") from None
        except sched.NotAccepting as e:
            raise ApiError(503, str(e), None, "shutting_down", "server_error") from None

        completion_id = f"cmpl-{uuid.uuid4().hex[:24]}"
        text = TextStream(tokenizer, stops)

        def usage():
            return {"prompt_tokens": len(ids), "completion_tokens": len(text.ids),
                    "total_tokens": len(ids) + len(text.ids)}

        def choice(piece: str, finish_reason):
            return {"id": completion_id, "object": "text_completion", "created": int(time.time()),
                    "model": model_name, "choices": [{"text": piece, "index": 0, "logprobs": None,
                                                      "finish_reason": finish_reason}]}

        async def pieces():
            """(text, None) as tokens arrive, then (rest, finish_reason); raises ApiError if the decode failed."""
            while True:
                kind, value = await events.get()
                if kind == "tokens":
                    piece = text.feed(value)
                    if text.stopped:
                        scheduler.cancel(job, "stop")
                        yield piece, "stop"
                        return
                    if piece:
                        yield piece, None
                elif kind == "done":
                    yield text.finish(), "stop" if value == "stop" else value
                    return
                else:
                    raise ApiError(500, str(value), None, "decode_failed", "server_error")

        if req.stream:
            async def sse():
                try:
                    if req.echo:
                        yield f"data: {json.dumps(choice(prompt_text, None))}\n\n"
                    async for piece, finish in pieces():
                        if piece or finish:
                            yield f"data: {json.dumps(choice(piece, finish))}\n\n"
                    if req.stream_options is not None and req.stream_options.include_usage:
                        yield f"data: {json.dumps({**choice('', None), 'choices': [], 'usage': usage()})}\n\n"
                except ApiError as e:
                    yield f"data: {json.dumps({'error': {'message': e.message, 'type': e.kind, 'param': None, 'code': e.code}})}\n\n"
                finally:
                    scheduler.cancel(job)  # a no-op once it is done; frees the row of a client that went away
                yield "data: [DONE]\n\n"

            return StreamingResponse(sse(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

        # Whole: wait for the end, watching for a client that gives up meanwhile.
        out, finish = [prompt_text] if req.echo else [], None
        stream = pieces()
        try:
            while finish is None:
                task = asyncio.ensure_future(stream.__anext__())
                while not task.done():
                    await asyncio.wait({task}, timeout=1.0)
                    if not task.done() and await request.is_disconnected():
                        task.cancel()
                        scheduler.cancel(job)
                        return JSONResponse(status_code=499, content={"error": {
                            "message": "client closed the request", "type": "cancelled", "param": None,
                            "code": "client_closed"}})
                piece, finish = task.result()
                out.append(piece)
        except ApiError as e:
            return e.response()
        except asyncio.CancelledError:  # shutting down: --drain-timeout is over (see SHUTDOWN)
            return JSONResponse(status_code=503, content={"error": SHUTDOWN})
        finally:
            scheduler.cancel(job)
        return {**choice("".join(out), finish), "usage": usage()}

    return app
