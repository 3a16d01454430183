"""Data modules: generated tasks (ListOps, associative recall, majority), local text (classification, MLM) and
translation pairs (installed gettext catalogs, local files, Hugging Face datasets, a synthetic pair).

Every module follows the batch contract of :mod:`tasks.data.base` (translation: its own source/target
contract, in :mod:`tasks.data.translation`); nothing is downloaded at run time.
"""

from tasks.data.base import ZooDataModule
from tasks.data.listops import ListOpsDataModule
from tasks.data.majority import MajorityDataModule
from tasks.data.mlm import MaskedLMDataModule
from tasks.data.recall import AssociativeRecallDataModule
from tasks.data.text import TextClassificationDataModule
from tasks.data.translation import TranslationDataModule

__all__ = [
    "AssociativeRecallDataModule",
    "ListOpsDataModule",
    "MajorityDataModule",
    "MaskedLMDataModule",
    "TextClassificationDataModule",
    "TranslationDataModule",
    "ZooDataModule",
]
