"""The TensorBoard logger of every zoo run: Lightning's, without the ``epoch`` scalar.

Lightning adds an ``epoch`` value to every logged step. TensorBoard's Time Series page sorts its cards by tag, so
``epoch`` (and Lightning's default ``lr-AdamW``) came first, above the validation metrics a comparison is read by.
The epoch is in the run's ``run.json`` and the step axis already orders every curve; the learning rate is logged
as ``train/lr`` (``tasks.base.ZooTask.configure_optimizers``).
"""

from __future__ import annotations

from collections.abc import Mapping

from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_only


class ZooTensorBoardLogger(TensorBoardLogger):
    """``TensorBoardLogger`` that drops the ``epoch`` scalar Lightning adds to every step."""

    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        super().log_metrics({k: v for k, v in metrics.items() if k != "epoch"}, step)
