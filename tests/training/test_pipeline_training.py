"""lmlab-train with `parallel=nd parallel.pp=2` in 2 gloo processes: each rank holds one pipeline stage, and the run
ends at the weights and validation loss of one process on the same global batches, with GPipe and 1F1B, with
interleaved 1F1B under gradient accumulation, and with dp=2 x pp=2 on 4 processes; its checkpoints hold whole
tensors (loadable by one process, `lmlab generate`), a resume with pp=2 ends exactly where the uninterrupted run
did, and runs continue across layouts. Bad plans fail before any process starts."""

import os

import pytest
import torch
from omegaconf import OmegaConf

import lmlab
from lmlab.cli.compose import compose_config
from lmlab.cli.main import main as lmlab_main
from lmlab.errors import ConfigError
from lmlab.parallel import run_processes
from lmlab.training.launch import _train_rank, launch
from tests.conftest import TINY
from tests.training.test_optim_training import scalars
from tests.training.test_parallel_training import STEPS, final_state

PP = ["parallel=nd", "parallel.pp=2", "trainer.devices=2"]
RUN = [*STEPS, "trainer.checkpoint_every=2", "trainer.grad_clip=0.05"]  # clips every step: by the whole model's norm
SCHEDULES = {"1f1b": [], "gpipe": ["parallel.pp_schedule=gpipe", "parallel.pp_microbatches=4"]}


def _assert_same_weights(got: dict, want: dict, exact: bool = False) -> None:
    assert got.keys() == want.keys()
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=0 if exact else 1e-4, atol=0 if exact else 1e-5, msg=key)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One process, and pp=2 on 2 with each schedule: the same 4 steps (checkpoints at steps 2 and 4)."""
    base = tmp_path_factory.mktemp("pp")
    common = [*TINY, f"cache_dir={base / 'cache'}", *RUN]
    results = {"single": launch(compose_config(common), base / "single")}
    for schedule, extra in SCHEDULES.items():
        results[schedule] = launch(compose_config([*common, *PP, *extra]), base / schedule)
    return base, common, results


def _checkpoint(run_dir, name: str) -> dict:
    return torch.load(run_dir / "checkpoints" / name, weights_only=False, map_location="cpu")


@pytest.mark.slow
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pipeline_run_matches_one_process_with_whole_checkpoints(runs, schedule):
    base, _, results = runs
    _assert_same_weights(final_state(base / schedule), final_state(base / "single"))
    for key in ("initial_val_loss", "val_loss", "train_loss"):  # validated and logged through the pipeline
        assert results[schedule][key] == pytest.approx(results["single"][key], rel=1e-5), key
    # whole optimizer state: one process's moments for every parameter, gathered from both stages
    want, got = (_checkpoint(base / run, "step000002.ckpt")["optimizer_states"][0]["state"]
                 for run in ("single", schedule))
    assert got.keys() == want.keys()
    for index, state in want.items():
        torch.testing.assert_close(got[index]["exp_avg"], state["exp_avg"], rtol=1e-4, atol=1e-7)


@pytest.mark.slow
def test_pipeline_checkpoint_loads_in_one_process_and_generates(runs, capsys):
    base, _, _ = runs
    ckpt = base / "1f1b" / "checkpoints" / "last.ckpt"
    model, _, _ = lmlab.load(ckpt)  # one process, the plain model
    assert model.lm_head.weight.shape == model.embed_tokens.weight.shape  # whole, from the last and first stages
    assert lmlab_main(["generate", f"ckpt={ckpt}", "prompt=def f(x):", "max_new_tokens=4"]) == 0
    assert capsys.readouterr().out.strip()


@pytest.mark.slow
def test_pipeline_run_resumes_exactly_and_across_layouts(runs):
    base, common, _ = runs
    middle = f"ckpt_path={base / '1f1b' / 'checkpoints' / 'step000002.ckpt'}"
    launch(compose_config([*common, *PP, middle]), base / "resumed")
    _assert_same_weights(final_state(base / "resumed"), final_state(base / "1f1b"), exact=True)
    launch(compose_config([*common, middle]), base / "resumed_single")  # whole tensors: one process continues
    _assert_same_weights(final_state(base / "resumed_single"), final_state(base / "1f1b"))
    # and pp=2 continues one process's run, each rank taking its stage's weights and moments
    launch(compose_config([*common, *PP, f"ckpt_path={base / 'single' / 'checkpoints' / 'step000002.ckpt'}"]),
           base / "resumed_from_single")
    _assert_same_weights(final_state(base / "resumed_from_single"), final_state(base / "single"))


@pytest.mark.slow
def test_interleaved_pipeline_with_accumulation_and_loss_terms_matches_one_process(runs):
    """4 layers as 4 stages, 2 per rank; 2 accumulated micro-steps; a z-loss, so the loss has terms to log."""
    base, common, _ = runs
    extra = [*common, "model.n_layers=4", "trainer.accumulate_grad_batches=2", "loss.z_loss=1e-3",
             "trainer.log_every=1"]
    launch(compose_config(extra), base / "single_acc")
    launch(compose_config([*extra, *PP, "parallel.pp_schedule=interleaved_1f1b", "parallel.pp_stages_per_rank=2"]),
           base / "interleaved")
    _assert_same_weights(final_state(base / "interleaved"), final_state(base / "single_acc"))
    for tag in ("train/loss", "train/ce", "train/z_loss"):
        want, got = scalars(base / "single_acc", tag), scalars(base / "interleaved", tag)
        assert got.keys() == want.keys() and len(got) == 4, tag
        assert list(got.values()) == pytest.approx(list(want.values()), rel=1e-5), tag


def _train_rank_on_few_cores(rank: int, world: int, container: dict, output_dir: str):
    os.cpu_count = lambda: world  # each rank checks trainer.devices against the cores; this machine may have fewer
    return _train_rank(rank, world, container, output_dir)


@pytest.mark.slow
def test_data_and_pipeline_parallel_on_four_processes_match_one(runs):
    """dp=2 replicas of a 2-stage pipeline: ranks 0, 2 and 1, 3 are the pipelines, each on half of every batch."""
    base, common, _ = runs
    cfg = compose_config([*common, "parallel=nd", "parallel.pp=2", "parallel.dp=2", "trainer.devices=4"])
    # launch's own checks ran in the tests above; the corpus and tokenizer are in the cache
    run_processes(_train_rank_on_few_cores, 4, args=(OmegaConf.to_container(cfg, resolve=True), str(base / "dp_pp")),
                  timeout=600)
    _assert_same_weights(final_state(base / "dp_pp"), final_state(base / "single"))


@pytest.mark.parametrize("extra,match", [
    (["parallel.pp=3"], r"parallel.dp=-1 x parallel.tp=1 x parallel.cp=1 x parallel.ep=1 x parallel.pp=3 must equal "
                        "the world size 2"),
    (["parallel.pp=0"], "parallel.pp=0 must be >= 1"),
    (["parallel.tp=2"], "parallel.pp=2 with parallel.tp=2, parallel.cp=1 and parallel.ep=1: pipeline parallelism does "
                        "not compose with tensor, context or expert parallelism"),
    (["parallel.cp=2"], "parallel.pp=2 with parallel.tp=1, parallel.cp=2"),
    (["parallel.ep=2", "model/moe=aux_free"], "parallel.pp=2 with parallel.tp=1, parallel.cp=1 and parallel.ep=2"),
    (["parallel.pp_schedule=zigzag"], "parallel.pp_schedule=zigzag is not one of gpipe, 1f1b, interleaved_1f1b"),
    (["parallel.pp_schedule=interleaved_1f1b"], "parallel.pp_stages_per_rank=1: interleaved schedules take 2 or more"),
    (["parallel.pp_stages_per_rank=2"], "parallel.pp_schedule=1f1b with parallel.pp_stages_per_rank=2"),
    (["parallel.pp_microbatches=1"], "parallel.pp_microbatches=1 for parallel.pp=2 leaves stages idle"),
    (["parallel.pp_microbatches=-1"], "parallel.pp_microbatches=-1 must be >= 0"),
    (["parallel.pp_microbatches=3"], r"data.batch_size=8 leaves each pipeline 8 rows per micro-step .* not divisible "
                                     "by parallel.pp_microbatches=3"),
    (["trainer.accumulate_grad_batches=8"], "leaves each pipeline 1 rows per micro-step .*accumulate_grad_batches=8"),
    (["parallel.pp_schedule=interleaved_1f1b", "parallel.pp_stages_per_rank=2"],
     "parallel.pp=2 x parallel.pp_stages_per_rank=2 = 4 stages: 4 pipeline stages for 2 layers"),
    (["model.tie_embeddings=true"], "model.tie_embeddings=true: the embedding and the head sit on the first and last"),
    (["model.mtp.depth=1"], "model.mtp.depth > 0: multi-token prediction modules are not staged"),
    (["model/moe=aux_free"], "MoE layers: their auxiliary losses do not travel between stages"),
    (["trainer.precision=16-mixed"], "trainer.precision=16-mixed with parallel.pp > 1"),
    (["trainer.grad_noise_scale=true", "trainer.accumulate_grad_batches=2"], "parallel=nd shards or reduces the gradients"),
    (["trainer.compile=true"], "does not work with parallel=nd"),
])
def test_bad_pipeline_plans_fail_before_any_process_starts(make_cfg, tiny_overrides, tmp_path, extra, match):
    with pytest.raises(ConfigError, match=match):
        launch(make_cfg([*tiny_overrides, *PP, *extra]), tmp_path / "run")
    assert not (tmp_path / "run").exists()
