"""The HTTP side: OpenAI-compatible /v1/completions and /v1/chat/completions (streamed as server-sent events, or
whole), /v1/models and /v1/models/{id}, /health and /metrics, on FastAPI.

A handler validates the request (pydantic, then the limits that need the model: context, pool), takes each sampling
field the request left out from the checkpoint's generation_config.json, else OpenAI's default (request_defaults),
makes its prompt (the text or token ids given; for chat, the messages rendered through the tokenizer's chat
template, chat_template.py), tokenizes it and submits a `scheduler.Request` whose `emit` puts the decode thread's
events on this request's asyncio queue. Text is made here, not in the decode thread: each time tokens arrive the
handler decodes all of the request's tokens and sends what is new, holding back a trailing partial UTF-8 character
and any end that could start a stop string; a stop string found ends the request (scheduler.cancel(..., "stop")).

A client that goes away cancels its request, so that its batch row and KV slots are freed after the chunk in
flight: a stream notices when a send fails (starlette watches the connection), a whole request through a task
that waits for the connection's http.disconnect message while the tokens arrive.

Shutting down (the command line's SIGTERM): requests in flight may finish until --drain-timeout; then the command
line calls `app.state.end_requests()`, and each request still running ends at once: a stream with a final error
event (code "shutting_down") and `data: [DONE]`, a whole request with a 503.

Every error is OpenAI's shape (errors.py): 400 for a bad request, 404 for an unknown model or route, 405 for a
wrong method, 429 for a full queue, 500 for a failed decode, 503 while shutting down.
"""

from __future__ import annotations

import asyncio
import bisect
import dataclasses
import json
import time
import uuid
from typing import Any, Callable, ClassVar, Literal, Optional, Union

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kdtree_jax import generation_config
from kdtree_jax.serve import chat_template
from kdtree_jax.serve import scheduler as sched
from kdtree_jax.serve.errors import SHUTDOWN, ApiError, from_validation
from kdtree_jax.speculative.sampling import SamplingParams

MAX_STOPS = 4  # OpenAI's limit on stop strings


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class _GenerationRequest(BaseModel):
    """What the completions and chat completions bodies share: the model, sampling and streaming."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    # Sampling (speculative/sampling.py). A field left out or null takes the checkpoint's generation_config.json
    # value, else OpenAI's default (request_defaults): None here means "the client did not set it".
    temperature: Optional[float] = Field(None, ge=0.0, le=2.0)  # 0: greedy
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    top_k: Optional[int] = Field(None, ge=-1)  # vLLM's extension, not OpenAI's; 0 or -1: off
    repetition_penalty: Optional[float] = Field(None, gt=0.0)  # vLLM's and HF's extension; 1: off
    # OpenAI's penalties, from the counts of the prompt's and the answer's tokens
    presence_penalty: Optional[float] = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: Optional[float] = Field(None, ge=-2.0, le=2.0)
    stop: Union[str, list[str], None] = None
    seed: Optional[int] = Field(None, ge=-(2 ** 63), lt=2 ** 64)
    n: int = 1
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    logit_bias: Optional[dict] = None  # not implemented: only its neutral values (NEUTRAL)


class CompletionRequest(_GenerationRequest):
    """The /v1/completions body. Parameters OpenAI defines but this server does not implement are accepted only at
    their neutral values (so a client that sends its defaults works) and are a 400 otherwise."""

    prompt: Union[str, list[int], list[str]]
    max_tokens: int = Field(16, ge=1)  # OpenAI's default
    echo: bool = False
    # not implemented: only their neutral values
    logprobs: Optional[int] = None
    best_of: Optional[int] = None
    suffix: Optional[str] = None

    NEUTRAL: ClassVar[dict] = {"logprobs": (None, 0), "best_of": (None, 1), "suffix": (None,),
               "logit_bias": (None, {})}


class TextPart(BaseModel):
    """One part of a message's content given as a list (OpenAI's content parts); only text is understood."""

    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One message. Fields beyond role / content / name (a tool call's, say) go to the template as they are."""

    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None
    name: Optional[str] = None


class ChatRequest(_GenerationRequest):
    """The /v1/chat/completions body; like CompletionRequest, the parameters this server does not implement are
    accepted at their neutral values only. Without max_tokens / max_completion_tokens an answer may take all the room
    its prompt leaves (the model's context and this server's --max-len)."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[int] = Field(None, ge=1)  # OpenAI's older name of max_completion_tokens
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    # not implemented: only their neutral values
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = None
    tools: Optional[list] = None
    tool_choice: Optional[Union[str, dict]] = None
    parallel_tool_calls: Optional[bool] = None
    response_format: Optional[dict] = None
    store: Optional[bool] = None
    metadata: Optional[dict] = None
    service_tier: Optional[str] = None

    NEUTRAL: ClassVar[dict] = {"logprobs": (None, False), "top_logprobs": (None, 0),
               "logit_bias": (None, {}), "tools": (None, []), "tool_choice": (None, "none"),
               "response_format": (None, {"type": "text"}), "store": (None, False),
               "service_tier": (None, "auto", "default")}


class TextStream:
    """A request's tokens -> its text, piece by piece: send what is new, except a trailing U+FFFD (a character whose
    last bytes are still to come) and an end that may begin a stop string.

    Each feed decodes only the tokens past the last clean boundary (a split where the text of the tokens before it
    plus that of the tokens after it is the text of all of them, checked with WINDOW tokens already after it, so
    no token to come can change the text before it): decoding every token so far at every feed was quadratic in the
    answer's length, on the event loop's thread, under the GIL the decode thread needs."""

    WINDOW = 16  # tokens decoded again at each feed past the boundary; the boundary moves when twice as many pile up

    def __init__(self, tokenizer, stops: list[str]):
        self.tokenizer, self.stops = tokenizer, stops
        self.ids: list[int] = []
        self.sent = ""
        self.stopped = False
        self._kept = 0  # once stopped: the tokens up to the stop string (_tokens_for)
        self._base, self._base_text = 0, ""  # ids[:_base] decode to _base_text, whatever follows them
        self._longest = max((len(s) for s in stops), default=0)

    def text(self) -> str:
        """The text of every token so far (as tokenizer.decode(self.ids) gives it)."""
        decode, ids = self.tokenizer.decode, self.ids
        text = self._base_text + decode(ids[self._base:])
        if len(ids) - self._base > 2 * self.WINDOW:
            cut = len(ids) - self.WINDOW
            head = decode(ids[self._base:cut])
            if not head.endswith("\ufffd") and self._base_text + head + decode(ids[cut:]) == text:
                # The base moves for the next feeds; this feed's text is the one decoded from the old base (the new
                # base's text followed by that tail would hold the head twice).
                self._base, self._base_text = cut, self._base_text + head
        return text

    def feed(self, ids: list[int]) -> str:
        """The new text after these tokens ('' while held back); sets `stopped` once a stop string appears."""
        self.ids.extend(ids)
        if self.stopped:
            return ""
        text = self.text().rstrip("\ufffd")
        # The text sent holds no stop string: one can only end in what is new (or start in what was held back).
        start = max(0, len(self.sent) - self._longest + 1)
        cut = [i for i in (text.find(s, start) for s in self.stops) if i >= 0]
        if cut:
            text, self.stopped = text[:min(cut)], True
            self._kept = self._tokens_for(len(text))
        else:
            hold = max((k for s in self.stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
            text = text[:len(text) - hold]
        return self._new(text)

    @property
    def completion_tokens(self) -> int:
        """usage.completion_tokens: every token, unless a stop string cut the text; then only those up to it."""
        return self._kept if self.stopped else len(self.ids)

    def _tokens_for(self, length: int) -> int:
        """The fewest leading tokens whose text holds the text's first `length` characters (a trailing partial
        character does not count). A stop string is not returned and OpenAI counts the tokens up to the stop: the
        tokens a chunk brought past it (the stop string's own, and what the decode ran on to in that chunk) are not
        the answer's, and the token whose text reaches the stop's start is (even when the stop starts inside it).
        Once per stopped request, so whole decodes in a bisection cost little."""
        decode, ids = self.tokenizer.decode, self.ids
        return bisect.bisect_left(range(len(ids) + 1), length, key=lambda n: len(decode(ids[:n]).rstrip("\ufffd")))

    def finish(self) -> str:
        """The rest of the text at the end (what was held back, unless it is a stop string's start that never
        completed... which is then text after all)."""
        if self.stopped:
            return ""
        return self._new(self.text())

    def _new(self, text: str) -> str:
        if text.startswith(self.sent) and len(text) > len(self.sent):
            new, self.sent = text[len(self.sent):], text
            return new
        return ""


def _parse(body: bytes, kind, model_name: str):
    """The request body as `kind` (CompletionRequest or ChatRequest), checked: -> the request."""
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON ({e})", None, "invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object", None, "invalid_json")
    try:
        req = kind.model_validate(data)
    except ValidationError as e:
        raise from_validation(e) from None
    if req.model != model_name:
        raise ApiError(404, f"the model '{req.model}' does not exist; this server serves '{model_name}'",
                       "model", "model_not_found")
    if req.n != 1:
        raise ApiError(400, f"n must be 1 (one completion per request); got {req.n}", "n", "unsupported_value")
    for name, values in kind.NEUTRAL.items():
        if getattr(req, name) not in values:
            raise ApiError(400, f"'{name}' is not supported by this server", name, "unsupported_parameter")
    return req


def request_defaults(recommended: Optional[dict] = None) -> dict:
    """The sampling settings a request gets for each field it leaves out: the checkpoint's recommendation
    (generation_config.load), else OpenAI's defaults, temperature 1 included (SamplingParams' own default is greedy:
    an OpenAI client that sends no temperature expects to sample, as vLLM does without a generation_config.json)."""
    return {**dataclasses.asdict(SamplingParams()), "temperature": 1.0, **(recommended or {})}


def _sampling(req, defaults: dict) -> SamplingParams:
    """The request's sampling settings: each field it set, else `defaults` (request_defaults)."""
    try:
        return generation_config.resolve(
            defaults, temperature=req.temperature, top_p=req.top_p,
            top_k=0 if req.top_k == -1 else req.top_k, repetition_penalty=req.repetition_penalty,
            presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty)
    except ValueError as e:  # pydantic checks the same ranges: a check SamplingParams adds later is still a 400
        raise ApiError(400, str(e), None, "invalid_value") from None


def _stops(stop) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOPS or any(not s for s in stops):
        raise ApiError(400, f"stop must be up to {MAX_STOPS} non-empty strings", "stop", "invalid_value")
    return stops


def create_app(scheduler: "sched.Scheduler", tokenizer, metrics, *, model_name: str, info: dict,
               template: Optional[chat_template.ChatTemplate] = None,
               sampling_defaults: Optional[dict] = None) -> FastAPI:
    """The FastAPI app over a started scheduler. info: what /health and /v1/models say about the decoding.
    template: how chat messages become a prompt (default: the tokenizer's own, chat_template.for_tokenizer).
    sampling_defaults: the checkpoint's recommended settings (generation_config.load), which a request's sampling
    fields left out take (request_defaults; /health and /v1/models list the result as "sampling_defaults")."""
    from kdtree_jax.serve import errors

    defaults = request_defaults(sampling_defaults)
    SamplingParams(**defaults)  # a bad recommendation fails here, at start-up, not in every request
    info = {**info, "sampling_defaults": defaults}

    app = FastAPI(title="kdtree-jax", description="DDTree speculative decoding, OpenAI-compatible completions")
    errors.install(app, on_error=lambda: metrics.add("requests_rejected"))
    created = int(time.time())
    vocab = scheduler.target.cfg.vocab_size
    template = template if template is not None else chat_template.for_tokenizer(tokenizer)
    model_card = {"id": model_name, "object": "model", "created": created, "owned_by": "kdtree-jax", **info,
                  "chat_template": template.origin}

    live: set = set()  # the event queues of the requests running now

    def end_requests() -> None:
        """--drain-timeout is over: every request still running ends now (a final error event, a 503)."""
        for queue in list(live):
            queue.put_nowait(("shutdown", None))

    app.state.end_requests = end_requests

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
        return {"object": "list", "data": [model_card]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != model_name:
            raise ApiError(404, f"the model '{model_id}' does not exist; this server serves '{model_name}'",
                           "model", "model_not_found")
        return model_card

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    def check_prompt(ids: list[int], max_tokens: Optional[int], param: str) -> int:
        """-> the request's max_tokens (None: all the room its prompt leaves), after the limits of the model and pool."""
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
        if max_tokens is not None and max_tokens > limit:
            raise ApiError(400, f"{param} is {max_tokens} but a {len(ids)}-token prompt leaves room for at most "
                                f"{limit} (the model's context and this server's --max-len {scheduler.settings.max_len})",
                           param, "context_length_exceeded")
        return limit if max_tokens is None else max_tokens

    def completion_prompt(req: CompletionRequest) -> tuple[list[int], str]:
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise ApiError(400, f"one prompt per request; got {len(prompt)}", "prompt", "unsupported_value")
            prompt = prompt[0]
        if isinstance(prompt, str):
            return tokenizer.encode(prompt), prompt
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ApiError(400, f"prompt token ids must be in [0, {vocab}); got {bad[0]}", "prompt", "invalid_value")
        return list(prompt), tokenizer.decode(list(prompt))

    def chat_prompt(req: ChatRequest) -> list[int]:
        messages = []
        for m in req.messages:
            message = m.model_dump(exclude_none=True)
            if isinstance(m.content, list):  # text parts: one string, as the templates expect
                message["content"] = "".join(part.text for part in m.content)
            message.setdefault("content", "")
            messages.append(message)
        try:
            text = template.render(messages)
        except chat_template.TemplateError as e:
            raise ApiError(400, " ".join(str(e).split())[:500], "messages", "invalid_value") from None
        return tokenizer.encode(text)

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = _parse(await request.body(), CompletionRequest, model_name)
        ids, prompt_text = completion_prompt(req)
        max_tokens = check_prompt(ids, req.max_tokens, "max_tokens")
        completion_id = f"cmpl-{uuid.uuid4().hex[:24]}"

        def chunk(piece: str, finish) -> dict:
            return {"id": completion_id, "object": "text_completion", "created": int(time.time()),
                    "model": model_name, "choices": [{"text": piece, "index": 0, "logprobs": None,
                                                      "finish_reason": finish}]}

        return await run(request, req, ids, max_tokens, _stops(req.stop), chunk=chunk,
                         first=chunk(prompt_text, None) if req.echo else None,
                         whole=lambda text, finish: chunk((prompt_text if req.echo else "") + text, finish))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = _parse(await request.body(), ChatRequest, model_name)
        if req.max_tokens is not None and req.max_completion_tokens is not None \
                and req.max_tokens != req.max_completion_tokens:
            raise ApiError(400, "max_tokens and max_completion_tokens differ; send one", "max_tokens",
                           "invalid_value")
        ids = chat_prompt(req)
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = check_prompt(ids, req.max_completion_tokens or req.max_tokens, param)
        stops = _stops(req.stop) + ([template.end] if template.end else [])
        completion_id = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        usage_field = {"usage": None} if req.stream_options is not None and req.stream_options.include_usage else {}

        def chunk(delta: dict, finish) -> dict:
            return {"id": completion_id, "object": "chat.completion.chunk", "created": int(time.time()),
                    "model": model_name, "system_fingerprint": None,
                    "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
                    **usage_field}

        def whole(text: str, finish) -> dict:
            return {"id": completion_id, "object": "chat.completion", "created": int(time.time()),
                    "model": model_name, "system_fingerprint": None,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": text, "refusal": None},
                                 "logprobs": None, "finish_reason": finish}]}

        return await run(request, req, ids, max_tokens, stops,
                         chunk=lambda piece, finish: chunk({"content": piece} if piece else {}, finish),
                         first=chunk({"role": "assistant", "content": ""}, None), whole=whole)

    async def run(request: Request, req, ids: list[int], max_tokens: int, stops: list[str], *,
                  chunk: Callable[[str, Any], dict], first: Optional[dict], whole: Callable[[str, Any], dict]):
        """Submit the request and answer it: as server-sent events (`first`, then chunk(piece, finish_reason) as text
        arrives, usage if asked, [DONE]) or whole (whole(text, finish_reason) with usage)."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def emit(kind, value):  # on the decode thread: hand the event to this request's handler
            try:
                loop.call_soon_threadsafe(events.put_nowait, (kind, value))
            except RuntimeError:  # the event loop is closed (shutting down): nobody is listening
                pass

        sampling = _sampling(req, defaults)
        job = sched.Request(prompt=ids, max_tokens=max_tokens, **dataclasses.asdict(sampling), seed=req.seed, emit=emit)
        try:
            scheduler.submit(job)
        except sched.QueueFull as e:
            raise ApiError(429, f"the server is busy: {e}; retry later", None, "queue_full",
                           "rate_limit_exceeded") from None
        except sched.NotAccepting as e:
            raise ApiError(503, str(e), None, "shutting_down", "server_error") from None
        live.add(events)
        text = TextStream(tokenizer, stops)

        def usage() -> dict:
            return {"prompt_tokens": len(ids), "completion_tokens": text.completion_tokens,
                    "total_tokens": len(ids) + text.completion_tokens}

        async def pieces():
            """(text, None) as tokens arrive, then (rest, finish_reason); raises ApiError if the decode failed, the
            client went away (a whole request) or the server's drain time is over."""
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
                elif kind == "shutdown":
                    raise SHUTDOWN
                elif kind == "gone":
                    raise ApiError(499, "client closed the request", None, "client_closed", "cancelled")
                else:
                    raise ApiError(500, str(value), None, "decode_failed", "server_error")

        def event(data: dict) -> str:
            return f"data: {json.dumps(data)}\n\n"

        if req.stream:
            async def sse():
                try:
                    if first is not None:
                        yield event(first)
                    async for piece, finish in pieces():
                        if piece or finish:
                            yield event(chunk(piece, finish))
                    if req.stream_options is not None and req.stream_options.include_usage:
                        yield event({**chunk("", None), "choices": [], "usage": usage()})
                except ApiError as e:
                    yield event(e.body())
                finally:  # a no-op once it is done; frees the row of a client that went away
                    scheduler.cancel(job)
                    live.discard(events)
                yield "data: [DONE]\n\n"

            return StreamingResponse(sse(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

        async def watch():
            """A whole request's client going away (the connection's http.disconnect) while its tokens arrive."""
            while (await request.receive())["type"] != "http.disconnect":
                pass
            events.put_nowait(("gone", None))

        watcher = asyncio.ensure_future(watch())
        out = []
        try:
            async for piece, finish in pieces():
                out.append(piece)
        except ApiError as e:
            return e.response()
        except asyncio.CancelledError:  # uvicorn's last resort after --drain-timeout and its grace: still a 503
            return SHUTDOWN.response()
        finally:
            watcher.cancel()
            scheduler.cancel(job)
            live.discard(events)
        return {**whole("".join(out), finish), "usage": usage()}

    return app
