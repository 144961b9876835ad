"""The lm-evaluation-harness bridge: lm-eval runs tasks defined in local YAML files over local JSONL
(tests/eval/fixtures/harness) on a checkpoint trained here, and gets what lmlab's Scorer computes on the
same requests; gen_kwargs choose the sampler and group the generations; bad model_args are one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.api.registry import get_model, model_registry  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from lmlab.cli.generate import open_model  # noqa: E402
from lmlab.cli.lm_eval import main as lm_eval_main  # noqa: E402
from lmlab.errors import ConfigError  # noqa: E402
from lmlab.eval import harness  # noqa: E402
from lmlab.eval.scoring import Scorer  # noqa: E402
from lmlab.inference.samplers import SAMPLERS  # noqa: E402
from tests.conftest import train_tiny  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures" / "harness"
TASKS = ["lmlab_choice", "lmlab_complete", "lmlab_sample", "lmlab_rolling"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    return train_tiny(tmp_path_factory.mktemp("run"), 2)


@pytest.fixture(scope="module")
def scorer(ckpt) -> Scorer:
    """lmlab's own Scorer on the checkpoint, independent of the bridge."""
    source = open_model(ckpt, "ckpt")
    return Scorer(source.load(), source.tokenizer, source.max_seq_len, source.stop_ids)


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """Nothing downloads: Hugging Face datasets offline, caching under tmp_path; the tasks' relative
    data_files resolve in the fixtures folder."""
    import datasets.config

    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf"))
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # read when datasets was imported
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf")
    monkeypatch.chdir(FIXTURES)


def _request(kind: str, *args) -> Instance:
    return Instance(request_type=kind, doc={}, arguments=args, idx=0)


def test_the_model_registers_beside_lm_evals_own():
    assert get_model("lmlab") is harness.LmlabLM
    assert "hf" in model_registry  # lm-eval fills its built-in models only into an empty registry


def test_lm_eval_runs_local_tasks_as_lmlabs_scorer_scores_them(ckpt, scorer, offline):
    out = lm_eval.simple_evaluate(model="lmlab", model_args=f"ckpt={ckpt},device=cpu,batch_tokens=64", tasks=TASKS,
                                  task_manager=TaskManager(include_path=str(FIXTURES), include_defaults=False),
                                  log_samples=True, bootstrap_iters=0)
    results, samples, tok = out["results"], out["samples"], scorer.tokenizer

    # multiple choice: log p(" choice" | prompt), the context and continuation ids split as lm-eval's HF model does
    correct, normalised = [], []
    for sample in samples["lmlab_choice"]:
        requests = []
        for context, continuation in sample["arguments"]:
            context_ids = tok.encode(context)
            requests.append((context_ids, tok.encode(context + continuation)[len(context_ids):]))
        expected = scorer.loglikelihoods(requests)
        got = [resp[0] for resp in sample["resps"]]
        assert [g[0] for g in got] == pytest.approx([e.logprob for e in expected], abs=1e-4)
        assert [g[1] for g in got] == [e.greedy for e in expected]
        lengths = [len(choice) for choice in sample["doc"]["choices"]]  # acc_norm: log p per character of the choice
        correct.append(max(range(4), key=lambda i: expected[i].logprob) == sample["target"])
        normalised.append(max(range(4), key=lambda i: expected[i].logprob / lengths[i]) == sample["target"])
    assert len(correct) == 6
    assert results["lmlab_choice"]["acc,none"] == pytest.approx(sum(correct) / 6)
    assert results["lmlab_choice"]["acc_norm,none"] == pytest.approx(sum(normalised) / 6)

    # rolling: the document after end-of-text; the long one (beyond the 32-token context) in windows
    for sample in samples["lmlab_rolling"]:
        ids = [tok.eot_id] + tok.encode(sample["arguments"][0][0])
        nll, _ = scorer.rolling_nll(ids, stride=scorer.max_len)
        assert sample["resps"][0][0] == pytest.approx(-nll, abs=1e-3)
        if len(ids) <= scorer.max_len:  # one window: a single forward of the whole document
            with torch.no_grad():
                logprobs = scorer.model(torch.tensor([ids])).float().log_softmax(-1)[0, :-1]
            assert -nll == pytest.approx(logprobs.gather(-1, torch.tensor(ids[1:])[:, None]).sum().item(), abs=1e-3)
    assert max(len(tok.encode(s["arguments"][0][0])) for s in samples["lmlab_rolling"]) > 2 * scorer.max_len

    # greedy generation: until "\n" or ".", at most 8 tokens
    prompts = [sample["arguments"][0][0] for sample in samples["lmlab_complete"]]
    expected = scorer.generate([tok.encode(p) for p in prompts], SAMPLERS.build("greedy"), 8, ["\n", "."])
    assert [sample["resps"][0][0] for sample in samples["lmlab_complete"]] == expected
    targets = [sample["target"] for sample in samples["lmlab_complete"]]
    assert results["lmlab_complete"]["exact_match,none"] == sum(map(str.__eq__, expected, targets)) / 3

    # sampled generation (top_k=5 at temperature 0.7): some text, cut before "\n"
    texts = [sample["resps"][0][0] for sample in samples["lmlab_sample"]]
    assert any(texts) and not any("\n" in t for t in texts)


@pytest.fixture(scope="module")
def lm(ckpt) -> harness.LmlabLM:
    return get_model("lmlab").create_from_arg_string(f"ckpt={ckpt}", {"device": "cpu", "batch_size": "auto"})


def test_a_contexts_trailing_space_moves_to_the_continuation_and_an_empty_one_is_end_of_text(lm):
    spaced, moved, empty = lm.loglikelihood([_request("loglikelihood", "The sky is ", "blue"),
                                             _request("loglikelihood", "The sky is", " blue"),
                                             _request("loglikelihood", "", "blue")])
    assert spaced == moved
    tok = lm.scorer.tokenizer
    assert empty[0] == pytest.approx(lm.scorer.loglikelihoods([([tok.eot_id], tok.encode("blue"))])[0].logprob)


def test_requests_with_equal_gen_kwargs_generate_together_and_return_in_order(lm, monkeypatch):
    calls = []

    def generate(prompts, sampler, max_new_tokens, stop_strings=(), batch_size=32, desc=""):
        calls.append((type(sampler).__name__, sampler.cfg, max_new_tokens, list(stop_strings), batch_size))
        return [f"{type(sampler).__name__} {lm.scorer.tokenizer.decode(p)}" for p in prompts]

    monkeypatch.setattr(lm.scorer, "generate", generate)
    greedy = {"until": ["\n\n", ""], "max_gen_toks": 5, "do_sample": False}
    sampled = {"until": "Q:", "do_sample": True, "temperature": 0.5, "top_p": 0.8}
    texts = lm.generate_until([_request("generate_until", "a", greedy), _request("generate_until", "bb", sampled),
                               _request("generate_until", "ccc", dict(greedy))])
    assert texts == ["Greedy a", "TopP bb", "Greedy ccc"]
    assert [c[0] for c in calls] == ["Greedy", "TopP"]
    assert calls[0][2:] == (5, ["\n\n"], 64)  # "" stops nothing; batch_size auto: 64
    assert calls[1][1].p == 0.8 and calls[1][1].temperature == 0.5 and calls[1][2:4] == (harness.MAX_GEN_TOKS, ["Q:"])


@pytest.mark.parametrize("gen_kwargs, expected", [
    ({"do_sample": False, "temperature": 0.0}, {"name": "greedy", "temperature": 0.0}),
    ({"do_sample": True, "temperature": 0.7}, {"name": "temperature", "temperature": 0.7}),
    ({"do_sample": True, "temperature": 1.0, "top_k": 4, "repetition_penalty": 1.2},
     {"name": "top_k", "top_k": 4, "temperature": 1.0, "repetition_penalty": 1.2}),
    ({"do_sample": True, "min_p": 0.1}, {"name": "min_p", "min_p": 0.1}),
])
def test_gen_kwargs_choose_the_sampler(gen_kwargs, expected):
    assert harness.sampler_config(gen_kwargs) == expected
    SAMPLERS.build(expected)  # a config the registry takes


@pytest.mark.parametrize("gen_kwargs, match", [
    ({"do_sample": True, "num_beams": 4}, "gen_kwargs num_beams are not supported"),
    ({"do_sample": True, "top_k": 4, "top_p": 0.9}, "set top_k and top_p"),
])
def test_gen_kwargs_lmlab_cannot_honour_fail(gen_kwargs, match):
    with pytest.raises(ConfigError, match=match):
        harness.sampler_config(gen_kwargs)


@pytest.mark.parametrize("args, match", [
    ("device=cpu", "needs model_args ckpt=PATH"),
    ("ckpt={ckpt},batch_tokens=0", "batch_tokens must be > 0"),
    ("ckpt={ckpt},stride=33", r"stride must be in 1\.\.32"),
    ("ckpt={ckpt},batch_size=many", "batch_size=many must be a positive number or auto"),
    ("ckpt={ckpt},dtype=float8", "dtype"),
    ("ckpt=no/such.ckpt", "no/such.ckpt"),
])
def test_bad_model_args_are_one_line(ckpt, args, match):
    with pytest.raises(ConfigError, match=match):
        get_model("lmlab").create_from_arg_string(args.format(ckpt=ckpt))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the fallback is for machines without CUDA")
@pytest.mark.parametrize("device", ["cuda:0", "cuda", "auto", "cpu"])
def test_lm_evals_default_cuda_device_falls_back_to_the_cpu(device):
    assert harness.resolve_device(device, "auto") == (torch.device("cpu"), torch.float32)


@pytest.mark.slow  # lm-eval's CLI indexes its thousands of built-in task files first (about 12 s)
def test_lmlab_lm_eval_runs_lm_evals_command_line_with_the_model(ckpt, scorer, offline, tmp_path, capsys):
    assert lm_eval_main(["--model", "lmlab", "--model_args", f"ckpt={ckpt},batch_tokens=64", "--device", "cpu",
                         "--tasks", "lmlab_choice", "--include_path", str(FIXTURES),
                         "--output_path", str(tmp_path / "out"), "--log_samples"]) == 0
    assert "lmlab_choice" in capsys.readouterr().out  # lm-eval's results table
    (results_file,) = (tmp_path / "out").rglob("results_*.json")
    (samples_file,) = (tmp_path / "out").rglob("samples_lmlab_choice_*.jsonl")
    sample = json.loads(samples_file.read_text().splitlines()[0])
    context, continuation = sample["arguments"]["gen_args_0"]["arg_0"], sample["arguments"]["gen_args_0"]["arg_1"]
    ids = scorer.tokenizer.encode(context)
    expected = scorer.loglikelihoods([(ids, scorer.tokenizer.encode(context + continuation)[len(ids):])])[0]
    assert float(sample["resps"][0][0][0]) == pytest.approx(expected.logprob, abs=1e-4)
    assert json.loads(results_file.read_text())["results"]["lmlab_choice"]["acc,none"] is not None


def test_lmlab_lm_eval_without_lm_eval_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(ConfigError, match=r"pip install 'lmlab\[eval\]'"):
        lm_eval_main(["--tasks", "x"])
