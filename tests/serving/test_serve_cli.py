"""`lmlab serve` on a checkpoint trained here: the app it builds answers what `lmlab generate` prints,
under the run folder's name; bad command lines fail with one clear line before any model loads."""

import asyncio
from pathlib import Path

import httpx
import pytest

pytest.importorskip("fastapi")

import lmlab  # noqa: E402
from lmlab.cli.main import main  # noqa: E402
from lmlab.cli.serve import build_server, parse_config  # noqa: E402
from lmlab.errors import ConfigError  # noqa: E402
from lmlab.inference.engine import Engine  # noqa: E402
from tests.conftest import train_tiny  # noqa: E402


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    return train_tiny(tmp_path_factory.mktemp("run"), 3)


def test_the_server_answers_what_generate_prints(ckpt):
    app, name, summary = build_server(parse_config([f"ckpt={ckpt}", "scheduler.max_num_seqs=8", "block_size=8"]))
    assert name == Path(ckpt).parent.parent.name and f"model `{name}`" in summary  # the run folder
    model, tokenizer, _ = lmlab.load(ckpt)
    expected = Engine(model).generate([tokenizer.encode("def f(x):")], max_new_tokens=10,
                                      stop_token_ids=[tokenizer.eot_id], tokenizer=tokenizer).texts[0]

    async def ask():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://lmlab") as client:
            body = {"model": name, "prompt": "def f(x):", "max_tokens": 10, "temperature": 0}
            return (await client.post("/v1/completions", json=body)).json()

    try:
        assert asyncio.run(ask())["choices"][0]["text"] == expected
    finally:
        app.state.engine.stop()  # (uvicorn runs the app's lifespan, which stops it; this transport does not)


@pytest.mark.parametrize("args, message", [
    ([], "no model: pass ckpt=PATH"),
    (["ckpt=x", "port=0"], "port must be in 1..65535"),
    (["ckpt=x", "scheduler=round_robin"], "round_robin"),
    (["ckpt=x", "scheduler.max_num_seqs=0"], "max_num_seqs must be >= 1"),
    (["ckpt=x", "chat_template=vicuna"], "vicuna"),
    (["ckpt=x", "blocksize=8"], "blocksize"),
    (["ckpt=x", "num_blocks=1"], "num_blocks must be >= 2"),
    (["serve"], "unexpected argument 'serve'"),
])
def test_bad_command_lines_fail_before_loading(args, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(args)


def test_a_missing_checkpoint_is_one_clear_error(capsys):
    assert main(["serve", "ckpt=/missing.ckpt"]) == 2
    assert capsys.readouterr().err == "lmlab serve: error: ckpt=/missing.ckpt is not a file\n"


def test_a_chat_template_whose_markers_the_tokenizer_lacks_is_refused_at_start(ckpt, capsys):
    """The tiny run's tokenizer has no <|im_start|>: ChatML's markers would be read as plain text."""
    assert main(["serve", f"ckpt={ckpt}", "chat_template=chatml"]) == 2
    assert "needs the special tokens <|im_start|>, <|im_end|>" in capsys.readouterr().err


def test_cuda_graphs_on_a_cpu_is_refused(ckpt):
    with pytest.raises(ConfigError, match=r"cuda_graphs=true needs a CUDA device \(device=cpu is cpu\)"):
        build_server(parse_config([f"ckpt={ckpt}", "device=cpu", "cuda_graphs=true"]))
