"""The OpenAI-compatible HTTP API (FastAPI): what `lmlab serve` runs.

    POST /v1/completions        prompt (text, texts, token ids), max_tokens, temperature, top_p, n, stop, seed,
                                frequency/presence penalties, logit_bias, logprobs (0..5), echo, stream
                                (server-sent events); vLLM's top_k, min_p, repetition_penalty, ignore_eos
    POST /v1/chat/completions   messages rendered with the server's chat template; the same settings, with chat's
                                logprobs (true/false) and top_logprobs (0..20) instead of logprobs and echo
    GET  /v1/models, /v1/models/{model}, /health, /metrics (Prometheus)

Log-probabilities are the model's own (lmlab.serving.logprobs: before logit_bias, penalties, temperature and
truncation), in OpenAI's shapes (lmlab.serving.openai_logprobs); a streamed chunk carries its tokens'. They cover
every sampled token, those that complete a stop string (and are cut from the text) included, as in vLLM. echo with
max_tokens=0 reads the prompt only: with logprobs, it is scored (lm-evaluation-harness's loglikelihood).

Errors are OpenAI's JSON ({"error": {"message", "type", "param", "code"}}) on every route: 400 for a malformed
body, a request the model cannot run (a prompt and max_tokens past the context: code context_length_exceeded; token
ids outside the vocabulary, in the prompt or logit_bias) or an OpenAI field lmlab does not implement (suffix, tools,
...), 404 for an unknown model or route, 429 when the waiting queue is full, 503 once the engine has stopped. A client
that disconnects, streaming or not, has its request cancelled and its blocks freed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException

from lmlab.alignment.chat import Turn
from lmlab.alignment.tokens import encode
from lmlab.errors import ConfigError
from lmlab.inference.samplers import SAMPLERS
from lmlab.serving.async_engine import AsyncEngine, EngineStopped, QueueFull, RequestStream
from lmlab.serving.engine import SamplingParams
from lmlab.serving.logprobs import TokenLogprobs
from lmlab.serving.metrics import ServerMetrics
from lmlab.serving.openai_logprobs import CompletionLogprobs, TokenPieces, chat_logprobs

DISCONNECT_POLL_S = 0.1  # how often a non-streaming request checks that its client is still there


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.code, self.param = status, message, kind, code, param

    def response(self) -> JSONResponse:
        return JSONResponse(status_code=self.status, content={"error": {
            "message": self.message, "type": self.kind, "param": self.param, "code": self.code}})


@dataclass(frozen=True)
class Unsupported:
    """Marks an OpenAI field lmlab's server does not implement: a request that sets it to anything but `unset` (the
    values that ask for nothing, what clients send by default) is refused."""

    unset: tuple


class SamplingFields(BaseModel):
    """OpenAI's sampling settings, and vLLM's extensions."""

    model_config = ConfigDict(extra="ignore")  # clients send fields lmlab does not use (user, metadata)

    # Ranges are checked here so that an error names the request's field (`param`), not the sampler's key.
    model: str
    n: int = Field(1, ge=1, le=128)  # OpenAI's limit
    temperature: float | None = Field(None, ge=0)  # no upper limit, as in vLLM (OpenAI's is 2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # -1 and 0: off, as in vLLM
    min_p: float | None = Field(None, ge=0, le=1)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)  # OpenAI's and vLLM's range
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    logit_bias: dict[str, float] | None = None  # token id (a string, as JSON's keys are) -> its bias, in [-100, 100]
    # OpenAI's fields that lmlab's server does not implement: refused when set (`refuse_unsupported`), so that no
    # client gets output that silently ignored them
    suffix: Annotated[Any, Unsupported((None, ""))] = None
    best_of: Annotated[Any, Unsupported((None, 1))] = None
    tools: Annotated[Any, Unsupported((None, []))] = None
    tool_choice: Annotated[Any, Unsupported((None, "none"))] = None
    functions: Annotated[Any, Unsupported((None, []))] = None
    function_call: Annotated[Any, Unsupported((None, "none"))] = None
    response_format: Annotated[Any, Unsupported((None, {"type": "text"}))] = None

    def refuse_unsupported(self) -> None:
        for name, info in type(self).model_fields.items():
            for mark in info.metadata:
                if isinstance(mark, Unsupported) and getattr(self, name) not in mark.unset:
                    raise APIError(400, f"{name} is not supported by lmlab's server", param=name)

    def bias(self) -> dict[int, float]:
        """logit_bias by integer token id, its keys and range checked (the ids against the vocabulary by the engine)."""
        bias = {}
        for key, value in (self.logit_bias or {}).items():
            if not re.fullmatch(r"[0-9]+", key):
                raise APIError(400, f"logit_bias maps token ids to biases; {key!r} is not a token id (an integer >= 0)",
                               param="logit_bias")
            if not -100 <= value <= 100:
                raise APIError(400, f"logit_bias[{key!r}] is {value}; a bias must be in [-100, 100]",
                               param="logit_bias")
            bias[int(key)] = value
        return bias

    def sampler(self) -> Any:
        """The typed Config of the `sampler` entry these settings select: one truncation at most, greedy at
        temperature 0. Typed already (pydantic checked the fields), so no OmegaConf pass: one over a mapping takes
        ~60 ms for OpenAI's 300 logit_bias keys."""
        temperature = 1.0 if self.temperature is None else self.temperature
        shared = {"temperature": temperature, "frequency_penalty": self.frequency_penalty,
                  "presence_penalty": self.presence_penalty, "repetition_penalty": self.repetition_penalty,
                  "seed": self.seed, "logit_bias": self.bias()}
        truncations = {"top_k": {"top_k": self.top_k} if self.top_k not in (None, -1, 0) else None,
                       "top_p": {"p": self.top_p} if self.top_p not in (None, 1.0) else None,
                       "min_p": {"min_p": self.min_p} if self.min_p not in (None, 0.0) else None}
        chosen = {name: fields for name, fields in truncations.items() if fields is not None}
        if temperature == 0:
            return SAMPLERS.get("greedy").config(**shared)
        if len(chosen) > 1:
            raise APIError(400, f"set one of top_k, top_p and min_p, not {' and '.join(chosen)}: lmlab's samplers "
                                "apply one truncation")
        name, fields = next(iter(chosen.items()), ("temperature", {}))
        return SAMPLERS.get(name).config(**shared, **fields)

    def params(self, max_tokens: int, extra_stops: list[str] = (), logprobs: int | None = None,
               prompt_logprobs: int | None = None) -> SamplingParams:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(max_tokens=max_tokens, sampler=self.sampler(), n=self.n,
                              stop=[*stops, *extra_stops], stop_token_ids=self.stop_token_ids,
                              ignore_eos=self.ignore_eos, include_stop_str_in_output=self.include_stop_str_in_output,
                              logprobs=logprobs, prompt_logprobs=prompt_logprobs)


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default; null: the rest of the context (vLLM); 0 with echo: none
    logprobs: int | None = Field(None, ge=0, le=5)  # the chosen token's and this many most likely (OpenAI's limit)
    echo: bool | None = False  # the prompt before the completion, and with logprobs its tokens' (the first: null)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[dict[str, Any]]  # required: a message without content (tool calls) is not supported

    def text(self) -> str:
        if isinstance(self.content, list):  # content parts: lmlab's models read only the text ones
            if any(part.get("type") != "text" for part in self.content):
                raise APIError(400, "only text content parts are supported", param="messages")
            return "".join(part.get("text", "") for part in self.content)
        return self.content


class ChatRequest(SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20)  # OpenAI's limit; needs logprobs=true unless 0 (as in vLLM)
    echo: Annotated[Any, Unsupported((None, False))] = None  # vLLM's extension, not OpenAI's chat API


def build_app(engine: AsyncEngine, model_name: str, tokenizer, chat_template, max_seq_len: int) -> FastAPI:
    """The API over a started `AsyncEngine`. chat_template: a `chat_template` registry entry, built."""
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        engine.stop()  # the server shuts down: the engine thread ends with it

    app = FastAPI(title="lmlab", description="OpenAI-compatible completions from an lmlab model", lifespan=lifespan)
    app.state.engine = engine
    metrics = ServerMetrics(engine, model_name)
    created = int(time.time())
    pieces = TokenPieces(tokenizer)

    @app.exception_handler(APIError)
    async def api_error(_: Request, err: APIError):
        return err.response()

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_: Request, err: RequestValidationError):
        first = err.errors()[0] if err.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body" and not isinstance(p, int))
        return APIError(400, f"invalid request body: {where + ': ' if where else ''}{first.get('msg', err)}",
                        param=where or None).response()

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, err: HTTPException):  # unknown routes and methods, in OpenAI's form too
        return APIError(err.status_code, str(err.detail)).response()

    @app.exception_handler(Exception)
    async def server_error(_: Request, err: Exception):  # a bug: still OpenAI's JSON, and logged by the server
        return APIError(500, f"internal error: {type(err).__name__}: {err}", kind="server_error").response()

    @app.get("/health")
    async def health():
        if engine.error is not None:
            raise APIError(503, f"the serving engine stopped: {engine.error}", kind="server_error")
        return {"status": "ok"}

    card = {"id": model_name, "object": "model", "created": created, "owned_by": "lmlab", "max_model_len": max_seq_len}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str):
        check_model(model)
        return card

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    def check_model(name: str) -> None:
        if name != model_name:
            raise APIError(404, f"the model `{name}` does not exist; this server serves `{model_name}`",
                           code="model_not_found", param="model")

    def check_request(body: SamplingFields) -> None:
        check_model(body.model)
        body.refuse_unsupported()

    def budget(prompt: list[int], requested: int | None, param: str, prompt_param: str, least: int = 1,
               hint: str = "") -> int:
        """The tokens a completion may make: `requested` (at least `least`), or when unset the rest of the context.
        A request that does not fit the context is refused, as OpenAI and vLLM do, rather than cut short."""
        if requested is not None and requested < least:
            raise APIError(400, f"{param} must be >= {least}, got {requested}{hint}", param=param)
        room = max_seq_len - len(prompt)
        if room < (0 if requested == 0 else 1):  # a prompt only read may fill the context
            raise APIError(400, f"the prompt has {len(prompt)} tokens; the model's context is {max_seq_len} tokens, "
                                "prompt and completion together", param=prompt_param, code="context_length_exceeded")
        if requested is not None and requested > room:
            raise APIError(400, f"the model's context is {max_seq_len} tokens, and this request asks for "
                                f"{len(prompt) + requested}: {len(prompt)} in the prompt and {requested} in the "
                                f"completion; lower {param} to {room} or less", param=param,
                           code="context_length_exceeded")
        return room if requested is None else requested

    def submit(requests: list[tuple[list[int], SamplingParams]]) -> list[RequestStream]:
        """Queue each (prompt, params), all checked first: a prompt that cannot run refuses the whole call before
        any other prompt of it is queued (and runs for nobody)."""
        try:
            return engine.submit_all(requests)
        except QueueFull as err:
            raise APIError(429, str(err), kind="rate_limit_error") from None
        except EngineStopped as err:
            raise APIError(503, str(err), kind="server_error") from None
        except ConfigError as err:
            raise APIError(400, str(err), param=getattr(err, "param", None)) from None

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_request(body)
        prompts = _prompt_ids(body.prompt, tokenizer)
        # max_tokens=0 with echo: the prompt alone, scored with logprobs (lm-evaluation-harness's loglikelihood)
        limits = [budget(p, body.max_tokens, "max_tokens", "prompt", least=0 if body.echo else 1,
                         hint="" if body.echo else " (0 only with echo=true: the prompt alone)") for p in prompts]
        scored = body.logprobs if body.echo else None
        streams = submit([(p, body.params(limit, logprobs=body.logprobs, prompt_logprobs=scored))
                          for p, limit in zip(prompts, limits)])
        echoed = [tokenizer.decode(p) if body.echo else "" for p in prompts]  # what the prompt's tokens decode to
        logprobs = None if body.logprobs is None else [CompletionLogprobs(pieces, p, text, bool(body.echo))
                                                       for p, text in zip(prompts, echoed) for _ in range(body.n)]
        reply = _Reply("cmpl", "text_completion", model_name, body.n, sum(map(len, prompts)))
        if body.stream:
            return _sse(reply.completion_chunks(streams, _usage_wanted(body), echoed, logprobs), streams, engine)
        choices = await _collect(streams, request, engine)
        return reply.final([{"index": i, "text": echoed[i // body.n] + c.text,
                             "logprobs": None if logprobs is None else logprobs[i].next(c.logprobs, c.prompt_logprobs),
                             "finish_reason": c.finish_reason} for i, c in enumerate(choices)], choices)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        check_request(body)
        if body.top_logprobs and not body.logprobs:
            raise APIError(400, f"top_logprobs={body.top_logprobs} needs logprobs=true", param="top_logprobs")
        if not body.messages:
            raise APIError(400, "messages is empty", param="messages")
        turns = [Turn("system" if m.role == "developer" else m.role, m.text()) for m in body.messages]
        try:
            text = chat_template.render(turns, add_generation_prompt=True)
        except ConfigError as err:
            raise APIError(400, str(err), param="messages") from None
        prompt = encode(tokenizer, text, special_tokens=True)
        if body.max_completion_tokens is not None:  # OpenAI's newer name wins over max_tokens
            limit = budget(prompt, body.max_completion_tokens, "max_completion_tokens", "messages")
        else:
            limit = budget(prompt, body.max_tokens, "max_tokens", "messages")
        params = body.params(limit, extra_stops=[chat_template.stop],
                             logprobs=(body.top_logprobs or 0) if body.logprobs else None)
        streams = submit([(prompt, params)])
        reply = _Reply("chatcmpl", "chat.completion", model_name, body.n, len(prompt))
        wanted = pieces if body.logprobs else None
        if body.stream:
            return _sse(reply.chat_chunks(streams[0], _usage_wanted(body), wanted), streams, engine)
        choices = await _collect(streams, request, engine)
        return reply.final([{"index": i, "message": {"role": "assistant", "content": c.text},
                             "logprobs": chat_logprobs(pieces, c.logprobs) if body.logprobs else None,
                             "finish_reason": c.finish_reason} for i, c in enumerate(choices)], choices)

    return app


def _prompt_ids(prompt, tokenizer) -> list[list[int]]:
    """A completion request's prompts as token ids: text, texts, one list of ids, or lists of ids."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise APIError(400, "the prompt is empty", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        prompt = [prompt]
    ids = [encode(tokenizer, p, special_tokens=True) if isinstance(p, str) else list(p) for p in prompt]
    if not all(ids):
        raise APIError(400, "a prompt is empty: generation needs at least one token to start from", param="prompt")
    return ids


def _usage_wanted(body: SamplingFields) -> bool:
    return bool(body.stream_options and body.stream_options.get("include_usage"))


def _finish_reason(reason: str | None) -> str | None:
    """OpenAI's finish reasons: stop and length (a cancelled or failed sequence reports stop)."""
    return None if reason is None else ("length" if reason == "length" else "stop")


class _Reply:
    """The response objects of one API call: its id, and choices numbered prompt by prompt, n each."""

    def __init__(self, prefix: str, kind: str, model: str, n: int, prompt_tokens: int):
        self.id, self.kind, self.model, self.n = f"{prefix}-{uuid.uuid4().hex}", kind, model, n
        self.created, self.prompt_tokens = int(time.time()), prompt_tokens

    def envelope(self, kind: str) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def usage(self, completion_tokens: int) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": self.prompt_tokens + completion_tokens}

    def final(self, choices: list[dict], results: list[_Choice]) -> dict[str, Any]:
        return {**self.envelope(self.kind), "choices": choices, "usage": self.usage(sum(r.tokens for r in results))}

    async def completion_chunks(self, streams: list[RequestStream], usage: bool, echoed: list[str],
                                logprobs: list[CompletionLogprobs] | None) -> AsyncIterator[dict]:
        """Each event's text (a choice's first after its echoed prompt) and, when asked, its tokens' logprobs."""
        tokens, started = 0, set()
        async for offset, event in _merged(streams, self.n):
            index = offset + event.index
            tokens += event.token is not None
            text = event.text if index in started else echoed[offset // self.n] + event.text
            started.add(index)
            found = None if logprobs is None else logprobs[index].next(
                [event.logprobs] if event.logprobs else [], event.prompt_logprobs)
            found = found if found and found["tokens"] else None  # a chunk of no token has no logprobs
            if text or found or event.finish_reason is not None:
                yield {**self.envelope("text_completion"), "choices": [{
                    "index": index, "text": text, "logprobs": found,
                    "finish_reason": _finish_reason(event.finish_reason)}]}
        if usage:
            yield {**self.envelope("text_completion"), "choices": [], "usage": self.usage(tokens)}

    async def chat_chunks(self, stream: RequestStream, usage: bool, pieces: TokenPieces | None) -> AsyncIterator[dict]:
        """The role, then each event's text with its token's logprobs (`pieces`: when asked), then the finish."""
        kind, tokens = "chat.completion.chunk", 0
        for i in range(self.n):  # the role comes first, as OpenAI's streams send it
            yield {**self.envelope(kind), "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                       "logprobs": None, "finish_reason": None}]}
        async for event in stream:
            tokens += event.token is not None
            found = chat_logprobs(pieces, [event.logprobs]) if pieces and event.logprobs else None
            if event.text or found:
                yield {**self.envelope(kind), "choices": [{"index": event.index, "delta": {"content": event.text},
                                                           "logprobs": found, "finish_reason": None}]}
            if event.finish_reason is not None:
                yield {**self.envelope(kind), "choices": [{"index": event.index, "delta": {}, "logprobs": None,
                                                           "finish_reason": _finish_reason(event.finish_reason)}]}
        if usage:
            yield {**self.envelope(kind), "choices": [], "usage": self.usage(tokens)}


async def _merged(streams: list[RequestStream], n: int) -> AsyncIterator[tuple[int, Any]]:
    """Events of several requests as they come: (the first choice index of its request, event)."""
    pending = {asyncio.ensure_future(anext(s, None)): (k, s) for k, s in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for future in done:
                k, stream = pending.pop(future)
                event = future.result()
                if event is not None:
                    yield k * n, event
                    pending[asyncio.ensure_future(anext(stream, None))] = (k, stream)
    finally:
        for future in pending:
            future.cancel()


def _sse(chunks: AsyncIterator[dict], streams: list[RequestStream], engine: AsyncEngine) -> StreamingResponse:
    async def body():
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
            yield "data: [DONE]\n\n"
        finally:  # the client went away (the server cancels this generator), or every request finished
            for stream in streams:
                if not stream.done:
                    engine.abort(stream.request_id)

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


@dataclass
class _Choice:
    """What the events of one choice add up to."""

    text: str = ""
    finish_reason: str | None = None
    tokens: int = 0
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] | None = None


async def _collect(streams: list[RequestStream], request: Request, engine: AsyncEngine) -> list[_Choice]:
    """Every choice, in order; cancels everything if the client disconnects."""
    async def gather(stream: RequestStream) -> list[_Choice]:
        choices = [_Choice() for _ in range(stream.n)]
        async for event in stream:
            choice = choices[event.index]
            choice.text += event.text
            choice.tokens += event.token is not None
            if event.logprobs is not None:
                choice.logprobs.append(event.logprobs)
            if event.prompt_logprobs is not None:
                choice.prompt_logprobs = event.prompt_logprobs
            if event.finish_reason is not None:
                if event.finish_reason == "error":
                    raise APIError(500, f"generation failed: {event.error}", kind="server_error")
                choice.finish_reason = _finish_reason(event.finish_reason)
        return choices

    work = asyncio.ensure_future(asyncio.gather(*(gather(s) for s in streams)))
    try:
        while not work.done():
            await asyncio.wait([work], timeout=DISCONNECT_POLL_S)
            if not work.done() and await request.is_disconnected():
                work.cancel()
                break
        return [choice for per_request in await work for choice in per_request]
    finally:
        for stream in streams:
            if not stream.done:
                engine.abort(stream.request_id)
