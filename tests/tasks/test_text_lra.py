"""LRA Text: the data blocks of ``configs/lra/{reference,lite}/text.yaml`` read an aclImdb folder as LRA does (UTF-8
bytes, each review's first ``max_seq_len`` bytes, neg = 0 and pos = 1), and a missing folder stops ``zoo fit`` with
one line saying where to put the reviews."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from experiments import cli
from tasks.data.text import TextClassificationDataModule
from tasks.data.tokenize import SPECIAL_TOKENS
from tests.files import write_files

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = {scale: ROOT / "configs" / "lra" / scale / "text.yaml" for scale in ("reference", "lite")}


def write_aclimdb(folder: Path, long_review: str) -> Path:
    """The aclImdb layout: ``<split>/<label>/<id>_<rating>.txt``, plus the unlabelled ``train/unsup``."""
    reviews = {
        "train/pos/0_9.txt": long_review,
        "train/pos/1_8.txt": "A warm, funny film. <br /><br />Loved it.",
        "train/neg/0_2.txt": "Dull and far too long.",
        "train/neg/1_1.txt": "The worst film of the year, honestly: avoid.",
        "train/unsup/0_0.txt": "Not rated.",
        "test/pos/0_10.txt": "Superb acting.",
        "test/neg/0_3.txt": "Boring plot.",
    }
    return write_files(folder, reviews)


def data_module(config: Path, data_dir: Path, cache: Path) -> TextClassificationDataModule:
    block = yaml.safe_load(config.read_text())["data"]
    assert block["class_path"] == "tasks.data.text.TextClassificationDataModule"
    options = block["init_args"] | {"data_dir": str(data_dir), "val_fraction": 0.0, "test_fraction": 0.0}
    return TextClassificationDataModule(**options, cache_dir=str(cache))


@pytest.mark.parametrize(("scale", "length"), [("reference", 1000), ("lite", 512)])
def test_the_lra_configs_read_aclimdb_as_bytes_cut_to_their_length(tmp_path, scale, length):
    review = "Épique! " * 250  # 2250 bytes in UTF-8: longer than both lengths, with two-byte characters
    folder = write_aclimdb(tmp_path / "aclImdb", review)
    dm = data_module(CONFIGS[scale], folder, tmp_path / "cache")
    assert dm.label_names == ["neg", "pos"] and dm.max_seq_len == length and dm.vocab_size == 260
    with pytest.warns(UserWarning, match=f"1 of 4 train texts are longer than max_seq_len={length} tokens"):
        train = dm.load_split("train")
    expected = list(review.encode("utf-8")[:length])  # LRA: the first max_length bytes, a character cut or not
    by_text = {tuple((train.sequence(i) - len(SPECIAL_TOKENS)).tolist()): int(train.labels[i]) for i in range(4)}
    assert by_text[tuple(expected)] == 1
    assert by_text[tuple(b"Dull and far too long.")] == 0
    assert sorted(by_text.values()) == [0, 0, 1, 1]  # train/unsup is not a class
    test = dm.load_split("test")
    assert sorted(int(label) for label in test.labels) == [0, 1]


def test_a_missing_aclimdb_folder_stops_zoo_fit_with_one_line_saying_where_to_put_it(tmp_path, capsys):
    args = ["fit", "-c", str(CONFIGS["lite"]), "--data.data_dir", str(tmp_path / "aclImdb")]
    assert cli.main([*args, "--trainer.logger.init_args.save_dir", str(tmp_path / "runs")]) == 2
    printed = capsys.readouterr().err
    assert printed.count("\n") == 1
    assert f"data_dir {str(tmp_path / 'aclImdb')!r} has no train/ folder: put the reviews there" in printed
    assert "https://ai.stanford.edu/~amaas/data/sentiment/" in printed
    assert not (tmp_path / "runs").exists()
