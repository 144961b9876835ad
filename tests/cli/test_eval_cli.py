"""`lmlab eval` on a checkpoint trained here: the chosen tasks run, results.json / results.md /
records land in the run folder; each bad input is one line before the model loads."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from lmlab.cli.compose import compose_config
from lmlab.cli.generate import open_model
from lmlab.cli.main import main
from tests.conftest import run_cli, train_tiny

FIXTURES = Path(__file__).parents[1] / "eval" / "fixtures"
TASKS = ["eval=[perplexity,mmlu,gsm8k]", f"eval.mmlu.path={FIXTURES / 'mmlu'}", "eval.mmlu.shots=1",
         f"eval.gsm8k.path={FIXTURES / 'gsm8k'}", "eval.gsm8k.shots=1", "eval.gsm8k.max_new_tokens=8", "eval.limit=2"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    return train_tiny(tmp_path_factory.mktemp("run"), 2)


def test_tasks_run_and_write_their_results_in_the_run_folder(ckpt, capsys):
    assert main(["eval", f"ckpt={ckpt}", *TASKS]) == 0
    err = capsys.readouterr().err
    assert "mmlu: acc" in err and "gsm8k: exact_match" in err and "perplexity: nll" in err
    folder = Path(err.strip().splitlines()[-1].rpartition("results in ")[2])
    assert folder.parent == Path(ckpt).parent.parent / "eval"  # <run>/eval/<date>_<time>
    results = json.loads((folder / "results.json").read_text())
    assert set(results["tasks"]) == {"perplexity", "mmlu", "gsm8k"}
    assert results["tasks"]["mmlu"]["examples"] == 4 and len(results["tasks"]["mmlu"]["table"]) == 2  # 2 per subject
    perplexity = results["tasks"]["perplexity"]
    assert 0 < perplexity["metrics"]["tokens"] == perplexity["examples"] and perplexity["unit"] == "tokens"
    assert results["meta"]["limit"] == 2
    markdown = (folder / "results.md").read_text()
    assert "| abstract_algebra |" in markdown and "| gsm8k | pass@1 |" in markdown
    records = [json.loads(line) for line in (folder / "records" / "gsm8k.jsonl").read_text().splitlines()]
    assert len(records) == 2 and {"question", "completions", "parsed", "correct", "reference"} <= set(records[0])


def test_task_fields_compose_apart():
    cfg = compose_config(["eval=[mmlu,gsm8k]", "eval.mmlu.shots=0", "eval.gsm8k.n=3", "eval.limit=5"],
                         config_name="eval")
    assert cfg.eval.mmlu.shots == 0 and cfg.eval.mmlu.name == "mmlu"
    assert cfg.eval.gsm8k.n == 3 and cfg.eval.gsm8k.shots == 5 and cfg.eval.limit == 5
    assert set(compose_config([], config_name="eval").eval) == {"limit", "perplexity"}  # the default task


@pytest.mark.parametrize("args, message", [
    (["eval=[mmlu,gsm8c]"], "Did you mean 'gsm8k'"),
    (["eval.limit=0"], "eval.limit must be > 0"),
    (["eval=mmlu"], "eval.mmlu.path"),
    (["eval=mmlu", "eval.mmlu.path=/no/such/folder"], "/no/such/folder"),
    (["eval=mmlu", f"eval.mmlu.path={FIXTURES / 'mmlu'}", "eval.mmlu.shots=7"], "has 5"),
    (["eval=[]"], "no task"),
    (["eval.mmlu.shots=1"], "eval.mmlu"),
    (["eval=gsm8k", f"eval.gsm8k.path={FIXTURES / 'gsm8k'}", "eval.gsm8k.shots=1", "eval.gsm8k.max_new_tokens=4096"],
     "leaves no room"),
])
def test_bad_input_is_one_line_before_the_model_loads(ckpt, capsys, monkeypatch, args, message):
    def without_weights(*args):
        source = open_model(*args)
        return dataclasses.replace(source, load=lambda: pytest.fail("the weights were loaded"))

    monkeypatch.setattr("lmlab.cli.eval.open_model", without_weights)
    assert main(["eval", f"ckpt={ckpt}", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("lmlab eval: error:") and message in err and "\n" not in err


def test_no_checkpoint(capsys):
    assert main(["eval"]) == 2
    assert "pass ckpt=PATH" in capsys.readouterr().err


@pytest.mark.slow
def test_lmlab_eval_console_script(ckpt, tmp_path):
    result = run_cli(["lmlab", "eval", f"ckpt={ckpt}", f"out={tmp_path / 'out'}", "eval.limit=50"], tmp_path)
    assert result.returncode == 0, result.stderr
    assert json.loads((tmp_path / "out" / "results.json").read_text())["tasks"]["perplexity"]["metrics"]["ppl"] > 1
