"""`lmlab generate` on a checkpoint trained here: the engine's output, prompt files, samplers, speculative
decoding, quantization, a Hugging Face folder, and one clear line for each bad input."""

import io
import json
import re

import pytest
import torch

import lmlab
from lmlab.cli.generate import StreamPrinter, parse_config
from lmlab.cli.main import main
from lmlab.inference.engine import Engine
from lmlab.inference.generate import GenerationError
from lmlab.inference.quant import quantize
from lmlab.inference.samplers import SAMPLERS
from lmlab.tokenizers import EOT, ByteTokenizer
from lmlab.tokenizers.base import pack_tokenizer
from lmlab.tokenizers.hf_files import save_hf_tokenizer
from lmlab.training.checkpoints import TOKENIZER_KEY
from tests.conftest import run_cli, train_tiny

PROMPT = "def f(x):"
PROMPTS = ["def f(x):", "class A, B:", "import os\n"]
NEW = 12


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    """A 3-step run with one MTP module (unused in plain decoding, the drafter of draft=mtp)."""
    return train_tiny(tmp_path_factory.mktemp("run"), 3, "model.mtp.depth=1")


@pytest.fixture(scope="module")
def loaded(ckpt):
    model, tokenizer, _ = lmlab.load(ckpt)
    return model, tokenizer


def generate(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["generate", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def engine_texts(loaded, prompts: list[str], sampler="greedy", model=None) -> list[str]:
    base, tokenizer = loaded
    out = Engine(model or base).generate([tokenizer.encode(p) for p in prompts], SAMPLERS.build(sampler), NEW,
                                         stop_token_ids=[tokenizer.eot_id], tokenizer=tokenizer)
    return out.texts


def test_greedy_output_is_the_engines(ckpt, loaded, capsys):
    code, out, err = generate(capsys, f"ckpt={ckpt}", f"prompt={PROMPT}", f"max_new_tokens={NEW}")
    assert code == 0 and out == engine_texts(loaded, [PROMPT])[0] + "\n"
    assert re.fullmatch(r"lmlab generate: \d+ new tokens, TTFT [\d.,]+ ms, prefill [\d,]+ tokens/s, [\d.,]+ ms/token, "
                        r"decode [\d,]+ tokens/s, KV cache [\d.,]+ MiB\n", err)


def test_a_generation_that_stopped_at_its_first_token_reports_no_decode_speed():
    from lmlab.cli.generate import stats_line
    from lmlab.inference.generate import Generation, GenerationStats

    stats = GenerationStats(batch=1, prompt_tokens=5, new_tokens=1, steps=0, ttft_s=0.01, decode_s=0.0,
                            kv_cache_bytes=2**20)
    line = stats_line(Generation(tokens=[[7]], texts=["x"], finish_reasons=["stop"], stats=stats))
    assert line == "lmlab generate: 1 new token, TTFT 10.0 ms, prefill 500 tokens/s, no decode step, KV cache 1.00 MiB"


def test_prompt_file_prints_a_json_line_per_prompt(ckpt, loaded, capsys, tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": p, "id": i}) for i, p in enumerate(PROMPTS)) + "\n\n")
    code, out, err = generate(capsys, f"ckpt={ckpt}", f"prompt_file={path}", f"max_new_tokens={NEW}", "batch_size=2")
    rows = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and [r["prompt"] for r in rows] == PROMPTS
    assert [r["completion"] for r in rows] == engine_texts(loaded, PROMPTS)
    assert {r["finish_reason"] for r in rows} <= {"stop", "length"} and err.count("TTFT") == 2  # two batches


@pytest.mark.parametrize("overrides,sampler", [
    (["sampler=top_p", "sampler.p=0.9", "sampler.temperature=0.8", "sampler.seed=3"],
     {"name": "top_p", "p": 0.9, "temperature": 0.8, "seed": 3}),
    (["sampler=top_k", "sampler.top_k=5", "sampler.seed=1", "sampler.repetition_penalty=1.3"],
     {"name": "top_k", "top_k": 5, "seed": 1, "repetition_penalty": 1.3}),
    (["sampler=top_k", "sampler.top_k=5", "sampler.seed=1", "+sampler.logit_bias.97=4"],
     {"name": "top_k", "top_k": 5, "seed": 1, "logit_bias": {97: 4.0}}),
])
def test_sampler_overrides_reach_the_sampler(ckpt, loaded, capsys, overrides, sampler):
    code, out, _ = generate(capsys, f"ckpt={ckpt}", f"prompt={PROMPT}", f"max_new_tokens={NEW}", *overrides)
    assert code == 0 and out == engine_texts(loaded, [PROMPT], sampler)[0] + "\n"


def test_a_stop_string_ends_the_text_before_it(ckpt, loaded, capsys):
    free = engine_texts(loaded, [PROMPT])[0]
    stop = re.search(r"[A-Za-z0-9]+", free[1:]).group()  # a word of the text, quotable in Hydra
    code, out, _ = generate(capsys, f"ckpt={ckpt}", f"prompt={PROMPT}", f"max_new_tokens={NEW}", f"stop=['{stop}']")
    assert code == 0 and out == free[:free.index(stop, 1)] + "\n"


@pytest.mark.parametrize("draft", ["ckpt", "mtp"])
def test_speculative_greedy_output_is_the_targets(ckpt, loaded, capsys, draft):
    code, out, err = generate(capsys, f"ckpt={ckpt}", f"prompt={PROMPT}", f"max_new_tokens={NEW}",
                              f"draft={ckpt if draft == 'ckpt' else 'mtp'}")
    assert code == 0 and out == engine_texts(loaded, [PROMPT])[0] + "\n"
    assert re.search(r"draft acceptance \d+%$", err.strip())


@pytest.mark.parametrize("overrides", [["quant=int8"], ["quant=int4", "quant.group_size=32"]])  # int4: GPTQ
def test_a_quantized_model_generates_what_the_engine_does(ckpt, loaded, capsys, overrides):
    code, out, err = generate(capsys, f"ckpt={ckpt}", f"prompt={PROMPT}", f"max_new_tokens={NEW}", *overrides)
    assert code == 0 and "quantized" in err
    if overrides == ["quant=int8"]:  # round to nearest: no calibration, so the same weights here
        model, _, _ = lmlab.load(ckpt)
        quantize(model, "int8")
        assert out == engine_texts(loaded, [PROMPT], model=model)[0] + "\n"


def test_calibration_file_is_read(ckpt, capsys, tmp_path):
    (tmp_path / "calib.txt").write_text("def g(y):\n    return y + 1\n" * 20)
    code, _, err = generate(capsys, f"ckpt={ckpt}", f"prompt={PROMPT}", "max_new_tokens=4", "quant=int4",
                            "quant.group_size=32", f"calibration_file={tmp_path / 'calib.txt'}")
    assert code == 0 and "(int4, gptq)" in err


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    """A random tiny LlamaForCausalLM saved by transformers, with a byte tokenizer's GPT-2 files."""
    transformers = pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("hf")
    tokenizer = ByteTokenizer(ByteTokenizer.Config(special_tokens=[EOT]))
    config = transformers.LlamaConfig(vocab_size=260, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                                      eos_token_id=tokenizer.eot_id, bos_token_id=None)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).eval()
    hf.save_pretrained(folder)
    save_hf_tokenizer(tokenizer, folder, model_max_length=64)
    return folder, hf, tokenizer


def test_a_hugging_face_llama_folder_generates_what_transformers_does(hf_folder, capsys):
    folder, hf, tokenizer = hf_folder
    code, out, _ = generate(capsys, f"ckpt={folder}", "prompt=héllo", f"max_new_tokens={NEW}")
    prompt = torch.tensor([tokenizer.encode("héllo")])
    ids = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW, do_sample=False,
                      pad_token_id=0)[0, prompt.shape[1]:].tolist()
    expected = tokenizer.decode(ids[:ids.index(tokenizer.eot_id)] if tokenizer.eot_id in ids else ids)
    assert code == 0 and out == expected + "\n"


def foreign_tokenizer_checkpoint(ckpt: str, path) -> str:
    checkpoint = torch.load(ckpt, weights_only=False)
    checkpoint[TOKENIZER_KEY] = pack_tokenizer(ByteTokenizer(ByteTokenizer.Config(special_tokens=[EOT])))
    torch.save(checkpoint, path)
    return str(path)


BAD = {  # case -> (extra arguments, the error)
    "missing ckpt": (["ckpt=/missing.ckpt", "prompt=a"], "ckpt=/missing.ckpt is not a file"),
    "not a checkpoint": (["ckpt={tmp}/notes.txt", "prompt=a"], r"notes.txt cannot be read as a checkpoint"),
    "no prompt": (["ckpt={ckpt}"], "pass one of prompt=TEXT or prompt_file=PATH$"),
    "both prompts": (["ckpt={ckpt}", "prompt=a", "prompt_file=p.jsonl"],
                     "prompt=TEXT or prompt_file=PATH, not both"),
    "empty prompt": (["ckpt={ckpt}", "prompt="], "prompt is empty"),
    "prompt too long": (["ckpt={ckpt}", "prompt=" + "word " * 40, "max_new_tokens=8"],
                        r"a prompt of \d+ tokens plus max_new_tokens=8 exceeds the model's context of 32 tokens;"
                        r".* truncate=true"),
    "unknown sampler": (["ckpt={ckpt}", "prompt=a", "sampler=top_pp"], "sampler' 'top_pp'. Did you mean 'top_p'?"),
    "unknown quant": (["ckpt={ckpt}", "prompt=a", "quant=int9"], "quant' 'int9'. Did you mean 'int8'?"),
    "max_new_tokens 0": (["ckpt={ckpt}", "prompt=a", "max_new_tokens=0"], "max_new_tokens must be > 0, got 0"),
    "top-p above 1": (["ckpt={ckpt}", "prompt=a", "sampler=top_p", "sampler.p=1.5"],
                      r"sampler.p=1.5 must be in \(0, 1\]"),
    "top-p 0": (["ckpt={ckpt}", "prompt=a", "sampler=top_p", "sampler.p=0"], r"sampler.p=0.0 must be in \(0, 1\]"),
    "negative temperature": (["ckpt={ckpt}", "prompt=a", "sampler.temperature=-1"],
                             "sampler.temperature=-1.0 is negative"),
    "draft tokenizer": (["ckpt={ckpt}", "prompt=a", "draft={foreign}", "max_new_tokens=8"],
                        r"the draft's tokenizer .* differs"),
    "draft vocabulary": (["ckpt={ckpt}", "prompt=a", "draft={hf}", "max_new_tokens=8"],
                         "the draft model's vocabulary has 260 ids but the target's has 320"),
    "gptq without text": (["ckpt={hf}", "prompt=a", "quant=int4", "max_new_tokens=8"],
                          "names no training data: pass calibration_file="),
    "unknown key": (["ckpt={ckpt}", "prompt=a", "max_new_token=3"], "Did you mean 'max_new_tokens'"),
    "stray argument": (["ckpt={ckpt}", "hello"], "unexpected argument 'hello'"),
    "bad prompt file": (["ckpt={ckpt}", "prompt_file={tmp}/notes.txt"], "line 1 is not JSON"),
    "run folder": (["ckpt={run}", "prompt=a"], r"is a folder without config.json.*did you mean ckpt=.*last.ckpt\?"),
    "unknown device": (["ckpt={ckpt}", "prompt=a", "device=gpu"], "unknown device 'gpu'"),
    "megakernel on cpu": (["ckpt={ckpt}", "prompt=a", "device=cpu", "megakernel=true"],
                          r"megakernel=true needs a CUDA device \(device=cpu is cpu\)"),
    "megakernel on another quant kernel": (["ckpt={ckpt}", "prompt=a", "quant=int4", "quant.kernel=int4pack_mm",
                                            "megakernel=true"],
                                           "megakernel=true reads the codes as quant.kernel=dequant stores them"),
    "folded norms on cpu": (["ckpt={ckpt}", "prompt=a", "device=cpu", "folded_norms=true"],
                            r"folded_norms=true needs a CUDA device \(device=cpu is cpu\)"),
    "folded norms quantized": (["ckpt={ckpt}", "prompt=a", "quant=int8", "folded_norms=true"],
                               "folded_norms=true reads unquantized weights"),
    "batch-invariant on cpu": (["ckpt={ckpt}", "prompt=a", "device=cpu", "batch_invariant=true"],
                               r"batch_invariant=true needs a CUDA device \(device=cpu is cpu\)"),
    "head kernel on cpu": (["ckpt={ckpt}", "prompt=a", "device=cpu", "head_kernel=true"],
                           r"head_kernel=true needs a CUDA device \(device=cpu is cpu\)"),
    "cuda graphs on cpu": (["ckpt={ckpt}", "prompt=a", "device=cpu", "cuda_graphs=true"],
                           r"cuda_graphs=true needs a CUDA device \(device=cpu is cpu\)"),
    "batch-invariant compiled": (["ckpt={ckpt}", "prompt=a", "batch_invariant=true", "compile=true"],
                                 "batch_invariant=true runs its own kernels in eager steps"),
    "logit bias past the tokenizer": (["ckpt={ckpt}", "prompt=a", "max_new_tokens=8", "+sampler.logit_bias.5000=5"],
                                      r"sampler.logit_bias holds token id 5000, outside the tokenizer's vocabulary"),
    "logit bias without +": (["ckpt={ckpt}", "prompt=a", "sampler.logit_bias.3=5"], r"add 'sampler.logit_bias.3' with \+"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_input_is_one_line_before_any_weights_load(case, ckpt, hf_folder, tmp_path, capsys, monkeypatch):
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    foreign = foreign_tokenizer_checkpoint(ckpt, tmp_path / "foreign.ckpt") if case == "draft tokenizer" else ""
    paths = {"ckpt": ckpt, "tmp": tmp_path, "hf": hf_folder[0], "run": str(ckpt).rpartition("/checkpoints")[0],
             "foreign": foreign}
    monkeypatch.setattr("lmlab.cli.generate.load", lambda *a, **k: pytest.fail("the weights were loaded"))
    monkeypatch.setattr("lmlab.cli.generate.from_hf_llama", lambda *a, **k: pytest.fail("the weights were loaded"))
    args, message = BAD[case]
    code, out, err = generate(capsys, *(a.format(**paths) for a in args))
    assert code == 2 and out == ""
    assert err.startswith("lmlab generate: error: ") and err.count("\n") == 1 and re.search(message, err), err


def test_stop_escapes_and_a_verbatim_prompt():
    cfg = parse_config(["ckpt=m.ckpt", "prompt=f(a, b) = {'x': [1]}", 'stop=["\\n\\n", "a\\tb"]'])
    assert cfg.prompt == "f(a, b) = {'x': [1]}" and cfg.stop == ["\n\n", "a\tb"]


def test_streaming_prints_whole_characters_and_holds_back_stop_strings():
    tokenizer = ByteTokenizer(ByteTokenizer.Config(special_tokens=[EOT]))
    text = "é🙂 ab\n\ncd"
    out = io.StringIO()
    printer = StreamPrinter(tokenizer, [tokenizer.eot_id], ["\n\n"], out)
    shown = []
    for token in tokenizer.encode(text):
        printer([token])
        shown.append(out.getvalue())
    assert "\ufffd" not in "".join(shown) and shown[0] == "" and shown[1] == "é"
    assert "é🙂" in shown and out.getvalue() == "é🙂 ab"  # the newline waited: it began "\n\n"


@pytest.mark.parametrize("stop,status,err", [
    (GenerationError("the logits turned non-finite"), 1, "lmlab generate: error: the logits turned non-finite\n"),
    (KeyboardInterrupt(), 130, "\n"),
])
def test_a_stopped_generation_is_one_line_and_its_exit_status(ckpt, capsys, monkeypatch, stop, status, err):
    def stopped(*args, **kwargs):
        raise stop

    monkeypatch.setattr(Engine, "generate", stopped)
    assert generate(capsys, f"ckpt={ckpt}", f"prompt={PROMPT}", "max_new_tokens=4") == (status, "", err)


def test_help(capsys):
    code, out, _ = generate(capsys, "--help")
    assert code == 0 and "lmlab generate ckpt=PATH prompt=TEXT" in out and "max_new_tokens: int = 128" in out


@pytest.mark.slow
def test_lmlab_generate_console_script(ckpt, loaded, tmp_path):
    proc = run_cli(["lmlab", "generate", f"ckpt={ckpt}", f"prompt={PROMPT}", f"max_new_tokens={NEW}"], cwd=tmp_path)
    assert proc.returncode == 0 and proc.stdout == engine_texts(loaded, [PROMPT])[0] + "\n"
    assert proc.stderr.startswith("lmlab generate: ") and proc.stderr.count("\n") == 1, proc.stderr[-2000:]
