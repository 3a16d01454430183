"""What ``zoo fit | test`` print and where ``zoo validate | test --ckpt_path <run's checkpoint>`` log: into the
fit's own folder (``<run>/<stage>/``), with no new ``version_<n>`` and no warning from Lightning; and a fit's
progress bar without a nonsensical epoch total, ``v_num``, Lightning's tip or torch's LeafSpec deprecation."""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from experiments import cli

from .test_cli_fit import tiny_args

pytestmark = pytest.mark.usefixtures("one_thread_and_private_cache")


def fit_args(runs: Path, tmp_path: Path) -> list[str]:
    return tiny_args("recall", runs, tmp_path / "unused.csv")


def test_progress_bar_has_no_epoch_total_v_num_tip_or_deprecation(tmp_path, recwarn, capfd):
    runs = tmp_path / "runs"
    args = fit_args(runs, tmp_path)
    args[args.index("--trainer.enable_progress_bar") + 1] = "true"
    with warnings.catch_warnings():
        warnings.simplefilter("always")  # a warning already shown in this process would otherwise be hidden
        assert cli.main(["fit", *args]) == 0
    out = "".join(capfd.readouterr())
    # pytest records warnings instead of printing them: the deprecation is looked for in both
    assert not [w for w in recwarn if "LeafSpec" in str(w.message)]
    assert "Epoch 0" in out and "train/loss" in out  # the bar was shown
    assert not re.search(r"Epoch 0/-?\d", out)  # max_epochs is -1 (bounded by steps): no total
    assert "v_num" not in out
    assert "Tip:" not in out and "litlogger" not in out
    assert "LeafSpec" not in out


@pytest.mark.parametrize("stage", ["validate", "test"])
def test_evaluating_a_fits_checkpoint_logs_into_its_folder_without_a_warning(stage, tmp_path, recwarn, capfd):
    runs = tmp_path / "runs"
    args = fit_args(runs, tmp_path)
    assert cli.main(["fit", *args]) == 0
    run = runs / "recall" / "full" / "version_0"
    config_before = (run / "config.yaml").read_bytes()
    capfd.readouterr()
    recwarn.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        assert cli.main([stage, *args, "--ckpt_path", str(run / "checkpoints" / "last.ckpt")]) == 0
        caught = [str(w.message) for w in recwarn]
    out = "".join(capfd.readouterr())
    assert sorted(p.name for p in run.parent.iterdir()) == ["version_0"]  # no version_1
    assert not any("dirpath has changed" in message for message in caught), caught
    assert "dirpath has changed" not in out
    assert (run / "config.yaml").read_bytes() == config_before  # the fit's config stays the fit's
    logged = run / stage
    assert list(logged.glob("events.out.tfevents.*")) and (logged / "config.yaml").exists()
    if stage == "test":
        events = EventAccumulator(str(logged))
        events.Reload()
        assert {"test/loss", "test/acc"} <= set(events.Tags()["scalars"])
        metrics = json.loads((run / "run.json").read_text())["metrics"]
        assert {"test/loss", "test/acc", "val/loss"} <= set(metrics)  # added to the fit's record
        assert not (logged / "run.json").exists()  # one record per run
