import pytest

from lmlab.optim.plot import plot_schedule
from lmlab.optim.schedules import WSDConfig


@pytest.mark.parametrize("cfg", ["cosine", {"name": "wsd", "warmup_steps": 10, "decay_start": 60}, WSDConfig()])
def test_plot_schedule_writes_a_png(tmp_path, cfg):
    path = plot_schedule(cfg, 3e-3, 100, tmp_path / "lr.png")
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 1000
