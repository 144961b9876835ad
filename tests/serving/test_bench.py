"""`lmlab bench serve` on the CPU: a tiny random model under a tiny load, both schedulers, the rows the JSON
holds, prefix sharing's saving, and the errors a bad command line gets before any run."""

import json

import pytest

from lmlab.errors import ConfigError
from lmlab.serving.bench import main

MODEL = ["model=tiny", "model.vocab_size=256", "model.max_seq_len=128", "--device", "cpu", "--block-size", "8"]
FIELDS = {"scheduler", "prefix_caching", "rate", "requests", "completed", "requests_per_s", "output_tokens_per_s",
          "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "kv_blocks_peak", "kv_blocks_mean", "preemptions"}


def test_both_schedulers_at_two_rates(tmp_path):
    out = tmp_path / "serve.json"
    assert main([*MODEL, "--requests", "6", "--rates", "50", "inf", "--prompt-mean", "12", "--output-mean", "6",
                 "--max-num-seqs", "4", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [(r["scheduler"], r["rate"]) for r in rows] == [("continuous", 50), ("continuous", "inf"),
                                                           ("static", 50), ("static", "inf")]
    for row in rows:
        assert FIELDS <= set(row)
        assert row["completed"] == row["requests"] == 6
        assert row["requests_per_s"] > 0 and 0 < row["ttft_p50_s"] <= row["ttft_p99_s"]
        assert 0 < row["kv_blocks_peak"] <= row["kv_blocks_total"]
    assert set(result["headline"]["rate_within_slo"]) == {"continuous", "static"}


def test_a_shared_prefix_takes_fewer_blocks_with_prefix_caching(tmp_path):
    out = tmp_path / "prefix.json"
    # Requests that arrive after the first one's prompt was read find its 8 prefix blocks and share them.
    assert main([*MODEL, "--requests", "6", "--rates", "40", "--shared-prefix", "64", "--prompt-mean", "8",
                 "--output-mean", "24", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    on, off = sorted(result["rows"], key=lambda r: not r["prefix_caching"])
    assert on["prefix_caching"] and not off["prefix_caching"]
    assert on["completed"] == off["completed"] == 6
    assert on["kv_blocks_peak"] < off["kv_blocks_peak"] and on["prefix_cache_hit_rate"] > 0
    assert result["prefix_sharing"][0]["kv_peak_reduction"] > 0


@pytest.mark.parametrize("line, error", [
    ('{"prompt_len": 8}', "each line is"),
    ('{"prompt_ids": [1, "a"], "output_len": 4}', "prompt_len must be an integer >= 1, prompt_ids a non-empty list"),
])
def test_a_bad_prompts_line_is_named(tmp_path, line, error):
    path = tmp_path / "requests.jsonl"
    path.write_text('{"prompt_len": 8, "output_len": 4}\n' + line + "\n")
    with pytest.raises(ConfigError, match=f"requests.jsonl:2: {error}"):
        main([*MODEL, "--prompts", str(path)])


def test_bad_flags_fail_before_any_run(capsys):
    with pytest.raises(SystemExit):
        main([*MODEL, "--rates", "4", "0"])
    assert "--rates must be > 0" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="leaves no room in the model's context of 128"):
        main([*MODEL, "--shared-prefix", "126"])
