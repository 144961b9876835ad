"""The checked composition: every key and group on the command line is in lmlab's typed schema, and
every mistake is one line naming the key, the closest match and what there is."""

import importlib

import pytest
from hydra import compose
from hydra.core.hydra_config import HydraConfig

from lmlab.cli import compose as compose_module
from lmlab.cli.compose import check_jobs, compose_config
from lmlab.cli.train import check_job
from lmlab.errors import ConfigError


@pytest.mark.parametrize("override", ["+model/nrom=layernorm", "model/nrom=layernorm"])
def test_an_unknown_group_is_refused_with_the_closest_group(override):
    with pytest.raises(ConfigError, match=r"^unknown config group 'model/nrom'. Did you mean 'model/norm'\?"):
        compose_config([override])


@pytest.mark.parametrize("override", ["+trainer.foo=1", "++trainer.foo=1", "trainer.foo=1"])
def test_a_key_outside_the_schema_is_refused_even_when_added(override):
    with pytest.raises(ConfigError, match=r"^unknown key 'trainer.foo' \(trainer has: [a-z_, ]*max_steps"):
        compose_config([override])


def test_a_misspelt_field_gets_the_closest_field_and_the_entrys_fields():
    with pytest.raises(ConfigError) as err:
        compose_config(["optim.lrr=1e-3"])
    assert str(err.value) == ("unknown key 'optim.lrr'. Did you mean 'optim.lr'? "
                              "(optim=adamw has: lr, betas, eps, weight_decay, stochastic_rounding, state_dtype, "
                              "groups)")
    with pytest.raises(ConfigError, match=r"^unknown key 'model.mtp.dept'. Did you mean 'model.mtp.depth'\?"):
        compose_config(["model.mtp.dept=1"])
    with pytest.raises(ConfigError, match=r"'model.moe' has no typed fields; choose an entry first with model/moe="):
        compose_config(["+model.moe.k=2"])


@pytest.mark.parametrize("override, message", [
    ("trainer.max_steps=abc", "wrong type for 'trainer.max_steps': got 'abc', expected int"),
    ("model.norm.eps=small", "wrong type for 'model.norm.eps': got 'small', expected float"),
])
def test_a_value_of_the_wrong_type_names_key_value_and_type(override, message):
    with pytest.raises(ConfigError) as err:
        compose_config([override])
    assert str(err.value) == message


def test_schema_keys_and_hydra_keys_may_still_be_added():
    assert compose_config(["++trainer.max_steps=7"]).trainer.max_steps == 7
    assert compose_config(["model/moe=topk", "++model.moe.k=1"]).model.moe.k == 1
    check_jobs(["+hydra.job.env_set.LMLAB_TEST=1"])
    check_jobs(["-sc", "install=bash"])  # Hydra's shell completion: install=bash is no override


def test_every_job_of_a_sweep_is_checked_before_any_runs():
    with pytest.raises(ConfigError, match="wrong type for 'trainer.max_steps': got 'abc'"):
        check_jobs(["-m", "trainer.max_steps=10,abc"])
    with pytest.raises(ConfigError, match="Ambiguous value .* add --multirun"):  # a sweep without -m
        check_jobs(["trainer.max_steps=10,abc"])


def test_a_sweep_includes_the_sweeper_params_an_experiment_sets(monkeypatch):
    composed = []

    def spy(config_name, overrides, **kwargs):
        composed.append(overrides)
        return compose(config_name, overrides=overrides, **kwargs)

    monkeypatch.setattr(compose_module, "compose", spy)
    # architecture_ablations sweeps norms x FFNs x positions; the command line fixes the first two
    check_jobs(["-m", "experiment=architecture_ablations", "model/norm=layernorm", "model/ffn=gelu"])
    positions = [o for job in composed[1:] for o in job if o.startswith("model/position=")]
    assert positions == ["model/position=rope", "model/position=alibi", "model/position=learned"]


def _refuse_seed_1(cfg):
    if cfg.seed == 1:
        raise ConfigError("seed 1 is refused")


def test_a_sweeps_jobs_are_checked_only_where_they_run_here():
    with pytest.raises(ConfigError, match=r"^job #1 \(seed=1\): seed 1 is refused$"):
        check_jobs(["-m", "seed=0,1"], check_job=_refuse_seed_1)
    check_jobs(["seed=1"], check_job=_refuse_seed_1)  # a single run checks itself as it starts
    # A launcher that sends the jobs elsewhere (SLURM): this machine's GPUs and cores say nothing about them.
    check_jobs(["-m", "seed=0,1", "hydra.launcher._target_=elsewhere.Launcher"], check_job=_refuse_seed_1)


def test_a_dict_fields_keys_are_added_with_a_plus_and_the_message_says_so():
    importlib.import_module("lmlab.cli.generate")  # its config schema

    cfg = compose_config(["ckpt=x", "+sampler.logit_bias.268=-100"], config_name="generate")
    assert dict(cfg.sampler.logit_bias) == {"268": -100.0}
    for override in ("sampler.logit_bias.268=-100", "sampler.logit_bias={268:-100}"):
        with pytest.raises(ConfigError, match=r"^'sampler.logit_bias' is a dict whose keys are yours to name: add "
                                              r"'sampler.logit_bias.268' with \+sampler.logit_bias.268=VALUE"):
            compose_config(["ckpt=x", override], config_name="generate")


def test_a_sweep_past_the_check_limit_says_how_many_jobs_were_checked(monkeypatch, capsys):
    monkeypatch.setattr(compose_module, "SWEEP_CHECK_LIMIT", 2)
    checked = []
    check_jobs(["-m", "seed=0,1,2"], check_job=lambda cfg: checked.append(cfg.seed))
    assert checked == [0, 1]
    assert "checked the first 2 of the sweep's 3 jobs before starting" in capsys.readouterr().err
    check_jobs(["-m", "seed=0,1"], check_job=lambda cfg: None)
    assert capsys.readouterr().err == ""


def test_a_job_with_an_interpolation_only_its_run_resolves_is_checked_when_it_starts(monkeypatch):
    monkeypatch.setattr(HydraConfig.instance(), "cfg", None)  # as before Hydra's app runs (an earlier test set it)
    check_jobs(["-m", "seed=0,1", "trainer.log_every=${hydra:job.num}"], check_job=check_job)
    with pytest.raises(ConfigError, match=r"^job #0 \(seed=0\): trainer.cuda_graphs replays"):
        check_jobs(["-m", "seed=0,1", "trainer.cuda_graphs=true"], check_job=check_job)
