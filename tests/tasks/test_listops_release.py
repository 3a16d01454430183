"""ListOps from the LRA release's TSV files: fixtures written the way LRA's generator writes them (its
``to_string`` parenthesisation, a tab-separated ``csv.writer`` with the ``Source``/``Target`` header) read back
as the generator's own tokens; malformed rows and missing files are one-line errors naming the file and line."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch

from tasks.data.base import DataError
from tasks.data.listops import CLS_ID, OPERATORS, RELEASE_FILES, VOCAB, ListOpsDataModule, generate_listops

SETTINGS = dict(min_length=8, max_length=40, max_depth=4, max_args=4)


def lra_tree(symbols: list[str]):
    """The nested pairs LRA's ``generate_tree`` builds: ``((((op, a0), a1), ...), "]")``."""

    def node(position: int):
        symbol = symbols[position]
        if symbol not in OPERATORS:
            return int(symbol), position + 1
        first, position = node(position + 1)
        tree = (symbol, first)
        while symbols[position] != "]":
            argument, position = node(position)
            tree = (tree, argument)
        return (tree, "]"), position + 1

    tree, end = node(0)
    assert end == len(symbols)
    return tree


def lra_to_string(tree) -> str:
    """LRA's ``to_string``: every pair in parentheses."""
    if isinstance(tree, (str, int)):
        return str(tree)
    return "( " + lra_to_string(tree[0]) + " " + lra_to_string(tree[1]) + " )"


def write_release(folder: Path, rows: dict[str, list[list]]) -> Path:
    """The three files of the release, written as LRA's ``write_to_file`` does."""
    folder.mkdir(parents=True, exist_ok=True)
    for split, name in RELEASE_FILES.items():
        with open(folder / name, "w", newline="") as file:
            writer = csv.writer(file, delimiter="\t")
            writer.writerow(["Source", "Target"])
            writer.writerows(rows[split])
    return folder


@pytest.fixture
def expressions() -> tuple[list[list[int]], list[int]]:
    return generate_listops(12, **SETTINGS, seed=3)


def release_rows(expressions) -> dict[str, list[list]]:
    texts = [lra_to_string(lra_tree([VOCAB[t] for t in e])) for e in expressions[0]]
    rows = [[text, value] for text, value in zip(texts, expressions[1], strict=True)]
    return {"train": rows[:8], "val": rows[8:10], "test": rows[10:]}


def release(tmp_path: Path, **options) -> ListOpsDataModule:
    return ListOpsDataModule(data_dir=str(tmp_path / "listops-1000"), cache_dir=str(tmp_path / "cache"), **options)


def test_the_release_format_reads_as_the_generators_tokens_and_values(tmp_path, expressions):
    write_release(tmp_path / "listops-1000", release_rows(expressions))
    assert (tmp_path / "listops-1000" / "basic_train.tsv").read_bytes().startswith(b"Source\tTarget\r\n( ( ")
    dm = release(tmp_path, max_length=40)
    read = {split: dm.load_split(split) for split in ("train", "val", "test")}
    assert [len(read[s]) for s in ("train", "val", "test")] == [8, 2, 2]
    tokens = [read[s].sequence(i).tolist() for s in ("train", "val", "test") for i in range(len(read[s]))]
    labels = [int(read[s].labels[i]) for s in ("train", "val", "test") for i in range(len(read[s]))]
    assert tokens == expressions[0]
    assert labels == expressions[1]
    with_cls = release(tmp_path, max_length=40, prepend_cls=True).load_split("train")
    assert with_cls.sequence(0).tolist() == [CLS_ID, *expressions[0][0]]


def test_a_batch_of_the_release_follows_the_contract(tmp_path, expressions):
    write_release(tmp_path / "listops-1000", release_rows(expressions))
    dm = release(tmp_path, max_length=40, batch_size=4)
    dm.setup("fit")
    batch = next(iter(dm.val_dataloader()))
    lengths = [len(e) for e in expressions[0][8:10]]
    assert batch["tokens"].shape == (2, max(lengths))
    assert batch["mask"].sum(1).tolist() == lengths
    assert batch["labels"].tolist() == expressions[1][8:10]
    assert batch["labels"].dtype == torch.long


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("( ( [MAX 2 ) 9 ]", "1 tab-separated fields, expected 2 (Source, Target)"),
        ("( ( [MAX 2 ) 9 ]\t9\textra", "3 tab-separated fields"),
        ("( ( [MAX 2 ) X ]\t9", "unknown symbol 'X'"),
        ("( ( [MAX 2 ) 9 ]\t12", "the value must be a digit 0-9, got '12'"),
        ("\t3", "the expression is empty"),
        (" ".join(["[SM", *["1"] * 45, "]"]) + "\t5", "47 symbols, not shorter than max_length=40"),
    ],
)
def test_a_malformed_row_is_a_one_line_error_naming_file_and_line(tmp_path, expressions, line, message):
    rows = release_rows(expressions)
    folder = write_release(tmp_path / "listops-1000", rows)
    with open(folder / "basic_val.tsv", "a", newline="") as file:
        file.write(line + "\r\n")
    dm = release(tmp_path, max_length=40)
    with pytest.raises(DataError) as error:
        dm.load_split("val")
    text = str(error.value)
    assert text.startswith(f"{str(folder / 'basic_val.tsv')!r} line 4: ")  # header, two rows, then this one
    assert message in text
    assert "\n" not in text


def test_a_file_without_the_header_is_refused(tmp_path, expressions):
    folder = write_release(tmp_path / "listops-1000", release_rows(expressions))
    (folder / "basic_test.tsv").write_text("[MAX 1 2 ]\t2\n")
    with pytest.raises(DataError, match=r"basic_test.tsv' line 1: expected the header 'Source<TAB>Target'"):
        release(tmp_path, max_length=40).load_split("test")


def test_a_missing_folder_or_file_names_it_and_the_release(tmp_path, expressions):
    with pytest.raises(FileNotFoundError) as error:
        release(tmp_path)
    assert "has no basic_train.tsv: the LRA release lra_release.gz" in str(error.value)
    assert "lra_release/listops-1000/" in str(error.value) and "\n" not in str(error.value)
    folder = write_release(tmp_path / "listops-1000", release_rows(expressions))
    (folder / "basic_val.tsv").unlink()
    with pytest.raises(FileNotFoundError, match="has no basic_val.tsv"):
        release(tmp_path)


def test_generator_options_other_than_lras_are_warned_about_with_data_dir(tmp_path, expressions):
    write_release(tmp_path / "listops-1000", release_rows(expressions))
    with pytest.warns(UserWarning, match="the generator's min_length=100, train_size=50 has no use with data_dir"):
        release(tmp_path, min_length=100, train_size=50)


def test_the_cache_follows_the_files(tmp_path, expressions):
    rows = release_rows(expressions)
    folder = write_release(tmp_path / "listops-1000", rows)
    first = release(tmp_path, max_length=40).load_split("test")
    rows["test"] = rows["test"][:1]
    write_release(folder, rows)
    assert len(first) == 2 and len(release(tmp_path, max_length=40).load_split("test")) == 1
