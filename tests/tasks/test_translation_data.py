"""Translation data: the gettext reader on .mo catalogs written here (never /usr/share/locale), the files,
hf (real `datasets` on local JSON) and synthetic sources, the split by source hash, the joint BPE and its
cache, over-long pairs, and batches against the contract. Tiny corpora; every test has its own cache."""

from __future__ import annotations

import gettext
import io
import json
import random
import re
import shutil
import struct
from pathlib import Path

import pytest
import sacrebleu
import torch

from tasks.data.base import IGNORE_INDEX, DataError
from tasks.data.gettext_corpus import read_gettext_pairs, strip_mnemonic
from tasks.data.parallel_corpus import carve, source_hash
from tasks.data.parallel_text import data_files, read_pairs
from tasks.data.synthetic_translation import Lexicon, synthetic_pairs
from tasks.data.tokenize import BOS_ID, EOS_ID, PAD_ID, TextTokenizer
from tasks.data.translation import MAX_TOKEN_BYTES, TranslationDataModule

FIXTURES = Path(__file__).parents[1] / "fixtures" / "translation"
SMALL = dict(bpe_vocab_size=400, val_fraction=0.2, test_fraction=0.2, batch_size=4)


def write_mo(path: Path, messages: dict[str, str], *, charset: str = "UTF-8", translator: str = "Test") -> None:
    """A GNU .mo catalog as msgfmt writes it (gettext manual, "The Format of GNU MO Files"): seven uint32
    (magic, revision, count, offset of the msgid table, of the msgstr table, hash size 0, hash offset),
    the two tables of (length, offset), then the NUL-terminated strings. Context is ``ctx\\x04msgid``,
    plural forms are NUL-separated in msgid and msgstr."""
    header = f"Content-Type: text/plain; charset={charset}\nPlural-Forms: nplurals=2; plural=(n != 1);\n"
    header += f"Last-Translator: {translator}\n"
    entries = sorted((key.encode(charset), value.encode(charset)) for key, value in {"": header, **messages}.items())
    ids_at = 28
    strs_at = ids_at + 8 * len(entries)
    blob_at = strs_at + 8 * len(entries)
    tables, blob = [b"", b""], b""
    for column in (0, 1):
        for entry in entries:
            tables[column] += struct.pack("<2I", len(entry[column]), blob_at + len(blob))
            blob += entry[column] + b"\0"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(
        struct.pack("<7I", 0x950412DE, 0, len(entries), ids_at, strs_at, 0, blob_at) + b"".join(tables) + blob
    )


def numbered_catalog(count: int) -> dict[str, str]:
    """Distinct messages with umlauts, punctuation and placeholders, enough to fill three splits."""
    return {
        f"Could not open file number {i}: %s": f"Datei Nummer {i} konnte nicht geöffnet werden: »%s«"
        for i in range(count)
    } | {f"Size of item {i} (in bytes)?": f"Größe des Elements {i} (in Bytes)?" for i in range(count)}


def locale_with(tmp_path: Path, count: int = 30) -> Path:
    write_mo(tmp_path / "locale" / "de" / "LC_MESSAGES" / "numbers.mo", numbered_catalog(count))
    return tmp_path / "locale"


def all_batches(dm: TranslationDataModule) -> dict[str, list[dict]]:
    dm.prepare_data()
    dm.setup()
    loaders = {"train": dm.train_dataloader, "val": dm.val_dataloader, "test": dm.test_dataloader}
    return {split: list(loader()) for split, loader in loaders.items()}


# ---- gettext ------------------------------------------------------------------------------------------
def test_gettext_reader_keeps_normalises_and_drops_each_entry_once(tmp_path):
    messages = tmp_path / "de" / "LC_MESSAGES"
    write_mo(
        messages / "a.mo",
        {
            "Open file": "Datei öffnen",
            "_Save As": "Speichern _unter",  # GTK mnemonics on both sides
            "SIG_IGN handler": "SIG_IGN-Handler",  # an identifier, not a mnemonic
            "Usage: %s [OPTION]\n  -v, --verbose    explain\n": "Aufruf: %s [OPTION]\n  -v, --verbose    erklären\n",
            "%d file\0%d files": "%d Datei\0%d Dateien",  # plural: dropped
            "paper size\x04Letter": "Brief",  # context stripped
            "keyboard label\x04": "Taste",  # nothing after the context
            "OK": "OK",  # untranslated copy
            "%s: %s": "%s – %s",  # no letter in the source
            "Untranslated": "",
            "Cancel": "Abbrechen",
            "Close": "Schließen",
            "Quit": "Quit",  # copied here, translated in b.mo: the translation wins
        },
    )
    write_mo(
        messages / "b.mo", {"Cancel": "Abbruch", "Open file": "Datei öffnen", "Close": "Zumachen", "Quit": "Beenden"}
    )
    write_mo(messages / "c.mo", {"Cancel": "Abbruch", "Open file\n": "Datei öffnen"})
    pairs, summary = read_gettext_pairs(tmp_path, "de")
    assert dict(pairs) == {
        "Open file": "Datei öffnen",
        "Save As": "Speichern unter",
        "SIG_IGN handler": "SIG_IGN-Handler",
        "Usage: %s [OPTION] -v, --verbose explain": "Aufruf: %s [OPTION] -v, --verbose erklären",
        "Letter": "Brief",
        "Cancel": "Abbruch",  # 2 catalogs against 1
        "Close": "Schließen",  # a tie: the first catalog in file-name order
        "Quit": "Beenden",
    }
    assert len(pairs) == len(dict(pairs))
    assert summary["catalogs"] == 3
    assert summary["dropped"] == {
        "header": 3,
        "plural": 1,
        "context_only": 1,
        "empty": 1,
        "no_letters": 1,
        "same_as_source": 2,  # OK, Quit in a.mo
        "duplicate_source": 5,  # Cancel x2, Open file x2 (one after normalisation), Close x1
    }
    assert summary["normalised"] == {"context_stripped": 1, "whitespace": 2, "mnemonic": 1}
    assert summary["conflicting_translations"] == 2  # Cancel, Close
    assert summary["with_placeholders"] == 1
    assert summary["catalog_entries"] == len(pairs) + sum(summary["dropped"].values()) == 14 + 5 + 3


def test_latin1_header_is_repaired_and_the_catalog_read_in_its_charset(tmp_path):
    path = tmp_path / "de" / "LC_MESSAGES" / "net.mo"
    write_mo(path, {"Size": "Größe", "Street": "Straße"}, charset="ISO-8859-1", translator="Ralf Bächle")
    with pytest.raises(UnicodeDecodeError):  # the premise: Python's gettext alone cannot read it
        gettext.GNUTranslations(io.BytesIO(path.read_bytes()))
    pairs, summary = read_gettext_pairs(tmp_path, "de")
    assert dict(pairs) == {"Size": "Größe", "Street": "Straße"}
    assert summary["repaired_headers"] == ["net.mo"] and summary["unreadable_catalogs"] == []


def test_unreadable_catalog_is_skipped_and_listed(tmp_path):
    write_mo(tmp_path / "de" / "LC_MESSAGES" / "good.mo", {"Size": "Größe"})
    (tmp_path / "de" / "LC_MESSAGES" / "broken.mo").write_bytes(b"not a catalog at all")
    with pytest.warns(UserWarning, match="broken.mo"):
        pairs, summary = read_gettext_pairs(tmp_path, "de")
    assert pairs == [("Size", "Größe")] and summary["unreadable_catalogs"] == ["broken.mo"] and summary["catalogs"] == 1


def test_a_catalog_with_an_unknown_charset_is_skipped_and_named(tmp_path):
    """A charset Python has no codec for (LookupError, not a ValueError) once aborted the whole corpus load."""
    write_mo(tmp_path / "de" / "LC_MESSAGES" / "good.mo", {"Size": "Größe"})
    write_mo(tmp_path / "de" / "LC_MESSAGES" / "odd.mo", {"Street": "Strasse"}, charset="ASCII")
    odd = tmp_path / "de" / "LC_MESSAGES" / "odd.mo"
    odd.write_bytes(odd.read_bytes().replace(b"charset=ASCII", b"charset=X-NONE"))
    with pytest.warns(UserWarning, match=r"skipping unreadable gettext catalog .*odd\.mo \(unknown encoding: X-NONE"):
        pairs, summary = read_gettext_pairs(tmp_path, "de")
    assert pairs == [("Size", "Größe")] and summary["unreadable_catalogs"] == ["odd.mo"] and summary["catalogs"] == 1


@pytest.mark.parametrize(
    ("pair", "expected"),
    [
        (("_File", "_Datei"), ("File", "Datei")),
        (("Save _As", "Speichern _unter"), ("Save As", "Speichern unter")),
        (("Color _name:", "Farb_name:"), ("Color name:", "Farbname:")),
        (("&Open", "Ö&ffnen"), ("Open", "Öffnen")),
        (("SIG_IGN", "SIG_IGN"), None),  # inside a word: an identifier
        (("AT&T syntax", "AT&T-Syntax"), None),
        (("&lt;key&gt; pressed", "&lt;Taste&gt; gedrückt"), None),  # entities
        (("_Open or _Close", "_Öffnen oder _Schließen"), None),  # two markers: not a mnemonic
        (("_Open", "Öffnen"), None),  # the translation has none
    ],
)
def test_strip_mnemonic(pair, expected):
    assert strip_mnemonic(*pair) == expected


def test_missing_catalogs_error_names_the_other_sources(tmp_path):
    write_mo(tmp_path / "fr" / "LC_MESSAGES" / "a.mo", {"Size": "Taille"})
    with pytest.raises(FileNotFoundError) as error:
        TranslationDataModule(locale_dir=str(tmp_path), target_lang="de", cache_dir=str(tmp_path / "cache"))
    message = str(error.value)
    assert "en-de" in message and "languages with catalogs there: fr" in message
    assert all(f"source='{name}'" in message for name in ("files", "hf", "synthetic"))


def test_gettext_module_splits_by_source_and_round_trips_the_references(tmp_path):
    dm = TranslationDataModule(locale_dir=str(locale_with(tmp_path)), cache_dir=str(tmp_path / "cache"), **SMALL)
    batches = all_batches(dm)
    texts = {split: dm.texts(split) for split in ("train", "val", "test")}
    sources = {split: set(texts[split][0]) for split in texts}
    assert not (
        sources["train"] & sources["val"] or sources["train"] & sources["test"] or sources["val"] & sources["test"]
    )
    assert sum(len(s) for s in sources.values()) == 60 and all(sources.values())
    for split, (split_sources, _) in texts.items():
        edges = {"test": (0, 0.2), "val": (0.2, 0.4), "train": (0.4, 1)}[split]
        assert all(edges[0] <= source_hash(source) < edges[1] for source in split_sources)
    for split, split_batches in batches.items():
        hypotheses, references = [], []
        for batch in split_batches:
            for row in range(len(batch["index"])):
                source, reference = (text[int(batch["index"][row])] for text in texts[split])
                assert dm.decode(batch["source"][row]) == source
                hypotheses.append(dm.decode(batch["target_in"][row][1:]))  # teacher input = the reference
                references.append(reference)
        assert hypotheses == references
        assert sacrebleu.corpus_bleu(hypotheses, [references]).score == pytest.approx(100.0)
    summary = dm.corpus_summary()
    assert summary["source"] == "gettext" and summary["catalogs"] == 1 and summary["distinct_pairs"] == 60
    assert summary["pairs"] == {**{s: len(texts[s][0]) for s in texts}, "total": 60}
    assert summary["dropped"]["overlong"] == {"train": 0, "val": 0, "test": 0}
    assert len(summary["content_hash"]) == 64


# ---- batches, decoding, over-long pairs -----------------------------------------------------------------
def test_batches_follow_the_contract(tmp_path):
    dm = TranslationDataModule(source="synthetic", synthetic_pairs=60, cache_dir=str(tmp_path), **SMALL)
    for name in ("vocab_size", "max_source_len", "max_target_len", "pad_id", "bos_id", "eos_id"):
        assert type(getattr(dm, name)) is int
    assert (dm.pad_id, dm.bos_id, dm.eos_id) == (PAD_ID, BOS_ID, EOS_ID) == (0, 4, 5) and dm.target == "translation"
    batches = all_batches(dm)
    for split_batches in batches.values():
        for batch in split_batches:
            assert set(batch) == {"source", "source_mask", "target_in", "target_out", "target_mask", "index"}
            source, source_mask = batch["source"], batch["source_mask"]
            target_in, target_out, target_mask = batch["target_in"], batch["target_out"], batch["target_mask"]
            assert source.dtype == target_in.dtype == target_out.dtype == batch["index"].dtype == torch.long
            assert source_mask.dtype == target_mask.dtype == torch.bool
            assert source_mask.shape == source.shape and target_in.shape == target_out.shape == target_mask.shape
            assert source.shape[1] == int(source_mask.sum(1).max()) and target_in.shape[1] == int(
                target_mask.sum(1).max()
            )
            assert bool((source[~source_mask] == PAD_ID).all()) and bool((target_in[~target_mask] == PAD_ID).all())
            assert bool((target_out[~target_mask] == IGNORE_INDEX).all())
            for row in range(len(source)):
                n, m = int(source_mask[row].sum()), int(target_mask[row].sum())
                assert bool(source_mask[row, :n].all()) and bool(target_mask[row, :m].all())  # real tokens first
                assert source[row, n - 1] == EOS_ID and BOS_ID not in source[row, :n].tolist()
                assert target_in[row, 0] == BOS_ID and target_out[row, m - 1] == EOS_ID
                assert torch.equal(target_in[row, 1:m], target_out[row, : m - 1])
                assert not {BOS_ID, EOS_ID, PAD_ID} & set(target_out[row, : m - 1].tolist())
    val_indices = [int(i) for batch in batches["val"] for i in batch["index"]]
    assert val_indices == list(range(len(dm.texts("val")[0])))  # evaluation loaders keep a fixed order
    train_indices = sorted(int(i) for batch in batches["train"] for i in batch["index"])
    assert train_indices == list(range(len(dm.texts("train")[0])))


def test_pad_to_max_len(tmp_path):
    dm = TranslationDataModule(
        source="synthetic", synthetic_pairs=40, max_source_len=40, max_target_len=48, pad_to_max_len=True,
        cache_dir=str(tmp_path), **SMALL,
    )  # fmt: skip
    batch = all_batches(dm)["val"][0]
    assert batch["source"].shape[1] == 40 and batch["target_in"].shape[1] == batch["target_out"].shape[1] == 48


def test_decode_stops_at_eos_and_drops_specials_and_round_trips_real_text(tmp_path):
    dm = TranslationDataModule(source="files", train_data=str(FIXTURES / "tiny"), cache_dir=str(tmp_path), **SMALL)
    text = "Größe „Datei“ öffnen: %s – (Straße) 100 % fertig!  Ende?"
    ids = dm.encode_source(text)
    assert ids[-1] == EOS_ID
    assert dm.decode(ids) == dm.decode(torch.tensor([BOS_ID, *ids, 17, 18, PAD_ID])) == " ".join(text.split())
    pairs = [line.split("\t") for line in (FIXTURES / "tiny.tsv").read_text(encoding="utf-8").splitlines()]
    sources, references = [source for source, _ in pairs], [reference for _, reference in pairs]
    decoded = [dm.decode(dm.tokenizer.encode([reference])[0]) for reference in references]
    assert decoded == references
    assert sacrebleu.corpus_bleu(decoded, [references]).score == pytest.approx(100.0)
    for split in ("train", "val", "test"):
        split_sources = dm.texts(split)[0]
        data = dm.load_split(split)
        assert [dm.encode_source(s) for s in split_sources] == [
            data.sequence(2 * i).tolist() for i in range(len(split_sources))
        ]
    assert set(sources) == {s for split in ("train", "val", "test") for s in dm.texts(split)[0]}


def test_byte_tokenizer_decode():
    tokenizer = TextTokenizer()
    assert tokenizer.decode(tokenizer.encode(["Größe: 5 %"])[0].tolist() + [0, 1]) == "Größe: 5 %"


def test_overlong_pairs_are_an_error_by_default_or_dropped_and_counted(tmp_path):
    options = dict(source="files", train_data=str(FIXTURES / "tiny.tsv"), max_source_len=28, max_target_len=30)
    dm = TranslationDataModule(**options, cache_dir=str(tmp_path), **SMALL)
    lengths = {
        split: [
            (len(dm.tokenizer.encode([s])[0]) + 1, len(dm.tokenizer.encode([t])[0]) + 1)
            for s, t in dm.corpus()["splits"][split]
        ]
        for split in ("train", "val", "test")
    }
    too_long = {split: [s > 28 or t > 30 for s, t in pairs] for split, pairs in lengths.items()}
    assert sum(too_long["train"]) > 0 and all(not all(flags) for flags in too_long.values())
    longest_source = max(s for (s, t), long in zip(lengths["train"], too_long["train"], strict=True) if long)
    count, total = sum(too_long["train"]), len(lengths["train"])
    with pytest.raises(ValueError, match=rf"{count} of {total} train pairs .* sources have {longest_source} tokens"):
        dm.load_split("train")
    dropping = TranslationDataModule(**options, overlong="drop", cache_dir=str(tmp_path), **SMALL)
    with pytest.warns(UserWarning, match="dropped"):
        dropping.prepare_data()
    summary = dropping.corpus_summary()
    assert summary["dropped"]["overlong"] == {split: sum(flags) for split, flags in too_long.items()}
    for split, flags in too_long.items():
        kept = [pair for pair, long in zip(dropping.corpus()["splits"][split], flags, strict=True) if not long]
        assert list(zip(*dropping.texts(split), strict=True)) == [tuple(pair) for pair in kept]
        assert summary["pairs"][split] == len(kept)


# ---- files, hf -------------------------------------------------------------------------------------------
def test_files_formats_give_the_same_pairs(tmp_path):
    corpora = {}
    for name, extra in (
        ("tiny", {}),
        ("tiny.tsv", {}),
        ("tiny.jsonl", {"source_field": "translation.en", "target_field": "translation.de"}),
    ):
        dm = TranslationDataModule(
            source="files", train_data=str(FIXTURES / name), cache_dir=str(tmp_path), **extra, **SMALL
        )
        corpora[name] = dm.corpus()["splits"]
    assert corpora["tiny"] == corpora["tiny.tsv"] == corpora["tiny.jsonl"]
    assert sum(len(pairs) for pairs in corpora["tiny"].values()) == 24


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        (
            "bad.tsv",
            "one\tEins\ntwo\tzwei\textra\n",
            "bad.tsv:2: expected 2 tab-separated fields (source, target), got 3",
        ),
        ("bad.jsonl", '{"source": "a", "target": "b"}\n\n{"source": "c"}\n', "bad.jsonl:3: no field 'target'"),
        ("broken.jsonl", '{"source": "a", "target": "b"}\n{"source": \n', "broken.jsonl:2: not valid JSON"),
    ],
)
def test_file_errors_name_the_file_and_its_line(tmp_path, name, content, message):
    (tmp_path / name).write_text(content)
    dm = TranslationDataModule(source="files", train_data=str(tmp_path / name), cache_dir=str(tmp_path), **SMALL)
    with pytest.raises(ValueError) as error:
        dm.corpus()
    assert message in str(error.value)


@pytest.mark.parametrize("name", ["tiny", "tiny.tsv", "tiny.jsonl"])
def test_a_utf8_byte_order_mark_is_not_part_of_the_first_sentence(tmp_path, name):
    """Editors on Windows start UTF-8 files with U+FEFF; the text classification reader drops it, and so must
    this one (it was kept in the first source sentence, or broke the first JSON line)."""
    fields = {"source_field": "translation.en", "target_field": "translation.de"} if name.endswith("jsonl") else {}
    options = dict(source_lang="en", target_lang="de", source_field="source", target_field="target") | fields
    for path in data_files(str(FIXTURES / name), "en", "de"):
        (tmp_path / path.name).write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    expected = read_pairs(str(FIXTURES / name), **options)
    assert read_pairs(str(tmp_path / name), **options) == expected and not expected[0][0].startswith("\ufeff")


def test_aligned_files_must_exist_and_have_equal_line_counts(tmp_path):
    english, german = tmp_path / "bad.en", tmp_path / "bad.de"
    shutil.copy(FIXTURES / "tiny.en", english)
    with pytest.raises(FileNotFoundError, match="bad.de"):
        TranslationDataModule(source="files", train_data=str(tmp_path / "bad"), cache_dir=str(tmp_path), **SMALL)
    german.write_text("".join((FIXTURES / "tiny.de").read_text().splitlines(keepends=True)[:-1]))
    dm = TranslationDataModule(source="files", train_data=str(tmp_path / "bad"), cache_dir=str(tmp_path), **SMALL)
    with pytest.raises(DataError) as error:  # a DataError: `zoo fit` prints it as one line
        dm.corpus()
    assert str(error.value) == (
        f"{str(english)!r} line 24 has no counterpart in {str(german)!r}: line-aligned files differ in length "
        f"({english.name} has 24 lines, {german.name} has 23)"
    )
    german.write_text((FIXTURES / "tiny.de").read_text() + "noch eine Zeile\n")
    with pytest.raises(DataError, match=rf"^{re.escape(repr(str(german)))} line 25 has no counterpart in "):
        read_pairs(str(tmp_path / "bad"), source_lang="en", target_lang="de", source_field="s", target_field="t")


@pytest.mark.parametrize("name", ["bad", "bad.tsv", "bad.jsonl"])
def test_invalid_utf8_is_named_with_file_and_line(tmp_path, name):
    lines = [b"one\tEins", b"two\tzwei", "drei\tStra\u00dfe".encode("latin-1"), b"four\tvier"]
    if name == "bad.jsonl":
        lines = [json.dumps({"source": "a", "target": "b"}).encode()] * 2 + ['{"source": "c", "target": "Stra\u00dfe"}'
                                                                            .encode("latin-1")]  # fmt: skip
    for path in data_files(str(tmp_path / name), "en", "de"):
        column = 0 if name.endswith((".tsv", ".jsonl")) or path.suffix == ".en" else 1
        if name == "bad":
            path.write_bytes(b"\n".join(line.split(b"\t")[column] for line in lines) + b"\n")
        else:
            path.write_bytes(b"\n".join(lines) + b"\n")
    bad = data_files(str(tmp_path / name), "en", "de")[-1]
    with pytest.raises(DataError) as error:
        read_pairs(str(tmp_path / name), source_lang="en", target_lang="de", source_field="source",
                   target_field="target")  # fmt: skip
    assert str(error.value) == f"{str(bad)!r} line 3: not valid utf-8 (byte 0xdf: invalid continuation byte)"


def test_files_with_own_val_and_test_keep_them_in_order_and_report_overlap(tmp_path):
    lines = (FIXTURES / "tiny.tsv").read_text().splitlines(keepends=True)
    val_pairs = [line.rstrip("\n").split("\t") for line in lines[:6]]
    records = [{"source": source, "target": target} for source, target in val_pairs]
    (tmp_path / "val.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    (tmp_path / "test.tsv").write_text("".join(lines[6:9]) + "  \t \n")  # an empty pair: dropped, counted
    dm = TranslationDataModule(
        source="files", train_data=str(FIXTURES / "tiny.tsv"), val_data=str(tmp_path / "val.jsonl"),
        test_data=str(tmp_path / "test.tsv"), cache_dir=str(tmp_path / "c"), **SMALL,
    )  # fmt: skip
    splits = dm.corpus()["splits"]
    assert splits["val"] == val_pairs
    assert len(splits["test"]) == 3 and len(splits["train"]) == 24
    summary = dm.corpus()["summary"]
    assert summary["eval_sources_in_train"] == {"val": 6, "test": 3} and summary["dropped"]["empty"] == 1


@pytest.mark.parametrize("name", ["blank.tsv", "blank.jsonl"])
def test_a_blank_line_is_an_empty_pair_in_tsv_and_jsonl_alike(tmp_path, name):
    """One policy for both formats: a blank line (empty or whitespace only) is an empty pair, dropped and
    counted, never an error."""
    pairs = [line.split("\t") for line in (FIXTURES / "tiny.tsv").read_text().splitlines()]
    rows = (
        ["\t".join(pair) for pair in pairs]
        if name.endswith(".tsv")
        else [json.dumps({"source": source, "target": target}) for source, target in pairs]
    )
    rows[3:3] = [""]
    rows[10:10] = [" \t "[1:] if name.endswith(".tsv") else "   "]  # whitespace only
    (tmp_path / name).write_text("\n".join(rows) + "\n\n")  # and a trailing blank line
    fields = dict(source_lang="en", target_lang="de", source_field="source", target_field="target")
    assert read_pairs(str(tmp_path / name), **fields).count(("", "")) == 3
    dm = TranslationDataModule(source="files", train_data=str(tmp_path / name), cache_dir=str(tmp_path), **SMALL)
    splits, summary = dm.corpus()["splits"], dm.corpus()["summary"]
    assert sorted(pair for split in splits.values() for pair in split) == sorted(pairs)
    assert summary["dropped"]["empty"] == 3


def test_a_long_line_without_spaces_is_refused_before_the_bpe_is_trained(tmp_path, monkeypatch):
    """BPE training time grows with the square of the length of a text without spaces: a pair whose bytes alone
    exceed the limits is overlong before any tokenizer exists, and is refused, or dropped, counted and never
    trained on."""
    long_line = "".join(random.Random(0).choices("abcdefghijklmnopqrstuvwxyz", k=400_000))
    tiny = (FIXTURES / "tiny.tsv").read_text()
    (tmp_path / "train.tsv").write_text(tiny + f"{long_line}\tkurz\n")
    options = dict(source="files", train_data=str(tmp_path / "train.tsv"), val_data=str(FIXTURES / "tiny.tsv"))
    options |= dict(test_data=str(FIXTURES / "tiny.tsv"), max_source_len=64, max_target_len=64, **SMALL)
    trained = []
    train = TextTokenizer.train

    def recording_train(kind, texts, vocab_size, special_tokens, max_token_bytes=None):
        trained.append(max(map(len, texts)))
        assert trained[-1] < 1000, "the BPE is being trained on the long line"
        return train(kind, texts, vocab_size, special_tokens, max_token_bytes)

    monkeypatch.setattr(TextTokenizer, "train", staticmethod(recording_train))
    refusing = TranslationDataModule(**options, cache_dir=str(tmp_path / "error"))
    message = rf"^1 of 25 train pairs .* by their length alone .*: 400000 bytes, '{long_line[:60]}'"
    with pytest.raises(DataError, match=message):
        refusing.prepare_data()
    assert trained == []
    dropping = TranslationDataModule(**options, overlong="drop", cache_dir=str(tmp_path / "drop"))
    with pytest.warns(UserWarning, match="dropped 1 of 25 train pairs"):
        dropping.prepare_data()
    assert len(trained) == 1
    assert dropping.corpus_summary()["dropped"]["overlong"] == {"train": 1, "val": 0, "test": 0}
    assert long_line not in dropping.texts("train")[0] and len(dropping.texts("train")[0]) == 24
    plain = TranslationDataModule(**(options | {"train_data": str(FIXTURES / "tiny.tsv")}), cache_dir=str(tmp_path))
    assert "left_out_overlong" in dropping.cache_params() and "left_out_overlong" not in plain.cache_params()


def test_the_bpe_learns_no_token_longer_than_the_bound_of_the_length_check(tmp_path):
    """The length check before training counts on every token holding at most MAX_TOKEN_BYTES bytes."""
    word = "".join(random.Random(1).choices("abcdefghijklmnopqrstuvwxyz", k=80))
    lines = [f"{word} {i}\t{word} {i}" for i in range(40)]  # a long word seen often: BPE would learn it whole
    (tmp_path / "train.tsv").write_text("\n".join(lines) + "\n")
    dm = TranslationDataModule(source="files", train_data=str(tmp_path / "train.tsv"), cache_dir=str(tmp_path), **SMALL)
    longest = max(len(token) for token in dm.tokenizer.subword.get_vocab())
    assert longest <= MAX_TOKEN_BYTES < len(word)  # without the bound, the word is one 80-byte token


def test_hf_source_reads_local_json_with_the_real_datasets_package(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf")  # not the user's cache
    lines = (FIXTURES / "tiny.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "train.jsonl").write_text("".join(lines[4:]))
    (tmp_path / "validation.jsonl").write_text("".join(lines[:4]))
    files = {"train": str(tmp_path / "train.jsonl"), "validation": str(tmp_path / "validation.jsonl")}
    dm = TranslationDataModule(
        source="hf", hf_dataset="json", hf_data_files=files, cache_dir=str(tmp_path / "c"), **SMALL
    )
    splits = dm.corpus()["splits"]
    expected = [(record["translation"]["en"], record["translation"]["de"]) for record in map(json.loads, lines)]
    assert [tuple(p) for p in splits["val"]] == expected[:4]
    assert sorted(tuple(p) for p in splits["train"] + splits["test"]) == sorted(expected[4:])
    assert all(source_hash(source) < 0.2 for source, _ in splits["test"])  # carved: no test file
    assert dm.corpus_summary()["origin"] == "hf:json"
    batch = all_batches(dm)["val"][0]
    assert dm.decode(batch["target_out"][0].clamp(min=0)) == expected[0][1]


# ---- synthetic -------------------------------------------------------------------------------------------
def test_synthetic_pairs_reorder_and_agree():
    rng = random.Random(3)
    lexicon = Lexicon.draw(rng, 12)
    nouns, adjectives, verbs = dict(lexicon.nouns), dict(lexicon.adjectives), dict(lexicon.verbs)
    for _ in range(300):
        source, target = (text.split() for text in lexicon.sentence(rng))
        assert len(source) == len(target) and source[-1] == target[-1] == "."
        verb_at = 3 if source[1] in adjectives else 2  # DET [ADJ] NOUN VERB ...
        noun = source[verb_at - 1]
        plural_subject = noun not in nouns  # a plural noun carries the source's "s"
        stem = source[verb_at] if plural_subject else source[verb_at][:-1]
        assert target[-2] == verbs[stem] + ("en" if plural_subject else "t")  # verb last, agreeing in number
        assert verb_at < len(source) - 3  # ... and not last in the source: the alignment is not monotonic
        assert target[1].startswith(nouns[noun if noun in nouns else noun[:-1]])  # DET' NOUN' [ADJ'] ...
        if verb_at == 3:
            assert target[2].startswith(adjectives[source[1]])  # the adjective follows its noun
    assert synthetic_pairs(50, words=12, seed=1) == synthetic_pairs(50, words=12, seed=1)
    assert synthetic_pairs(50, words=12, seed=1) != synthetic_pairs(50, words=12, seed=2)
    assert len({source for source, _ in synthetic_pairs(200, words=12, seed=1)}) == 200


# ---- split, BPE, cache, options ------------------------------------------------------------------------------
def test_split_of_a_pair_depends_only_on_its_source():
    pairs = synthetic_pairs(300, words=12, seed=0)
    fractions = {"val": 0.1, "test": 0.1}
    whole = carve(pairs, fractions)
    part = carve(pairs[::3][::-1], fractions)
    where = {pair: split for split, split_pairs in whole.items() for pair in split_pairs}
    assert all(where[pair] == split for split, split_pairs in part.items() for pair in split_pairs)
    assert all(
        [source_hash(s) for s, _ in split] == sorted(source_hash(s) for s, _ in split) for split in whole.values()
    )


def test_bpe_is_trained_on_the_training_split_only_and_cached(tmp_path, monkeypatch):
    seen = []
    train = TextTokenizer.train

    def recording_train(kind, texts, vocab_size, special_tokens, max_token_bytes=None):
        seen.append(list(texts))
        return train(kind, texts, vocab_size, special_tokens, max_token_bytes)

    monkeypatch.setattr(TextTokenizer, "train", staticmethod(recording_train))
    options = dict(source="synthetic", synthetic_pairs=80, cache_dir=str(tmp_path), **SMALL)
    dm = TranslationDataModule(**options)
    all_batches(dm)
    assert len(seen) == 1
    train_texts = dm.texts("train")
    assert sorted(seen[0]) == sorted(train_texts[0] + train_texts[1])
    again = TranslationDataModule(**options)
    all_batches(again)
    assert len(seen) == 1 and again.tokenizer.subword.to_str() == dm.tokenizer.subword.to_str()
    TranslationDataModule(**(options | {"bpe_vocab_size": 420})).prepare_data()
    assert len(seen) == 2  # another vocabulary size is another tokenizer


def test_corpus_cache_follows_the_catalogs(tmp_path):
    locale = locale_with(tmp_path, count=20)
    options = dict(locale_dir=str(locale), cache_dir=str(tmp_path / "cache"), **SMALL)
    first = TranslationDataModule(**options).corpus_summary()
    write_mo(locale / "de" / "LC_MESSAGES" / "more.mo", {"Print the page": "Die Seite drucken"})
    second = TranslationDataModule(**options).corpus_summary()
    assert second["catalogs"] == 2 and second["pairs"]["total"] == first["pairs"]["total"] + 1
    assert second["content_hash"] != first["content_hash"]
    corpus_files = list((tmp_path / "cache" / "translation").glob("corpus-*.json"))
    assert len(corpus_files) == 2
    for path in corpus_files:
        path.write_text("{not json")
    with pytest.warns(UserWarning, match="rebuilding"):
        assert TranslationDataModule(**options).corpus_summary() == second


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"hf_dataset": "wmt14"}, "hf_dataset do not apply to source='gettext'"),
        ({"source": "files"}, "source='files' needs train_data"),
        ({"source": "hf"}, "source='hf' needs hf_dataset"),
        ({"source_lang": "de", "target_lang": "en"}, "source_lang must be 'en'"),
        ({"source": "synthetic", "target_lang": "en"}, "both 'en'"),
        ({"source": "synthetic", "bpe_vocab_size": 261}, "bpe_vocab_size must be >= 262"),
        ({"source": "synthetic", "overlong": "truncate"}, "overlong must be 'error' or 'drop'"),
        ({"source": "synthetic", "val_fraction": 0.6, "test_fraction": 0.5}, "their sum < 1"),
        ({"source": "synthetic", "max_target_len": 1}, "must be >= 2"),
        ({"source": "wmt"}, "source must be one of"),
    ],
)
def test_option_errors(tmp_path, options, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        TranslationDataModule(locale_dir=str(locale_with(tmp_path, 2)), cache_dir=str(tmp_path), **options)


def test_empty_split_is_an_error(tmp_path):
    dm = TranslationDataModule(source="synthetic", synthetic_pairs=20, val_fraction=0.0, cache_dir=str(tmp_path))
    with pytest.raises(DataError, match="the val split is empty"):
        dm.corpus()


def test_an_empty_val_file_is_named(tmp_path):
    (tmp_path / "val.tsv").write_text("\n \t \n")
    train, val = str(FIXTURES / "tiny.tsv"), str(tmp_path / "val.tsv")
    dm = TranslationDataModule(source="files", train_data=train, val_data=val, cache_dir=str(tmp_path), **SMALL)
    message = f"the val split is empty: val_data {val!r} has no pair with both sides non-empty; give it pairs, "
    with pytest.raises(DataError, match=re.escape(message + "or leave val_data unset to carve the split from train")):
        dm.corpus()
