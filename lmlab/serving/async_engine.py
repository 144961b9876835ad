"""A `ServingEngine` on a thread of its own, for asyncio code (the HTTP server, the load benchmark).

    engine = AsyncEngine(ServingEngine(model, tokenizer, cfg), max_waiting=256)
    engine.start()
    stream = engine.submit(prompt_ids, SamplingParams(max_tokens=64))   # checked here: errors before queueing
    async for event in stream: ...                                       # until every sequence has finished
    engine.abort(stream.request_id)                                      # a client went away: blocks freed

The engine thread owns the scheduler: submissions and cancellations reach it through a queue and are
applied between steps, and each step's events go back to the submitting event loop. When nothing is
running the thread sleeps until a request arrives.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from collections import deque

from lmlab.serving.engine import Event, SamplingParams, ServingEngine

log = logging.getLogger(__name__)

RATE_WINDOW_S = 10.0  # generated tokens/s is measured over this many recent seconds


class QueueFull(RuntimeError):
    """The waiting queue holds max_waiting requests; the client should retry later (HTTP 429)."""


class EngineStopped(RuntimeError):
    """The engine thread ended on an error: no request can run any more (HTTP 503)."""


class RequestStream:
    """The events of one request, in order, ending after its last sequence finishes."""

    def __init__(self, request_id: str, n: int):
        self.request_id, self.n = request_id, n
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self.finished = 0
        self.submitted = time.perf_counter()
        self.first_token_s: float | None = None  # time to first token

    def __aiter__(self):
        return self

    async def __anext__(self) -> Event:
        if self.finished == self.n:
            raise StopAsyncIteration
        event = await self.queue.get()
        if event.finish_reason is not None:
            self.finished += 1
        return event

    @property
    def done(self) -> bool:
        return self.finished == self.n


class AsyncEngine:
    def __init__(self, engine: ServingEngine, max_waiting: int = 1024):
        self.engine, self.max_waiting = engine, max_waiting
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="lmlab-serving", daemon=True)
        self._rate: deque[tuple[float, int]] = deque()
        self.ttft_observers: list = []  # called with each request's time to first token, in seconds
        self.error: BaseException | None = None  # what stopped the engine thread, if anything did

    def start(self) -> AsyncEngine:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    # -- the event loop's side ----------------------------------------------------------------------
    def submit(self, prompt: list[int], params: SamplingParams, request_id: str | None = None) -> RequestStream:
        """Queue a request; a bad one raises ConfigError, a full queue QueueFull, before anything is queued."""
        return self.submit_all([(prompt, params)], request_id)[0]

    def submit_all(self, requests: list[tuple[list[int], SamplingParams]], request_id: str | None = None
                   ) -> list[RequestStream]:
        """Queue each (prompt, params), every one checked first, so that a bad one (ConfigError) leaves none queued
        to run for nobody; `request_id` names a single request."""
        if self.error is not None:
            raise EngineStopped(f"the serving engine stopped: {self.error}")
        for prompt, params in requests:
            self.engine.check(prompt, params)  # the sampler's fields too, in the caller's thread
        # room for all of them, or none is queued (a call cut short would leave some to run for nobody)
        if self.waiting() + len(requests) > self.max_waiting:
            raise QueueFull(f"{self.waiting()} requests are waiting (max_waiting={self.max_waiting}); retry later")
        return [self._queue(prompt, params, request_id) for prompt, params in requests]

    def _queue(self, prompt: list[int], params: SamplingParams, request_id: str | None) -> RequestStream:
        stream = RequestStream(request_id or uuid.uuid4().hex, params.n)
        loop = asyncio.get_running_loop()

        def deliver(event: Event) -> None:
            if stream.first_token_s is None and (event.token is not None or event.finish_reason is not None):
                stream.first_token_s = time.perf_counter() - stream.submitted
                for observe in self.ttft_observers:
                    observe(stream.first_token_s)
            try:
                loop.call_soon_threadsafe(stream.queue.put_nowait, event)
            except RuntimeError:  # the submitting event loop has closed: nobody is left to read the event
                pass

        self._inbox.put(("add", (prompt, params, stream.request_id, deliver)))
        self._wake.set()
        return stream

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))
        self._wake.set()

    def waiting(self) -> int:
        return len(self.engine.scheduler.waiting) + self._inbox.qsize()

    def tokens_per_s(self) -> float:
        """Generated tokens per second over the last RATE_WINDOW_S."""
        if len(self._rate) < 2:
            return 0.0
        (t0, n0), (t1, n1) = self._rate[0], self._rate[-1]
        return (n1 - n0) / max(t1 - t0, 1e-9)

    # -- the engine thread -----------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain()
                if self.engine.has_work():
                    self.engine.step()
                    self._sample_rate()
                else:
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
        except BaseException as err:  # the engine is broken: every open request ends with the error
            log.exception("the serving engine stopped")
            self.error = err
            for request_id in list(self.engine.requests):
                request = self.engine.requests[request_id]
                for i in range(request.params.n):
                    if request.finish_reasons[i] is None and request.on_event is not None:
                        request.on_event(Event(request_id, i, "", None, "error", str(err)))

    def _drain(self) -> None:
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                prompt, params, request_id, deliver = payload
                self.engine.add_request(prompt, params, request_id, deliver)
            else:
                self.engine.abort(payload)

    def _sample_rate(self) -> None:
        now = time.perf_counter()
        self._rate.append((now, self.engine.totals["generation_tokens"]))
        while self._rate and now - self._rate[0][0] > RATE_WINDOW_S:
            self._rate.popleft()
