"""LRA Retrieval: the AAN pair files in the release's format (no header, ``label, id1, id2, text1, text2``, texts
as Python bytes literals) read into pair batches, truncated and labelled; the two-tower model's features and
symmetry; ``zoo fit`` end to end on a tiny release; a missing release is a one-line refusal."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from experiments import cli
from tasks.data.base import DataError
from tasks.data.retrieval import RELEASE_FILES, RetrievalDataModule
from tasks.data.tokenize import PAD_ID, SPECIAL_TOKENS
from tasks.retrieval import DocumentMatching, interaction_features

ROOT = Path(__file__).resolve().parents[2]
LITE = ROOT / "configs" / "lra" / "lite" / "retrieval.yaml"
WORDS = ["attention", "parsing", "corpus", "lexicon", "tagger", "alignment", "grammar", "treebank"]


def paper(number: int, words: int) -> bytes:
    return f"paper {number}: ".encode() + " ".join(WORDS[(number + i) % len(WORDS)] for i in range(words)).encode()


def release_line(label: str, first: int, second: int, words: int = 6) -> bytes:
    """One row as the release has it: the texts written as Python bytes literals (``b'...'``)."""
    texts = [repr(paper(n, words) + b"\n").encode() for n in (first, second)]  # an escaped newline, as in the release
    return b"\t".join([label.encode(), f"P{first:02d}".encode(), f"P{second:02d}".encode(), *texts]) + b"\n"


def write_release(folder: Path, pairs: int = 12, extra: dict[str, bytes] | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for offset, (split, name) in enumerate(RELEASE_FILES.items()):
        lines = [release_line("1" if i % 2 else "0", offset + i, offset + i + 3) for i in range(pairs)]
        (folder / name).write_bytes(b"".join(lines) + (extra or {}).get(split, b""))
    return folder


def module(folder: Path, tmp_path: Path, **options) -> RetrievalDataModule:
    return RetrievalDataModule(data_dir=str(folder), cache_dir=str(tmp_path / "cache"), **options)


def test_pairs_become_batches_of_two_documents_with_their_labels(tmp_path):
    folder = write_release(tmp_path / "tsv_data")
    dm = module(folder, tmp_path, max_length=200, batch_size=4)
    dm.setup("fit")
    batch = next(iter(dm.val_dataloader()))
    text = [repr(paper(1 + i, 6) + b"\n").encode() for i in (0, 3)]  # val's first pair: papers 1 and 4
    longest = max(len(repr(paper(n, 6) + b"\n")) for i in range(4) for n in (1 + i, 4 + i))
    assert batch["tokens"].shape == batch["mask"].shape == (4, 2, longest)
    assert batch["labels"].tolist() == [0, 1, 0, 1]
    for doc in (0, 1):
        length = int(batch["mask"][0, doc].sum())
        assert bytes((batch["tokens"][0, doc, :length] - len(SPECIAL_TOKENS)).tolist()) == text[doc]
        assert (batch["tokens"][0, doc, length:] == PAD_ID).all() and not batch["mask"][0, doc, length:].any()
    assert (dm.vocab_size, dm.max_seq_len, dm.num_classes, dm.pad_id, dm.target) == (260, 200, 2, PAD_ID, "pair")


def test_each_document_is_cut_to_its_first_max_length_bytes_with_a_warning(tmp_path):
    long_row = release_line("1.0", 50, 51, words=40)  # LRA reads the label as a float: 1.0 is 1
    folder = write_release(tmp_path / "tsv_data", extra={"test": long_row})
    dm = module(folder, tmp_path, max_length=80)  # the short documents have fewer bytes
    with pytest.warns(UserWarning, match="2 of 26 test documents are longer than max_length=80 bytes"):
        data = dm.load_split("test")
    first = repr(paper(50, 40) + b"\n").encode()[:80]
    assert (data.sequence(24) - len(SPECIAL_TOKENS)).tolist() == list(first)
    assert int(data.labels[24]) == int(data.labels[25]) == 1
    assert data.lengths().tolist()[24:] == [80, 80] and max(data.lengths().tolist()[:24]) < 80


def test_size_options_keep_a_seeded_subsample_of_whole_pairs(tmp_path):
    folder = write_release(tmp_path / "tsv_data")
    full = module(folder, tmp_path, max_length=200).load_split("train")
    pairs = {(tuple(full.sequence(2 * i).tolist()), tuple(full.sequence(2 * i + 1).tolist())) for i in range(12)}
    small = module(folder, tmp_path, max_length=200, train_size=5).load_split("train")
    kept = [(tuple(small.sequence(2 * i).tolist()), tuple(small.sequence(2 * i + 1).tolist())) for i in range(5)]
    assert len(small) == 10 and set(kept) <= pairs and len(set(kept)) == 5
    again = module(folder, tmp_path / "other", max_length=200, train_size=5).load_split("train")
    assert torch.equal(again.tokens, small.tokens)


@pytest.mark.parametrize(
    ("row", "message"),
    [
        (b"1\tP1\tP2\tb'only one text'\n", "4 tab-separated fields, expected 5 (label, id1, id2, text1, text2)"),
        (b"2\tP1\tP2\tb'a'\tb'b'\n", "the label must be 0 or 1, got '2'"),
        (b"yes\tP1\tP2\tb'a'\tb'b'\n", "the label must be 0 or 1, got 'yes'"),
        (b"0\tP1\tP2\tb'a'\t\n", "text2 is empty"),
    ],
)
def test_a_malformed_row_is_a_one_line_error_naming_file_and_line(tmp_path, row, message):
    folder = write_release(tmp_path / "tsv_data", pairs=3, extra={"val": row})
    with pytest.raises(DataError) as error:
        module(folder, tmp_path).load_split("val")
    assert str(error.value) == f"{str(folder / 'new_aan_pairs.eval.tsv')!r} line 4: {message}"


def test_a_missing_folder_or_file_is_refused_naming_it_and_the_release(tmp_path, capsys):
    with pytest.raises(FileNotFoundError) as error:
        module(tmp_path / "nowhere", tmp_path)
    assert str(error.value) == (
        f"Retrieval data_dir {str(tmp_path / 'nowhere')!r} has no new_aan_pairs.train.tsv: the LRA release "
        "lra_release.gz (github.com/google-research/long-range-arena) has it in lra_release/tsv_data/"
    )
    folder = write_release(tmp_path / "tsv_data")
    (folder / "new_aan_pairs.test.tsv").unlink()
    with pytest.raises(FileNotFoundError, match="has no new_aan_pairs.test.tsv"):
        module(folder, tmp_path)
    args = ["fit", "-c", str(LITE), "--data.data_dir", str(tmp_path / "nowhere")]
    assert cli.main([*args, "--trainer.logger.init_args.save_dir", str(tmp_path / "runs")]) == 2
    printed = capsys.readouterr().err
    assert printed.count("\n") == 1 and "has no new_aan_pairs.train.tsv" in printed and "tsv_data/" in printed
    assert not (tmp_path / "runs").exists()


# ---- the two-tower model ----------------------------------------------------------------------------------
def tiny_model(**options) -> DocumentMatching:
    torch.manual_seed(0)
    settings = dict(vocab_size=260, max_seq_len=32, num_classes=2, dim=16, depth=1, heads=2, ff_mult=2)
    return DocumentMatching(**(settings | options)).eval()


def test_the_features_are_u_v_their_product_and_difference_and_swap_as_they_should():
    u, v = torch.randn(3, 5), torch.randn(3, 5)
    features, swapped = interaction_features(u, v), interaction_features(v, u)
    assert features.shape == (3, 20)
    assert torch.equal(features[:, :10], torch.cat([u, v], -1)) and torch.equal(swapped[:, :10], torch.cat([v, u], -1))
    assert torch.equal(features[:, 10:15], u * v) and torch.equal(swapped[:, 10:15], features[:, 10:15])
    assert torch.equal(swapped[:, 15:], -features[:, 15:])  # u - v flips sign: the head sees the order


def test_both_documents_go_through_the_same_encoder_alone_and_padding_is_excluded():
    model = tiny_model()
    tokens = torch.randint(4, 260, (2, 2, 12))
    mask = torch.ones(2, 2, 12, dtype=torch.bool)
    mask[0, 1, 7:] = False  # the second document of the first pair has 7 bytes
    tokens[0, 1, 7:] = PAD_ID
    with torch.no_grad():
        u, v = model.encode_pairs(tokens, mask)
        u_swapped, v_swapped = model.encode_pairs(tokens.flip(1), mask.flip(1))
        torch.testing.assert_close((u_swapped, v_swapped), (v, u))  # one encoder for both towers
        alone = model.encode_pairs(tokens[:1, :, :7].contiguous(), mask[:1, :, :7].contiguous())[1]
        torch.testing.assert_close(alone, v[:1])  # the padding of a document changes nothing
        changed = tokens.clone()
        changed[:, 1, :3] = torch.randint(4, 260, (2, 3))
        torch.testing.assert_close(model.encode_pairs(changed, mask)[0], u)  # no attention across the pair
        logits = model(tokens, mask)
    assert logits.shape == (2, 2) and torch.isfinite(logits).all()
    assert [type(layer).__name__ for layer in model.head] == ["Linear", "ReLU", "Linear"]
    assert (model.head[0].in_features, model.head[0].out_features) == (4 * 16, 2 * 16)


@pytest.mark.usefixtures("one_thread_and_private_cache")
def test_the_task_refuses_single_sequence_data(tmp_path, capsys):
    args = ["fit", "-c", str(LITE), "--data", "tasks.data.listops.ListOpsDataModule", "--data.data_dir", "null"]
    args += ["--data.min_length", "4"]
    args += ["--data.max_length", "16", "--data.train_size", "8", "--data.val_size", "4", "--data.test_size", "4"]
    args += ["--trainer.max_steps", "1", "--trainer.logger.init_args.save_dir", str(tmp_path / "runs")]
    assert cli.main(args) == 2
    printed = capsys.readouterr().err
    assert "DocumentMatching trains on per-pair labels but ListOpsDataModule gives per-sequence" in printed


@pytest.mark.usefixtures("one_thread_and_private_cache")
def test_zoo_fit_trains_the_lite_config_end_to_end_on_a_tiny_release(tmp_path):
    folder = write_release(tmp_path / "tsv_data", pairs=16)
    runs = tmp_path / "runs"
    args = ["fit", "-c", str(LITE), "--data.data_dir", str(folder), "--data.max_length", "48"]
    args += ["--trainer.max_steps", "4", "--trainer.val_check_interval", "2", "--trainer.log_every_n_steps", "1"]
    args += ["--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]
    args += ["--trainer.logger.init_args.save_dir", str(runs), "--data.batch_size", "4"]
    args += ["--model.dim", "16", "--model.depth", "1", "--model.dim_head", "8", "--model.warmup_steps", "1"]
    assert cli.main(args) == 0
    run_dir = runs / "lra-retrieval" / "full" / "version_0"
    result = yaml.safe_load((run_dir / "run.json").read_text())
    assert result["status"] == "finished" and result["step"] == 4
    assert 0 <= result["metrics"]["val/acc"] <= 1 and result["tokens_per_s"] > 0
    assert (run_dir / "checkpoints" / "last.ckpt").is_file()
