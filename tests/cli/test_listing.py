"""`lmlab list`: config sections beside the registries, every field with its type, default and comment."""

import dataclasses
import re
from dataclasses import dataclass, field

from lmlab.cli.main import main
from lmlab.cli.schema import field_comments
from lmlab.training.config import TrainerConfig


def test_field_comments_are_read_from_the_dataclass_source():
    @dataclass
    class Base:
        a: int = 1  # the a
        b: str = "x"  # base b

    @dataclass
    class Child(Base):
        # a comment of its own, about no field
        b: str = "y"  # child b
        c: list[int] = field(
            default_factory=list,
        )  # a field over several lines
        d: int = 0

        # documented above its line: read when the line has no comment,
        # the lines joined
        e: bool = False
        # parted from f by a blank line: not f's

        f: int = 1

        def method(self):
            d: int = 2  # a local variable, not the field
            return d

    assert field_comments(Child) == {"a": "the a", "b": "child b", "c": "a field over several lines",
                                     "e": "documented above its line: read when the line has no comment, the lines "
                                          "joined"}


def test_list_trainer_shows_every_field_with_type_default_and_comment(capsys):
    assert main(["list", "trainer"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("trainer  (the training loop: trainer.FIELD=VALUE)")
    for f in dataclasses.fields(TrainerConfig):
        assert f"\n  {f.name}: " in out
    assert re.search(r"\n  max_steps: int = 300 +optimizer steps\n", out)


def test_list_top_and_model_show_their_plain_fields_and_name_the_rest(capsys):
    assert main(["list", "top"]) == 0 and main(["list", "model"]) == 0
    top, model = capsys.readouterr().out.split("\nmodel  (")
    assert re.search(r"\n  ckpt_path: str \| None = None +resume from this checkpoint", top)
    assert "\n  seed: int = 0" in top and "\n  trainer:" not in top and "\n  optim:" not in top
    assert "\n  d_model: int = 128" in model and "\n  mtp.depth: int = 0 " in model and "\n  norm:" not in model
    assert "model/norm" in model and "model/attention" in model


def test_list_data_shows_the_shared_fields_then_the_sources_with_their_comments(capsys):
    assert main(["list", "data"]) == 0
    section, sources = capsys.readouterr().out.split("\n\n")
    assert section.startswith("data  (what every data source has") and "context_length: int = 128" in section
    assert sources.startswith("data  (config group 'data'")
    assert re.search(r"path: str = 'roneneldan/TinyStories' +hub id, local folder", sources)


def test_an_unknown_name_gets_the_closest_section_or_group(capsys):
    assert main(["list", "trainr"]) == 2
    assert "Did you mean 'trainer'?" in capsys.readouterr().err


def test_list_everything_shows_each_section_and_group_once(capsys):
    assert main(["list"]) == 0
    headings = [block.splitlines()[0] for block in capsys.readouterr().out.split("\n\n")]
    assert len(headings) == len(set(headings))
    assert sum(h.startswith("data  (") for h in headings) == 2  # the shared fields, then the sources


def test_list_pipeline_and_experiment_show_the_conf_folders_lmlab_train_lists_as_groups(capsys):
    """Hydra's help lists every folder of conf/ as a group (the verbs share it), pipeline and experiment included."""
    assert main(["list", "pipeline"]) == 0
    pipeline = capsys.readouterr().out
    assert pipeline.startswith("pipeline  (a data pipeline of `lmlab data run`")
    assert re.search(r"\n  stages: list\[Any\] = \[\] +entries of `lmlab list filter`", pipeline)
    assert "\n  presets in conf/pipeline/ (pipeline=NAME):\n    text  Text that is already extracted" in pipeline
    assert re.search(r"\n    web +Web pages as Common Crawl serves them", pipeline)
    assert main(["list", "experiment"]) == 0
    experiment = capsys.readouterr().out
    assert re.search(r"\n    architecture_ablations  Norms x FFNs x positions", experiment)
    assert "@package" not in experiment
    assert main(["list", "model"]) == 0
    assert re.search(r"\n    tiny +~1.1M parameters", capsys.readouterr().out)  # a section's presets too
