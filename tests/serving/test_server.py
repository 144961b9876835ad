"""The OpenAI-compatible server over loopback: the `openai` client unchanged, streaming and not;
200 concurrent streaming requests whose greedy outputs equal offline generation and leave every block
free; disconnecting clients, cancelled queued requests, a full queue (429) and malformed requests, each
answered with a 4xx JSON error while the server keeps serving; /health and /metrics. logprobs, echo
(lm-evaluation-harness's scoring with max_tokens=0) and logit_bias on both endpoints, streamed and not."""

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
from lmlab.inference.samplers import SAMPLERS  # noqa: E402
from lmlab.nn import ModelConfig, Transformer  # noqa: E402
from lmlab.serving import SamplingParams, ServingConfig, ServingEngine  # noqa: E402
from lmlab.serving.async_engine import AsyncEngine, QueueFull  # noqa: E402
from lmlab.serving.server import CompletionRequest, build_app  # noqa: E402
from lmlab.tokenizers import ByteTokenizer  # noqa: E402
from tests.serving.test_engine import model_logprobs  # noqa: E402

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


def completion(url: str, route: str = "/v1/completions", **fields) -> dict:
    """A greedy reply that must succeed."""
    response = httpx.post(f"{url}{route}", json={"model": NAME, "temperature": 0, **fields}, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def streamed(url: str, route: str = "/v1/completions", **fields) -> list[dict]:
    """The chunks of a greedy streamed reply."""
    body = {"model": NAME, "temperature": 0, "stream": True, **fields}
    with httpx.stream("POST", f"{url}{route}", json=body, timeout=60) as response:
        return [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")
                and line != "data: [DONE]"]


def token_id(text: str) -> int:
    """The byte tokenizer's id of a logprobs token text ("bytes:\\xNN" for a byte that is no character alone)."""
    if text.startswith("bytes:"):
        (token,) = bytes.fromhex(text.removeprefix("bytes:").replace("\\x", ""))
        return token
    (token,) = TOKENIZER.encode(text)
    return token


def expected_top(reference_row: torch.Tensor, k: int) -> list[int]:
    """The k most likely ids among the tokenizer's (the model's vocabulary is padded past them)."""
    return reference_row[:TOKENIZER.vocab_size].topk(k).indices.tolist()


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


def test_a_call_with_more_prompts_than_the_queue_has_room_for_queues_none(model):
    engine = AsyncEngine(ServingEngine(model, TOKENIZER, ServingConfig(block_size=8)), max_waiting=2)  # not started

    async def scenario():
        engine.submit([1, 2], SamplingParams())
        with pytest.raises(QueueFull, match="max_waiting=2"):
            engine.submit_all([([1, 2], SamplingParams()), ([3, 4], SamplingParams())])
        assert engine.waiting() == 1  # the first of the two was not queued either

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
    ({"model": NAME, "prompt": "x", "suffix": "end"}, 400, "suffix is not supported"),
    ({"model": NAME, "prompt": "x", "max_tokens": 0}, 400, "(0 only with echo=true: the prompt alone)"),
    ({"model": NAME, "prompt": "x" * (CONTEXT + 1), "max_tokens": 0, "echo": True}, 400,
     f"the model's context is {CONTEXT}"),
    ({"model": NAME, "prompt": "x", "logprobs": 6}, 400, "logprobs: Input should be less than or equal to 5"),
    ({"model": NAME, "prompt": "x", "logprobs": -1}, 400, "logprobs: Input should be greater than or equal to 0"),
    ({"model": NAME, "prompt": "x", "logit_bias": {"abc": 5}}, 400, "'abc' is not a token id (an integer >= 0)"),
    ({"model": NAME, "prompt": "x", "logit_bias": {"-3": 5}}, 400, "'-3' is not a token id"),
    ({"model": NAME, "prompt": "x", "logit_bias": {"5": 100.5}}, 400, "a bias must be in [-100, 100]"),
    ({"model": NAME, "prompt": "x", "logit_bias": {"5": "high"}}, 400, "logit_bias.5: Input should be a valid number"),
    ({"model": NAME, "prompt": "x", "logit_bias": {"5000": 1}}, 400,
     "logit_bias holds token id 5000, outside the vocabulary (0..256)"),
])
def test_bad_requests_get_a_json_error_and_the_server_keeps_serving(server, body, status, message):
    url, engine = server
    content = body if isinstance(body, str) else json.dumps(body)
    before = engine.engine.totals["requests"]
    response = httpx.post(f"{url}/v1/completions", content=content, headers={"Content-Type": "application/json"})
    assert response.status_code == status
    assert message in response.json()["error"]["message"]
    if "token id" in message:  # the engine's refusals name the request's field too
        assert response.json()["error"]["param"] in ("prompt", "logit_bias")
    assert engine.engine.totals["requests"] == before  # refused before any work
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
    ({"top_logprobs": 3}, 400, "top_logprobs"),  # needs logprobs=true
    ({"logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),  # OpenAI's limit is 20
    ({"logprobs": 3}, 400, "logprobs"),  # chat's is true or false
    ({"logit_bias": {"7": -101}}, 400, "logit_bias"),
    ({"echo": True}, 400, "echo"),  # completions only
    ({"logprobs": True, "top_logprobs": 0, "max_tokens": 2}, 200, None),
])
def test_chat_limits_and_unsupported_fields(server, fields, status, param):
    url, _ = server
    response = httpx.post(f"{url}/v1/chat/completions",
                          json={"model": NAME, "messages": [{"role": "user", "content": "Hi"}], **fields})
    assert response.status_code == status
    if status == 200:
        assert response.json()["usage"]["completion_tokens"] <= 2
    else:
        error = response.json()["error"]
        assert error["param"] == param and param in error["message"]


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


def test_completion_logprobs_equal_a_full_forward_and_change_no_text(server, model):
    url, _ = server
    prompt = TOKENIZER.encode("def f(x):")
    plain = completion(url, prompt="def f(x):", max_tokens=12, ignore_eos=True)["choices"][0]
    choice = completion(url, prompt="def f(x):", max_tokens=12, ignore_eos=True, logprobs=3)["choices"][0]
    assert choice["text"] == plain["text"] and plain["logprobs"] is None
    logprobs = choice["logprobs"]
    ids = prompt + [token_id(t) for t in logprobs["tokens"]]
    assert len(ids) == len(prompt) + 12 and TOKENIZER.decode(ids[len(prompt):]) == choice["text"]
    reference = model_logprobs(model, ids)
    positions = range(len(prompt), len(ids))
    assert logprobs["token_logprobs"] == pytest.approx([reference[p - 1, ids[p]].item() for p in positions], abs=1e-4)
    for p, top in zip(positions, logprobs["top_logprobs"]):
        assert [token_id(t) for t in top] == expected_top(reference[p - 1], 3)  # the argmax first: greedy's token
        assert list(top.values()) == sorted(top.values(), reverse=True)
        assert list(top.values()) == pytest.approx(reference[p - 1, expected_top(reference[p - 1], 3)].tolist(), abs=1e-4)
        assert token_id(next(iter(top))) == ids[p]
    offsets = logprobs["text_offset"]
    assert offsets[0] == 0 and offsets == sorted(offsets) and offsets[-1] < len(choice["text"])


def test_echo_with_max_tokens_0_scores_the_prompt_as_lm_eval_reads_it(server, model):
    """lm-evaluation-harness's local-completions: token id prompts, echo, logprobs=1 and max_tokens 0 or 1."""
    url, _ = server
    prompts = [TOKENIZER.encode("The capital of France is Paris"), TOKENIZER.encode("é€a b")]
    reply = completion(url, prompt=prompts, max_tokens=0, echo=True, logprobs=1)
    assert reply["usage"] == {"prompt_tokens": sum(map(len, prompts)), "completion_tokens": 0,
                              "total_tokens": sum(map(len, prompts))}
    for prompt, choice in zip(prompts, reply["choices"]):
        logprobs = choice["logprobs"]
        assert choice["text"] == TOKENIZER.decode(prompt) and choice["finish_reason"] == "length"
        assert [token_id(t) for t in logprobs["tokens"]] == prompt
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None  # as OpenAI gives
        reference = model_logprobs(model, prompt)
        assert logprobs["token_logprobs"][1:] == pytest.approx(
            [reference[p - 1, prompt[p]].item() for p in range(1, len(prompt))], abs=1e-4)
        for p, top in enumerate(logprobs["top_logprobs"][1:], start=1):  # lm-eval's is_greedy reads the first
            assert token_id(max(top, key=top.get)) == expected_top(reference[p - 1], 1)[0]
            assert logprobs["tokens"][p] in top and len(top) <= 2
    é_euro = reply["choices"][1]["logprobs"]
    assert é_euro["tokens"][:3] == ["bytes:\\xc3", "bytes:\\xa9", "bytes:\\xe2"]
    assert é_euro["text_offset"] == [0, 0, 1, 1, 1, 2, 3, 4]  # a byte inside a character points at it
    # max_tokens=1, lm-eval's default: the same prompt logprobs, then the one sampled token's
    once = completion(url, prompt=prompts, max_tokens=1, echo=True, logprobs=1, ignore_eos=True)
    for scored, choice in zip(reply["choices"], once["choices"]):
        assert choice["logprobs"]["token_logprobs"][:-1] == pytest.approx(scored["logprobs"]["token_logprobs"])
        assert choice["text"].startswith(scored["text"]) and len(choice["logprobs"]["tokens"]) == len(
            scored["logprobs"]["tokens"]) + 1
    # the peer's own reader of that reply: each prompt's last token scored after the rest, and whether it is greedy
    harness = pytest.importorskip("lm_eval.models.openai_completions").LocalCompletionsAPI
    scores = harness.parse_logprobs(once, ctxlens=[len(prompt) - 1 for prompt in prompts])
    for prompt, (logprob, greedy) in zip(prompts, scores):
        reference = model_logprobs(model, prompt)[-2]
        assert logprob == pytest.approx(reference[prompt[-1]].item(), abs=1e-4)
        assert greedy == (expected_top(reference, 1)[0] == prompt[-1])


def test_chat_logprobs_with_the_openai_client(server, model):
    url, _ = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    messages = [{"role": "user", "content": "hi"}]
    plain = client.chat.completions.create(model=NAME, messages=messages, max_tokens=8, temperature=0)
    reply = client.chat.completions.create(model=NAME, messages=messages, max_tokens=8, temperature=0, logprobs=True,
                                           top_logprobs=3)
    assert reply.choices[0].message.content == plain.choices[0].message.content and plain.choices[0].logprobs is None
    content = reply.choices[0].logprobs.content
    prompt = TOKENIZER.encode(CHAT_TEMPLATES.build("plain").render([Turn("user", "hi")], add_generation_prompt=True))
    ids = prompt + [entry.bytes[0] for entry in content]  # one byte per token
    assert all(len(entry.bytes) == 1 for entry in content)
    reference = model_logprobs(model, ids)
    for p, entry in zip(range(len(prompt), len(ids)), content):
        assert entry.logprob == pytest.approx(reference[p - 1, ids[p]].item(), abs=1e-4)
        assert [t.bytes[0] for t in entry.top_logprobs] == expected_top(reference[p - 1], 3)
        assert entry.top_logprobs[0].token == entry.token  # greedy: the most likely
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
    assert bytes(ids[len(prompt):]).decode("utf-8", "replace").startswith(reply.choices[0].message.content)


def _joined(chunks: list[dict], lists: tuple[str, ...]) -> dict[int, dict]:
    """Each choice's streamed text and logprobs lists, concatenated chunk by chunk."""
    joined: dict[int, dict] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            into = joined.setdefault(choice["index"], {"text": "", **{name: [] for name in lists}})
            into["text"] += choice["text"] if "text" in choice else choice["delta"].get("content") or ""
            found = choice["logprobs"] or {}
            for name in lists:
                into[name] += found.get(name, [])
    return joined


def test_streamed_logprobs_concatenate_to_the_non_streamed(server):
    url, _ = server
    lists = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    fields = {"prompt": ["abc", "é€"], "max_tokens": 10, "echo": True, "logprobs": 2, "n": 2, "ignore_eos": True}
    whole = completion(url, **fields)["choices"]
    joined = _joined(streamed(url, **fields), lists)
    assert sorted(joined) == [0, 1, 2, 3]
    for i, choice in enumerate(whole):
        assert joined[i]["text"] == choice["text"]
        for name in ("tokens", "text_offset"):
            assert joined[i][name] == choice["logprobs"][name], name
        assert joined[i]["token_logprobs"] == pytest.approx(choice["logprobs"]["token_logprobs"], abs=1e-5)
        for got, expected in zip(joined[i]["top_logprobs"], choice["logprobs"]["top_logprobs"]):
            assert got == expected or (list(got) == list(expected) and got == pytest.approx(expected, abs=1e-5))

    fields = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10, "logprobs": True, "top_logprobs": 2}
    whole = completion(url, "/v1/chat/completions", **fields)["choices"][0]
    joined = _joined(streamed(url, "/v1/chat/completions", **fields), ("content",))[0]
    assert joined["text"] == whole["message"]["content"] and len(joined["content"]) == len(whole["logprobs"]["content"])
    for got, expected in zip(joined["content"], whole["logprobs"]["content"]):
        assert (got["token"], got["bytes"]) == (expected["token"], expected["bytes"])
        assert got["logprob"] == pytest.approx(expected["logprob"], abs=1e-5)
        assert [t["token"] for t in got["top_logprobs"]] == [t["token"] for t in expected["top_logprobs"]]


@pytest.mark.parametrize("fields, entry", [({"temperature": 0}, "greedy"), ({"top_p": 0.5}, "top_p"),
                                           ({"top_k": 3}, "top_k"), ({"min_p": 0.1}, "min_p"), ({}, "temperature")])
def test_a_request_selects_its_sampler_entrys_typed_config(fields, entry):
    request = CompletionRequest(model=NAME, prompt="x", logit_bias={str(i): -1 for i in range(300)}, **fields)
    config = request.sampler()
    assert type(config) is SAMPLERS.get(entry).config  # typed: the engine builds it without an OmegaConf pass
    sampler = SAMPLERS.build(config)
    assert type(sampler) is SAMPLERS.get(entry).target and sampler.logit_bias == {i: -1.0 for i in range(300)}


def test_logit_bias_forces_and_bans_a_token_on_both_endpoints(server):
    url, _ = server
    free = completion(url, prompt="abc", max_tokens=6, ignore_eos=True, logprobs=0)["choices"][0]
    first = token_id(free["logprobs"]["tokens"][0])
    forced = next(t for t in map(ord, "zy") if t != first)
    assert completion(url, prompt="abc", max_tokens=6, ignore_eos=True,
                      logit_bias={str(forced): 100})["choices"][0]["text"] == chr(forced) * 6
    banned = completion(url, prompt="abc", max_tokens=6, ignore_eos=True, logprobs=0, logit_bias={str(first): -100})
    assert first not in [token_id(t) for t in banned["choices"][0]["logprobs"]["tokens"]]
    chat = completion(url, "/v1/chat/completions", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                      logit_bias={str(forced): 100})
    assert chat["choices"][0]["message"]["content"] == chr(forced) * 4
