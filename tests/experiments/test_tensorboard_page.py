"""TensorBoard opens a compare experiment on the comparison: the Custom Scalars layout ``zoo compare`` writes
is what TensorBoard serves, and (where Chromium is installed) the pages render with every run on them."""

from __future__ import annotations

import pytest
from torch.utils.tensorboard import SummaryWriter

from experiments.compare.tensorboard_layout import layout, write_layout
from tools import tensorboard_screenshot as shot


@pytest.fixture
def experiment(tmp_path):
    """A small experiment folder: two mechanisms x two seeds with val/acc curves, and the layout."""
    root = tmp_path / "exp"
    for mechanism, base in (("full", 0.9), ("local", 0.5)):
        for seed in (0, 1):
            writer = SummaryWriter(str(root / mechanism / f"seed-{seed}"))
            for step in range(5):
                writer.add_scalar("val/acc", base * step / 4 + 0.01 * seed, step)
                writer.add_scalar("train/tokens_per_s", 1000.0 * (2 if mechanism == "local" else 1), step)
            writer.close()
    write_layout(root, ["val/acc"])
    return root


@pytest.mark.slow
def test_tensorboard_serves_the_compare_layout(experiment):
    port = shot.free_port()
    server = shot.start_tensorboard(experiment, port)
    try:
        served = shot.served_layout(port)
    finally:
        server.terminate()
        server.wait(10)
    charts = {chart["title"]: chart["multiline"]["tag"] for chart in served["category"][0]["chart"]}
    expected = layout(["val/acc"])["zoo compare"]
    assert served["category"][0]["title"] == "zoo compare"
    assert charts == {title: tags for title, (_, tags) in expected.items()}


@pytest.mark.slow
@pytest.mark.skipif(shot.find_chromium() is None, reason="needs chromium (Debian: apt-get install chromium)")
def test_the_pages_render_in_a_real_browser(experiment, tmp_path):
    from PIL import Image

    shots = shot.capture(experiment, tmp_path / "shots")
    for name, path in shots.items():
        image = Image.open(path).convert("L")
        assert image.size == (1400, 1000), name
        colours = len(set(image.resize((140, 100)).getdata()))
        assert colours > 20, f"{name} looks blank ({colours} grey levels)"
