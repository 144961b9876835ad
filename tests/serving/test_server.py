"""The OpenAI-compatible server over loopback: the `openai` client unchanged, streaming and not;
200 concurrent streaming requests whose greedy outputs equal offline generation and leave every block
free; disconnecting clients, cancelled queued requests, a full queue (429) and malformed requests, each
answered with a 4xx JSON error while the server keeps serving; /health and /metrics."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time

import httpx
import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

import uvicorn  # noqa: E402

from lmlab.alignment.chat import CHAT_TEMPLATES, Turn  # noqa: E402
from lmlab.inference.engine import Engine  # noqa: E402
from lmlab.nn import ModelConfig, Transformer  # noqa: E402
from lmlab.serving import SamplingParams, ServingConfig, ServingEngine  # noqa: E402
from lmlab.serving.async_engine import AsyncEngine, QueueFull  # noqa: E402
from lmlab.serving.server import build_app  # noqa: E402
from lmlab.tokenizers import ByteTokenizer  # noqa: E402

TOKENIZER = ByteTokenizer()
CONTEXT = 1024  # long enough that a request of ~1,000 tokens is still streaming when its client leaves
NAME = "tiny"


@pytest.fixture(scope="module")
def model() -> Transformer:
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=32, n_layers=2, max_seq_len=CONTEXT, norm="rmsnorm", ffn="swiglu", position="rope",
                      block="prenorm", attention={"name": "mha", "n_heads": 4, "n_kv_heads": 2})
    return Transformer(cfg, vocab_size=TOKENIZER.vocab_size).eval()


@contextlib.contextmanager
def running_server(model, max_waiting=1024, start=True, **scheduler):
    engine = AsyncEngine(ServingEngine(model, TOKENIZER, ServingConfig(
        block_size=8, num_blocks=2048, scheduler={"name": "continuous", **scheduler}), stop_ids=[TOKENIZER.eot_id]),
        max_waiting=max_waiting)
    if start:
        engine.start()
    app = build_app(engine, NAME, TOKENIZER, CHAT_TEMPLATES.build("plain"), CONTEXT)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}", engine
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        engine.stop()


@pytest.fixture(scope="module")
def server(model):
    with running_server(model, max_num_seqs=256) as running:
        yield running


def offline(model, text: str, new: int) -> str:
    """Greedy text of the inference engine, stopping at end-of-text as the server does."""
    out = Engine(model).generate([TOKENIZER.encode(text)], max_new_tokens=new, stop_token_ids=[TOKENIZER.eot_id],
                                 tokenizer=TOKENIZER)
    return out.texts[0]


def wait_until_idle(engine: AsyncEngine, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = engine.engine.stats()
        if stats["running"] == 0 and stats["waiting"] == 0 and stats["kv_blocks_used"] == 0:
            return stats
        time.sleep(0.02)
    raise AssertionError(f"the engine did not go idle: {engine.engine.stats()}")


def test_the_openai_client_works_unchanged(server, model):
    url, _ = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    assert [m.id for m in client.models.list().data] == [NAME]
    expected = offline(model, "def f(x):", 12)
    reply = client.completions.create(model=NAME, prompt="def f(x):", max_tokens=12, temperature=0)
    assert reply.choices[0].text == expected and reply.usage.prompt_tokens == len("def f(x):")
    finished = Engine(model).generate([TOKENIZER.encode("def f(x):")], max_new_tokens=12,
                                      stop_token_ids=[TOKENIZER.eot_id])
    assert reply.usage.completion_tokens == len(finished.tokens[0])
    assert reply.choices[0].finish_reason == finished.finish_reasons[0]
    streamed = client.completions.create(model=NAME, prompt="def f(x):", max_tokens=12, temperature=0, stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed) == expected

    chat_prompt = CHAT_TEMPLATES.build("plain").render([Turn("user", "hi")], add_generation_prompt=True)
    chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                                          temperature=0, n=2)
    expected_chat = offline(model, chat_prompt, 8).split("\nUser:")[0]
    assert [c.message.content for c in chat.choices] == [expected_chat] * 2
    assert [c.index for c in chat.choices] == [0, 1] and chat.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=8, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected_chat
    assert chunks[-1].usage is not None and chunks[-2].choices[0].finish_reason in ("stop", "length")


def test_200_concurrent_streams_complete_equal_offline_greedy_and_free_every_block(server, model):
    url, engine = server
    prompts = [f"request {i}: " + "x" * (i % 13) for i in range(200)]

    async def stream(client: httpx.AsyncClient, prompt: str) -> str:
        body = {"model": NAME, "prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": True}
        text = ""
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    text += json.loads(line[6:])["choices"][0]["text"]
        return text

    async def everyone() -> list[str]:
        limits = httpx.Limits(max_connections=200)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            return await asyncio.gather(*(stream(client, p) for p in prompts))

    texts = asyncio.run(everyone())
    assert texts == [offline(model, p, 8) for p in prompts]
    wait_until_idle(engine)


def test_a_client_that_disconnects_mid_stream_frees_its_blocks(server):
    url, engine = server
    before = engine.engine.totals["generation_tokens"]
    body = {"model": NAME, "prompt": "hello", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as response:
        next(response.iter_lines())  # one chunk, then the client goes away
    wait_until_idle(engine)
    assert engine.engine.totals["generation_tokens"] - before < 1000  # cancelled, not run to the end


def test_a_cancelled_queued_request_never_runs(model):
    engine = AsyncEngine(ServingEngine(model, TOKENIZER, ServingConfig(
        block_size=8, scheduler={"name": "continuous", "max_num_seqs": 1}))).start()

    async def scenario():
        long = engine.submit(TOKENIZER.encode("a"), SamplingParams(max_tokens=600, ignore_eos=True))
        queued = engine.submit(TOKENIZER.encode("b"), SamplingParams(max_tokens=8))
        await anext(long)  # the first is running, so the second waits behind it (max_num_seqs=1)
        engine.abort(queued.request_id)
        events = [e async for e in queued]
        engine.abort(long.request_id)
        assert [e async for e in long][-1].finish_reason == "abort"
        return events

    try:
        events = asyncio.run(scenario())
        assert [(e.token, e.finish_reason) for e in events] == [(None, "abort")]
        wait_until_idle(engine)
    finally:
        engine.stop()


def test_a_full_queue_answers_429_and_the_server_keeps_serving(model):
    with running_server(model, max_waiting=1, start=False) as (url, engine):  # the engine admits nothing yet
        body = {"model": NAME, "prompt": "a", "max_tokens": 4, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as queued:
            assert queued.status_code == 200 and engine.waiting() == 1
            refused = httpx.post(f"{url}/v1/completions", json={"model": NAME, "prompt": "c", "max_tokens": 2})
            assert refused.status_code == 429 and refused.json()["error"]["type"] == "rate_limit_error"
            engine.start()
            assert [line for line in queued.iter_lines() if line][-1] == "data: [DONE]"  # served once started
        assert httpx.post(f"{url}/v1/completions", json={"model": NAME, "prompt": "c", "max_tokens": 2}).status_code == 200
        wait_until_idle(engine)


def test_queue_full_is_raised_before_queueing(model):
    engine = AsyncEngine(ServingEngine(model, TOKENIZER, ServingConfig(block_size=8)), max_waiting=1)  # not started

    async def scenario():
        engine.submit([1, 2], SamplingParams())
        with pytest.raises(QueueFull, match="max_waiting=1"):
            engine.submit([1, 2], SamplingParams())

    asyncio.run(scenario())


@pytest.mark.parametrize("body, status, message", [
    ("{not json", 400, "JSON"),
    ({"model": NAME, "prompt": "x", "max_tokens": 0}, 400, "max_tokens must be >= 1"),
    ({"model": NAME, "prompt": "x" * CONTEXT}, 400, f"the model's context is {CONTEXT}"),
    ({"model": "gpt-9", "prompt": "x"}, 404, "does not exist"),
    ({"model": NAME}, 400, "prompt"),
    ({"model": NAME, "prompt": "x", "top_p": 0.5, "top_k": 3}, 400, "set one of top_k, top_p and min_p"),
    ({"model": NAME, "prompt": ""}, 400, "prompt is empty"),
    ({"model": NAME, "prompt": ["ok", ""]}, 400, "prompt is empty"),
    # token ids outside the vocabulary: once these stopped the engine, and every later request failed
    ({"model": NAME, "prompt": [1, 10**6]}, 400, "token id 1000000"),
    ({"model": NAME, "prompt": [[1], [-1]]}, 400, "token id -1"),
    # past the context with max_tokens: refused as OpenAI and vLLM do, not cut short
    ({"model": NAME, "prompt": "x" * (CONTEXT - 8), "max_tokens": 16}, 400, "lower max_tokens to 8"),
    ({"model": NAME, "prompt": "x", "logit_bias": {"5": 100}}, 400, "logit_bias is not supported"),
    ({"model": NAME, "prompt": "x", "logprobs": 2}, 400, "logprobs is not supported"),
    ({"model": NAME, "prompt": "x", "echo": True}, 400, "echo is not supported"),
    ({"model": NAME, "prompt": "x", "suffix": "end"}, 400, "suffix is not supported"),
])
def test_bad_requests_get_a_json_error_and_the_server_keeps_serving(server, body, status, message):
    url, _ = server
    content = body if isinstance(body, str) else json.dumps(body)
    response = httpx.post(f"{url}/v1/completions", content=content, headers={"Content-Type": "application/json"})
    assert response.status_code == status
    assert message in response.json()["error"]["message"]
    assert httpx.post(f"{url}/v1/completions", json={"model": NAME, "prompt": "ok", "max_tokens": 2}).status_code == 200
    assert httpx.get(f"{url}/health").status_code == 200


def test_a_completion_past_the_context_names_its_fields(server):
    url, _ = server
    error = httpx.post(f"{url}/v1/completions", json={"model": NAME, "prompt": "x" * (CONTEXT - 8),
                                                      "max_tokens": 16}).json()["error"]
    assert (error["param"], error["code"]) == ("max_tokens", "context_length_exceeded")
    error = httpx.post(f"{url}/v1/completions", json={"model": NAME, "prompt": "x" * CONTEXT}).json()["error"]
    assert (error["param"], error["code"]) == ("prompt", "context_length_exceeded")
    # max_tokens null: the rest of the context, as vLLM gives
    done = httpx.post(f"{url}/v1/completions", json={"model": NAME, "prompt": "x" * (CONTEXT - 3), "max_tokens": None,
                                                     "ignore_eos": True, "temperature": 0}).json()
    assert done["usage"]["completion_tokens"] == 3 and done["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("fields, status, param", [
    ({"max_tokens": 0}, 400, "max_tokens"),  # once read as "not set", and the reply ran to the context's end
    ({"max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ({"max_completion_tokens": CONTEXT}, 400, "max_completion_tokens"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
    ({"response_format": {"type": "json_object"}}, 400, "response_format"),
    ({"response_format": {"type": "text"}, "max_completion_tokens": 2, "max_tokens": 50}, 200, None),
])
def test_chat_limits_and_unsupported_fields(server, fields, status, param):
    url, _ = server
    response = httpx.post(f"{url}/v1/chat/completions",
                          json={"model": NAME, "messages": [{"role": "user", "content": "Hi"}], **fields})
    assert response.status_code == status
    if status == 200:
        assert response.json()["usage"]["completion_tokens"] <= 2
    else:
        assert response.json()["error"]["param"] == param


def test_a_message_without_content_is_refused(server):
    url, _ = server
    response = httpx.post(f"{url}/v1/chat/completions", json={"model": NAME, "messages": [{"role": "user"}]})
    assert response.status_code == 400 and "content" in response.json()["error"]["message"]


def test_routes_answer_in_openais_form(server):
    url, _ = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    assert client.models.retrieve(NAME).id == NAME
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-9")
    for response, status in ((httpx.get(f"{url}/v1/nowhere"), 404), (httpx.get(f"{url}/v1/completions"), 405)):
        assert response.status_code == status and response.json()["error"]["message"]


def test_a_stopped_engine_answers_503_in_json(model):
    with running_server(model) as (url, engine):
        engine.error = RuntimeError("a failed step")
        response = httpx.post(f"{url}/v1/completions", json={"model": NAME, "prompt": "ok"})
        assert response.status_code == 503 and "a failed step" in response.json()["error"]["message"]


@pytest.mark.parametrize("field, value", [("temperature", -1), ("top_p", 1.5), ("top_p", 0), ("min_p", 2),
                                          ("top_k", -2), ("n", 0), ("n", 129), ("repetition_penalty", 0),
                                          ("frequency_penalty", 2.5), ("presence_penalty", -3)])
def test_a_sampling_setting_out_of_range_is_named_as_the_request_names_it(server, field, value):
    url, _ = server
    response = httpx.post(f"{url}/v1/completions", json={"model": NAME, "prompt": "x", field: value})
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == field and field in error["message"]
    assert "sampler." not in error["message"]


def test_health_and_prometheus_metrics(server):
    url, _ = server
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}
    httpx.post(f"{url}/v1/completions", json={"model": NAME, "prompt": "ok", "max_tokens": 2})
    text = httpx.get(f"{url}/metrics").text
    for name in ("lmlab:num_requests_waiting", "lmlab:num_requests_running", "lmlab:kv_blocks_used",
                 "lmlab:generation_tokens_per_second", "lmlab:time_to_first_token_seconds_bucket"):
        assert f'{name}{{' in text, name
    count = next(line for line in text.splitlines() if line.startswith("lmlab:time_to_first_token_seconds_count"))
    assert float(count.split()[-1]) >= 1
