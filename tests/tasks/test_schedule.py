"""The learning-rate schedules after warm-up, read off the optimizer step by step in a real fit: ``linear`` (the
Nystromformer authors' LRA schedule) falls on a straight line to 0 at the last step, unlike ``cosine``."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

from tasks.token_prediction import TokenPrediction
from tests.tasks.test_tasks import SIZES, BatchesData, quiet_trainer, token_batch


def learning_rates(tmp_path, schedule: str, steps: int = 12, warmup: int = 4) -> list[float]:
    model = TokenPrediction(num_classes=11, lr=1e-2, warmup_steps=warmup, schedule=schedule, **SIZES)
    data = BatchesData([token_batch(torch.Generator().manual_seed(5))] * steps, "token", 11)
    seen: list[float] = []

    class Record(pl.Callback):
        def on_train_batch_start(self, trainer, *args):
            seen.append(trainer.optimizers[0].param_groups[0]["lr"])

    quiet_trainer(tmp_path, max_steps=steps, limit_val_batches=0, callbacks=[Record()]).fit(model, datamodule=data)
    return seen


def test_linear_schedule_warms_up_then_falls_linearly_to_zero(tmp_path):
    rates = learning_rates(tmp_path, "linear")
    assert rates[:4] == pytest.approx([2.5e-3, 5e-3, 7.5e-3, 1e-2])
    # after warm-up: 1e-2 * (1 - (s - 4) / 8) at steps 4..11, equal steps down, reaching 0 at step 12 (the last)
    assert rates[4:] == pytest.approx([1e-2 * (1 - (s - 4) / 8) for s in range(4, 12)])
    drops = [a - b for a, b in zip(rates[4:], rates[5:], strict=False)]
    assert drops == pytest.approx([1.25e-3] * 7)


def test_linear_and_cosine_differ_after_warm_up(tmp_path):
    linear, cosine = learning_rates(tmp_path, "linear"), learning_rates(tmp_path, "cosine")
    assert linear[:5] == pytest.approx(cosine[:5])  # the same warm-up and peak
    assert linear[6] < cosine[6]  # cosine stays near the peak longer
