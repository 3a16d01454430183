"""Data modules: generated tasks (ListOps, Pathfinder, associative recall, majority), images (CIFAR-10, the MNIST
stand-in), local text (classification, MLM, LRA's document pairs) and translation pairs (installed gettext
catalogs, local files, Hugging Face datasets, a synthetic pair).

Every module follows the batch contract of :mod:`tasks.data.base` (translation: its own source/target contract, in
:mod:`tasks.data.translation`; document pairs: its pair form, in :mod:`tasks.data.retrieval`); nothing is
downloaded at run time.
"""

from tasks.data.base import ZooDataModule
from tasks.data.image import ImageDataModule
from tasks.data.listops import ListOpsDataModule
from tasks.data.majority import MajorityDataModule
from tasks.data.mlm import MaskedLMDataModule
from tasks.data.pathfinder import PathfinderDataModule
from tasks.data.recall import AssociativeRecallDataModule
from tasks.data.retrieval import RetrievalDataModule
from tasks.data.text import TextClassificationDataModule
from tasks.data.translation import TranslationDataModule

__all__ = [
    "AssociativeRecallDataModule",
    "ImageDataModule",
    "ListOpsDataModule",
    "MajorityDataModule",
    "MaskedLMDataModule",
    "PathfinderDataModule",
    "RetrievalDataModule",
    "TextClassificationDataModule",
    "TranslationDataModule",
    "ZooDataModule",
]
