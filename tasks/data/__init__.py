"""Data modules: generated tasks (ListOps, associative recall, majority) and local text (classification, MLM).

Every module follows the batch contract of :mod:`tasks.data.base`; nothing is downloaded at run time.
"""

from tasks.data.base import ZooDataModule
from tasks.data.listops import ListOpsDataModule
from tasks.data.majority import MajorityDataModule
from tasks.data.mlm import MaskedLMDataModule
from tasks.data.recall import AssociativeRecallDataModule
from tasks.data.text import TextClassificationDataModule

__all__ = [
    "AssociativeRecallDataModule",
    "ListOpsDataModule",
    "MajorityDataModule",
    "MaskedLMDataModule",
    "TextClassificationDataModule",
    "ZooDataModule",
]
