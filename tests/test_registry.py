from dataclasses import dataclass

import pytest
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from lmlab import registry as reg
from lmlab.nn import NORMS, RMSNorm
from lmlab.registry import Registry, RegistryError


@pytest.fixture
def widgets():
    r = Registry("widget_test", group="test/widget", doc="test widgets")
    yield r
    del reg.REGISTRIES["widget_test"]


def test_register_stores_config_in_config_store(widgets):
    @widgets.register("round")
    class Round:
        """A round widget."""

        @dataclass
        class Config:
            radius: float = 1.0

        def __init__(self, size, cfg):
            self.size, self.cfg = size, cfg

    node = ConfigStore.instance().repo["test"]["widget"]["round.yaml"].node
    assert node.name == "round" and node.radius == 1.0
    built = widgets.build({"name": "round", "radius": 2.5}, 3)
    assert isinstance(built, Round) and built.size == 3 and built.cfg.radius == 2.5
    assert widgets.get("round").doc == "A round widget."


def test_build_from_name_dictconfig_and_instance():
    from_name = NORMS.build("rmsnorm", 8)
    assert isinstance(from_name, RMSNorm) and from_name.eps == 1e-6
    from_dictconfig = NORMS.build(OmegaConf.create({"name": "rmsnorm", "eps": 1e-3}), 8)
    assert from_dictconfig.eps == 1e-3
    from_instance = NORMS.build(RMSNorm.Config(eps=1e-2), 8)
    assert from_instance.eps == 1e-2


def test_unknown_name_names_group_choices_and_closest():
    with pytest.raises(RegistryError) as err:
        NORMS.get("rmsnrom")
    msg = str(err.value)
    assert "model/norm" in msg and "Did you mean 'rmsnorm'?" in msg and "layernorm" in msg


def test_a_field_without_default_left_unset_is_one_line_naming_its_key(widgets):
    @widgets.register("keyed")
    class Keyed:
        @dataclass
        class Config:
            path: str = MISSING
            size: int = 1

        def __init__(self, cfg):
            self.cfg = cfg

    with pytest.raises(RegistryError, match=r"^test/widget=keyed needs test\.widget\.path: set test\.widget\.path=\.\.\.$"):
        widgets.build({"name": "keyed", "size": 2})
    assert widgets.build({"name": "keyed", "path": "x"}).cfg.path == "x"


def test_wrong_field_type_is_rejected():
    with pytest.raises(Exception, match="eps"):
        NORMS.build({"name": "rmsnorm", "eps": "not-a-number"}, 8)


def test_config_must_be_a_dataclass_without_name_field(widgets):
    with pytest.raises(RegistryError, match="dataclass"):
        @widgets.register("bad")
        class Bad:
            Config = dict

    with pytest.raises(RegistryError, match="reserved"):
        @widgets.register("named")
        class Named:
            @dataclass
            class Config:
                name: str = "x"


def test_duplicate_name_is_rejected(widgets):
    widgets.register("a")(lambda cfg: 1)
    with pytest.raises(RegistryError, match="registered already"):
        widgets.register("a")(lambda cfg: 2)


def test_missing_plugin_module_is_a_clear_error():
    with pytest.raises(RegistryError, match="plugin module 'no_such_plugin_mod' was not found"):
        reg.load_plugins(["no_such_plugin_mod"])


def test_entry_point_plugins_are_loaded(monkeypatch, tmp_path):
    (tmp_path / "ep_plugin_mod.py").write_text(
        "from dataclasses import dataclass\n"
        "from lmlab.nn import NORMS\n"
        "@NORMS.register('ep_norm')\n"
        "class EpNorm:\n"
        "    '''From an entry point.'''\n"
        "    def __init__(self, dim, cfg): self.dim = dim\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))

    class FakeEntryPoint:
        value = "ep_plugin_mod"

        def load(self):
            import importlib
            return importlib.import_module("ep_plugin_mod")

    monkeypatch.setattr(reg, "entry_points", lambda group: [FakeEntryPoint()] if group == reg.ENTRY_POINT_GROUP else [])
    assert reg.load_plugins() == ["ep_plugin_mod"]
    assert NORMS.build("ep_norm", 4).dim == 4
    NORMS._entries.pop("ep_norm")


def test_a_config_instance_builds_its_own_entry_when_configs_subclass_each_other():
    registry = Registry("shapes_sub", group="test/shapes_sub", doc="test")

    @registry.register("base")
    class Base:
        @dataclass
        class Config:
            size: int = 1

        def __init__(self, cfg):
            self.cfg = cfg

    @registry.register("derived")
    class Derived(Base):
        @dataclass
        class Config(Base.Config):
            extra: int = 2

    assert type(registry.build(Derived.Config())) is Derived
    assert type(registry.build(Base.Config())) is Base
