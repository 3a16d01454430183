"""Data modules: the batch contract, the generators against independent checks, caching, text sources,
tokenizers and MLM masking. Tiny sizes; every test uses its own cache folder."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from jsonargparse import ArgumentParser

from tasks.data import base
from tasks.data import text as text_module
from tasks.data.base import IGNORE_INDEX, DataError, default_cache_dir, derive_seed, load_or_build
from tasks.data.listops import OPERATORS, VOCAB, ListOpsDataModule, generate_listops, to_string
from tasks.data.majority import MajorityDataModule
from tasks.data.mlm import MaskedLMDataModule, split_stream
from tasks.data.recall import AssociativeRecallDataModule
from tasks.data.text import TextClassificationDataModule
from tasks.data.tokenize import CLS_ID, MASK_ID, SPECIAL_TOKENS
from tasks.data.translation import TranslationDataModule

FIXTURES = Path(__file__).parents[1] / "fixtures"
ACLIMDB = FIXTURES / "aclimdb_tiny"


def listops(tmp_path: Path, **options) -> ListOpsDataModule:
    settings = dict(min_length=16, max_length=64, train_size=300, val_size=40, test_size=40, batch_size=16)
    return ListOpsDataModule(**(settings | options), cache_dir=str(tmp_path))


def recall(tmp_path: Path, **options) -> AssociativeRecallDataModule:
    settings = dict(seq_len=64, num_kv_pairs=8, vocab_size=128, train_size=200, val_size=20, test_size=20)
    return AssociativeRecallDataModule(**(settings | options), batch_size=16, cache_dir=str(tmp_path))


def mlm(tmp_path: Path, **options) -> MaskedLMDataModule:
    settings = dict(max_bytes=200_000, max_seq_len=128, batch_size=16)
    return MaskedLMDataModule(**(settings | options), cache_dir=str(tmp_path))


def all_batches(dm) -> dict[str, list[dict]]:
    dm.prepare_data()
    dm.setup()
    return {
        split: list(loader())
        for split, loader in (("train", dm.train_dataloader), ("val", dm.val_dataloader), ("test", dm.test_dataloader))
    }


def check_contract(dm, batches: dict[str, list[dict]], padded_to_max: bool = False) -> None:
    for name in ("vocab_size", "max_seq_len", "num_classes", "pad_id"):
        assert type(getattr(dm, name)) is int
    assert dm.target in ("sequence", "token")
    for split, split_batches in batches.items():
        assert split_batches, f"no {split} batches"
        for batch in split_batches:
            assert set(batch) == {"tokens", "mask", "labels"}
            tokens, mask, labels = batch["tokens"], batch["mask"], batch["labels"]
            assert tokens.dtype == torch.long and mask.dtype == torch.bool and labels.dtype == torch.long
            b, n = tokens.shape
            assert mask.shape == (b, n) and n <= dm.max_seq_len
            assert n == (dm.max_seq_len if padded_to_max else int(mask.sum(1).max()))  # longest of the batch
            assert bool((mask.long().diff(dim=1) <= 0).all()), "real tokens must come first"
            assert bool((tokens[~mask] == dm.pad_id).all()) and bool((tokens[mask] != dm.pad_id).all())
            assert bool(((tokens >= 0) & (tokens < dm.vocab_size)).all())
            if dm.target == "sequence":
                assert labels.shape == (b,) and bool(((labels >= 0) & (labels < dm.num_classes)).all())
            else:
                assert labels.shape == (b, n) and bool((labels[~mask] == IGNORE_INDEX).all())
                real = labels[labels != IGNORE_INDEX]
                assert real.numel() > 0 and bool(((real >= 0) & (real < dm.num_classes)).all())


def split_items(dm, split: str) -> list[tuple[list[int], object]]:
    data = dm.load_split(split)
    labels = data.labels
    per_token = labels is not None and len(labels) == len(data.tokens) and dm.target == "token"
    return [
        (data.sequence(i).tolist(), data.token_labels(i).tolist() if per_token else int(labels[i]))
        for i in range(len(data))
    ]


# ---- ListOps ---------------------------------------------------------------------------------------------
def evaluate_listops(symbols: list[str], max_depth: int, max_args: int) -> int:
    """Independent evaluator: stack machine over the symbol string, LRA semantics (MED = int(median))."""
    ops = {
        "[MIN": min,
        "[MAX": max,
        "[MED": lambda xs: int(statistics.median(xs)),
        "[SM": lambda xs: sum(xs) % 10,
    }
    stack: list[tuple[str, list[int]]] = []
    result = None
    for position, symbol in enumerate(symbols):
        if symbol in ops:
            stack.append((symbol, []))
            assert len(stack) < max_depth, "an operator at max_depth is not allowed (leaves only there)"
        elif symbol == "]":
            op, args = stack.pop()
            assert 2 <= len(args) <= max_args
            value = ops[op](args)
            if stack:
                stack[-1][1].append(value)
            else:
                result = value
                assert position == len(symbols) - 1
        else:
            digit = int(symbol)
            if stack:
                stack[-1][1].append(digit)
            else:
                result = digit
                assert len(symbols) == 1
    assert not stack and result is not None
    return result


def test_listops_batches_follow_contract(tmp_path):
    dm = listops(tmp_path)
    assert (dm.vocab_size, dm.num_classes, dm.max_seq_len, dm.pad_id, dm.target) == (17, 10, 64, 0, "sequence")
    check_contract(dm, all_batches(dm))


def test_listops_labels_equal_independent_evaluation_and_lengths_within_bounds(tmp_path):
    dm = listops(tmp_path, max_depth=6, max_args=5)
    assert to_string([VOCAB.index("[MAX"), VOCAB.index("4"), VOCAB.index("]")]) == "[MAX 4 ]"
    for split in ("train", "val", "test"):
        for tokens, label in split_items(dm, split):
            assert 16 < len(tokens) < 64
            assert evaluate_listops([VOCAB[t] for t in tokens], max_depth=6, max_args=5) == label


def test_listops_median_of_even_count_is_floor_of_mean():
    assert evaluate_listops(["[MED", "1", "2", "]"], 10, 10) == 1  # the evaluator follows int(np.median)
    from tasks.data.listops import _apply

    assert _apply(VOCAB.index("[MED"), [1, 2]) == 1 and _apply(VOCAB.index("[MED"), [1, 5, 8, 9, 2]) == 5


def test_listops_is_deterministic_unique_and_splits_are_disjoint(tmp_path):
    first = {s: split_items(listops(tmp_path / "a"), s) for s in ("train", "val", "test")}
    again = {s: split_items(listops(tmp_path / "b"), s) for s in ("train", "val", "test")}
    other = split_items(listops(tmp_path / "c", seed=1), "train")
    assert first == again and first["train"] != other
    every = [tuple(tokens) for items in first.values() for tokens, _ in items]
    assert len(set(every)) == len(every) == 380  # unique over all splits, as LRA's one set of trees


def test_listops_splits_share_no_expression_where_independent_draws_collide(tmp_path):
    # max_depth=2, max_args=2, lengths 1..4: the grammar allows exactly the 10 digits and the 4 * 10 * 10
    # expressions [OP a b ]; LRA keeps one set of distinct trees and slices it, so splits cannot overlap
    space = {(VOCAB.index(str(d)),) for d in range(10)}
    space |= {(VOCAB.index(op), VOCAB.index(str(a)), VOCAB.index(str(b)), VOCAB.index("]")) for op in OPERATORS
              for a in range(10) for b in range(10)}  # fmt: skip
    assert len(space) == 410
    settings = dict(min_length=0, max_length=5, max_depth=2, max_args=2)
    sizes = {"train": 200, "val": 100, "test": 100}
    # the old scheme, one independent stream per split: a root is a digit with probability 3/4, so each
    # split holds nearly all 10 digits and the splits must share expressions
    independent = {
        split: {tuple(e) for e in generate_listops(size, **settings, seed=derive_seed(0, "listops", split))[0]}
        for split, size in sizes.items()
    }
    assert len(independent["train"] & independent["val"]) >= 10 and len(independent["val"] & independent["test"]) >= 10
    dm = listops(tmp_path, **settings, train_size=200, val_size=100, test_size=100)
    splits = {split: [tuple(tokens) for tokens, _ in split_items(dm, split)] for split in sizes}
    assert {split: len(set(expressions)) for split, expressions in splits.items()} == sizes
    train, val, test = (set(splits[s]) for s in ("train", "val", "test"))
    assert not train & val and not train & test and not val & test
    assert train | val | test <= space
    # splits are slices of a shuffled pool, not of the draw order (where the 10 frequent digits come first)
    assert any(len(expression) == 1 for expression in val | test)
    for split in sizes:
        for tokens, label in split_items(dm, split):
            assert evaluate_listops([VOCAB[t] for t in tokens], max_depth=2, max_args=2) == label


def test_listops_class_balance_is_not_degenerate(tmp_path):
    labels = torch.tensor([label for _, label in split_items(listops(tmp_path, train_size=1500), "train")])
    shares = torch.bincount(labels, minlength=10).double() / len(labels)
    assert bool((shares > 0.03).all()) and float(shares.max()) < 0.3, shares


def test_listops_prepend_cls_and_pad_to_max_len(tmp_path):
    dm = listops(tmp_path, prepend_cls=True, pad_to_max_len=True)
    batches = all_batches(dm)
    check_contract(dm, batches, padded_to_max=True)
    assert bool((batches["train"][0]["tokens"][:, 0] == dm.cls_id).all())


def test_listops_rejects_bad_settings_naming_them(tmp_path):
    with pytest.raises(ValueError, match="max_args must be >= 2"):
        listops(tmp_path, max_args=1)
    with pytest.raises(ValueError, match="min_length=64, max_length=64"):
        listops(tmp_path, min_length=64)
    with pytest.raises(ValueError, match="longest expression has 4 symbols"):
        listops(tmp_path, min_length=10, max_depth=2, max_args=2)


# ---- caching ---------------------------------------------------------------------------------------------
def test_second_construction_reads_the_cache(tmp_path, monkeypatch):
    built = split_items(listops(tmp_path), "train")

    def no_generation(*args, **kwargs):
        raise AssertionError("generated again instead of reading the cache")

    monkeypatch.setattr("tasks.data.listops.generate_listops", no_generation)
    assert split_items(listops(tmp_path), "train") == built
    with pytest.raises(AssertionError, match="generated again"):  # the key covers the seed
        listops(tmp_path, seed=3).load_split("train")


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_damaged_cache_file_is_rebuilt_not_used(tmp_path, damage):
    dm = listops(tmp_path)
    built = split_items(dm, "train")
    path = dm.cache_path("train")
    content = path.read_bytes()
    path.write_bytes(b"not a cache file" if damage == "garbage" else content[: len(content) // 2])
    with pytest.warns(UserWarning, match="ignoring unusable cache file"):
        assert split_items(listops(tmp_path), "train") == built
    assert path.read_bytes() == content


def test_cache_write_is_atomic(tmp_path, monkeypatch):
    def crash_midway(payload, file):
        file.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(base.torch, "save", crash_midway)
    dm = listops(tmp_path)
    with pytest.raises(OSError, match="disk full"):
        dm.load_split("train")
    assert not dm.cache_path("train").exists()
    assert list(dm.cache_path("train").parent.iterdir()) == []  # no temporary file left behind


def test_cache_with_other_parameters_is_not_used(tmp_path):
    path = tmp_path / "x.pt"
    first = load_or_build(path, {"n": 1}, lambda: base.Sequences.from_tensors([torch.tensor([5, 6])]))
    with pytest.warns(UserWarning, match="parameters differ"):
        second = load_or_build(path, {"n": 2}, lambda: base.Sequences.from_tensors([torch.tensor([7])]))
    assert first.tokens.tolist() == [5, 6] and second.tokens.tolist() == [7]


def test_default_cache_dir_honours_zoo_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("ZOO_CACHE", str(tmp_path))
    assert default_cache_dir() == tmp_path
    monkeypatch.delenv("ZOO_CACHE")
    assert default_cache_dir() == Path.home() / ".cache" / "attention-zoo"


def test_replicas_partition_the_training_split(tmp_path):
    dm = listops(tmp_path, train_size=64, batch_size=8)
    dm.setup("fit")
    seen = []
    for rank in (0, 1):
        dm.trainer = SimpleNamespace(distributed_sampler_kwargs={"num_replicas": 2, "rank": rank})
        seen.append([index for _, index in dm.train_dataloader().sampler])
    assert len(seen[0]) == len(seen[1]) == 32 and sorted(seen[0] + seen[1]) == list(range(64))


# ---- associative recall ----------------------------------------------------------------------------------
def test_recall_batches_follow_contract(tmp_path):
    dm = recall(tmp_path)
    assert (dm.vocab_size, dm.num_classes, dm.max_seq_len, dm.target) == (128, 128, 64, "token")
    check_contract(dm, all_batches(dm))


def test_recall_labels_are_the_values_of_the_queried_keys(tmp_path):
    dm = recall(tmp_path)
    kv, half = dm.num_kv_pairs, dm.vocab_size // 2
    for tokens, labels in split_items(dm, "train") + split_items(dm, "test"):
        keys, values = tokens[0 : 2 * kv : 2], tokens[1 : 2 * kv : 2]
        assert len(set(keys)) == kv and all(1 <= k < half for k in keys)
        assert len(set(values)) == kv and all(half <= v < dm.vocab_size for v in values)
        queries = [p for p, label in enumerate(labels) if label != IGNORE_INDEX]
        assert sorted(tokens[p] for p in queries) == sorted(keys)  # every key queried once
        assert all(p >= 2 * kv and (p - 2 * kv) % 2 == 0 for p in queries)
        assert all(labels[p] == values[keys.index(tokens[p])] for p in queries)
        assert 0 not in tokens  # id 0 is only ever padding


def test_recall_lookup_solver_scores_100_percent(tmp_path):
    dm = recall(tmp_path)
    dm.setup()
    correct = total = 0
    for batch in dm.val_dataloader():
        for tokens, labels in zip(batch["tokens"].tolist(), batch["labels"].tolist(), strict=True):
            context = 2 * dm.num_kv_pairs
            memory = dict(zip(tokens[0:context:2], tokens[1:context:2], strict=True))
            for position, label in enumerate(labels):
                if label != IGNORE_INDEX:
                    correct += memory[tokens[position]] == label
                    total += 1
    assert total == 20 * dm.num_kv_pairs and correct == total


@pytest.mark.parametrize("power_a", [0.01, 1.0])
def test_recall_gaps_follow_the_power_law(tmp_path, power_a):
    # Zoology: gaps g in {0, ..., (seq_len - 2 D) / 2 - 1} with p(g) proportional to a (g + 1)^(a - 1); one
    # key per sequence (D = 1), so each sequence carries one gap drawn from p itself (with D > 1 the gaps are
    # drawn without replacement and their marginal is no longer p)
    seq_len, samples = 256, 4000
    dm = recall(tmp_path, seq_len=seq_len, num_kv_pairs=1, power_a=power_a, train_size=samples)
    gaps = torch.tensor(
        [(p - 2) // 2 for _, labels in split_items(dm, "train") for p, label in enumerate(labels) if label >= 0],
        dtype=torch.float64,
    )
    support = torch.arange((seq_len - 2) // 2, dtype=torch.float64)
    weights = power_a * (support + 1) ** (power_a - 1)
    p = weights / weights.sum()
    mean = float((support * p).sum())
    std = float(((support - mean) ** 2 * p).sum().sqrt())
    assert len(gaps) == samples
    assert abs(float(gaps.mean()) - mean) < 4 * std / samples**0.5, (float(gaps.mean()), mean)
    share_zero = float((gaps == 0).double().mean())  # the most likely gap: a binomial share
    assert abs(share_zero - float(p[0])) < 4 * float(p[0] * (1 - p[0])) ** 0.5 / samples**0.5


def test_recall_random_placement_moves_the_block_and_keeps_every_lookup_after_it(tmp_path):
    """kv_placement='random': the key-value block starts at an even offset o in [0, seq_len - 4 D], with filler before
    it; every query comes after the block and asks for a key of it; a lookup solver that searches the whole sequence
    for the key followed by its value still scores 100%."""
    dm = recall(tmp_path, kv_placement="random", train_size=400)
    kv, seq_len = dm.num_kv_pairs, dm.seq_len
    offsets = set()
    for tokens, labels in split_items(dm, "train"):
        queries = [p for p, label in enumerate(labels) if label != IGNORE_INDEX]
        assert len(queries) == kv
        first = min(queries)
        # the block is the 2 D tokens ending where the query region begins: find it from the queried keys
        candidates = [o for o in range(0, seq_len - 4 * kv + 1, 2)
                      if sorted(tokens[o : o + 2 * kv : 2]) == sorted(tokens[p] for p in queries)
                      and o + 2 * kv <= first]  # fmt: skip
        assert candidates, "no key-value block before the queries"
        offset = candidates[-1]
        offsets.add(offset)
        keys, values = tokens[offset : offset + 2 * kv : 2], tokens[offset + 1 : offset + 2 * kv : 2]
        assert all((p - offset - 2 * kv) % 2 == 0 for p in queries)
        assert all(labels[p] == values[keys.index(tokens[p])] for p in queries)
    assert len(offsets) > 10 and min(offsets) == 0 and max(offsets) <= seq_len - 4 * kv
    start = recall(tmp_path / "start", train_size=400)
    assert split_items(start, "val") != split_items(dm, "val")  # the cache keys on the placement


def test_recall_rejects_an_unknown_placement(tmp_path):
    with pytest.raises(ValueError, match="kv_placement must be 'start' or 'random', got 'middle'"):
        recall(tmp_path, kv_placement="middle")


@pytest.mark.parametrize("power_a", [float("nan"), float("inf"), float("-inf"), 0.0, 500.0])
def test_recall_refuses_a_power_a_without_finite_positive_gap_weights(tmp_path, power_a):
    """NaN fails every comparison (``power_a <= 0`` alone lets it through); infinities and huge exponents give
    weights torch's sampler refuses only when the data is built: the constructor refuses them in one line."""
    with pytest.raises(ValueError, match=rf"power_a must be a finite number > 0 .* seq_len=64; got {power_a}$"):
        recall(tmp_path, power_a=power_a)


def test_recall_is_deterministic_and_seeded(tmp_path):
    assert split_items(recall(tmp_path / "a"), "val") == split_items(recall(tmp_path / "b"), "val")
    assert split_items(recall(tmp_path / "a"), "val") != split_items(recall(tmp_path / "c", seed=1), "val")
    assert split_items(recall(tmp_path / "a"), "val") != split_items(recall(tmp_path / "a"), "test")


def test_recall_rejects_bad_settings_naming_them(tmp_path):
    with pytest.raises(ValueError, match="seq_len must be even and >= 4 \\* num_kv_pairs = 32"):
        recall(tmp_path, seq_len=30)
    with pytest.raises(ValueError, match="vocab_size=16 leaves 7 key ids for 8 distinct keys"):
        recall(tmp_path, vocab_size=16)


# ---- text classification ---------------------------------------------------------------------------------
def text(tmp_path: Path, **options) -> TextClassificationDataModule:
    return TextClassificationDataModule(**({"batch_size": 4, "max_seq_len": 128} | options), cache_dir=str(tmp_path))


def decode_bytes(tokens: list[int]) -> str:
    return bytes(t - len(SPECIAL_TOKENS) for t in tokens).decode()


def test_text_from_aclimdb_folder(tmp_path):
    dm = text(tmp_path, data_dir=str(ACLIMDB))
    assert dm.label_names == ["neg", "pos"] and (dm.num_classes, dm.vocab_size) == (2, 260)
    check_contract(dm, all_batches(dm))
    sizes = {s: len(dm.load_split(s)) for s in ("train", "val", "test")}
    assert sizes == {"train": 11, "val": 1, "test": 4}  # val carved from the 12 labelled train reviews
    train_texts = [decode_bytes(t) for t, _ in split_items(dm, "train") + split_items(dm, "val")]
    expected = {p.read_text(): p.parent.name for p in (ACLIMDB / "train").glob("[pn]*/*.txt")}
    assert sorted(train_texts) == sorted(expected)  # the unlabelled train/unsup review is skipped
    for tokens, label in split_items(dm, "train"):
        assert dm.label_names[label] == expected[decode_bytes(tokens)]


@pytest.mark.parametrize(
    ("name", "columns", "label_names"),
    [
        ("tiny.csv", {}, ["cooking", "science", "sports"]),
        ("tiny.tsv", {"text_column": "sentence", "label_column": "category"}, ["cooking", "science", "sports"]),
        ("tiny.jsonl", {"text_column": "review", "label_column": "stars"}, ["1", "2", "3"]),
    ],
)
def test_text_from_table_files(tmp_path, name, columns, label_names):
    dm = text(tmp_path, train_file=str(FIXTURES / name), **columns)
    assert dm.label_names == label_names and dm.label_to_id == {n: i for i, n in enumerate(label_names)}
    check_contract(dm, all_batches(dm))
    splits = {s: [decode_bytes(t) for t, _ in split_items(dm, s)] for s in ("train", "val", "test")}
    assert [len(v) for v in splits.values()] == [14, 2, 2]  # 18 rows, 10 % each carved out
    assert sorted(sum(splits.values(), [])) == sorted(r for r, _ in dm._read_source("train"))
    truth = dict(dm._read_source("train"))
    for tokens, label in split_items(dm, "train"):
        assert dm.label_names[label] == truth[decode_bytes(tokens)]


def test_text_labels_option_orders_and_restricts_labels(tmp_path):
    dm = text(tmp_path, train_file=str(FIXTURES / "tiny.csv"), labels=["sports", "science", "cooking"])
    assert [dm.label_names[label] for _, label in split_items(dm, "train")[:3]] == ["sports", "science", "cooking"]
    restricted = text(tmp_path, train_file=str(FIXTURES / "tiny.csv"), labels=["sports", "science"])
    with pytest.raises(
        ValueError,
        match="unknown label 'cooking' in the train split \\(text 'Fold the egg whites",
    ):
        restricted.setup()
    with pytest.raises(ValueError, match="unknown label folder\\(s\\) \\['neg'\\]"):
        text(tmp_path, data_dir=str(ACLIMDB), labels=["pos", "great"]).setup()


def test_text_errors_name_the_bad_value(tmp_path):
    with pytest.raises(FileNotFoundError, match="'.*nowhere' has no train/ folder"):
        text(tmp_path, data_dir=str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="exactly one source"):
        text(tmp_path)
    with pytest.raises(ValueError, match="has no column \\['body'\\]; it has \\['label', 'text'\\]"):
        text(tmp_path, train_file=str(FIXTURES / "tiny.csv"), text_column="body")
    with pytest.raises(ValueError, match="suffix must be one of \\('.csv', '.tsv', '.jsonl'\\)"):
        text(tmp_path, train_file=str(ACLIMDB / "train" / "pos" / "0_8.txt"))
    with pytest.raises(ValueError, match="truncation must be one of"):
        text(tmp_path, train_file=str(FIXTURES / "tiny.csv"), truncation="cut")


@pytest.mark.parametrize(
    ("suffix", "rows", "line", "count"),
    [
        (".csv", "good film,pos\nbad, really bad,neg\n", 3, 3),  # unquoted comma: an extra field
        (".csv", "good film,pos\nno label at all\n", 3, 1),
        (".tsv", "good film\tpos\nbad\treally bad\tneg\n", 3, 3),
    ],
)
def test_text_rows_with_the_wrong_number_of_fields_are_an_error_naming_file_and_line(
    tmp_path, suffix, rows, line, count
):
    """``bad, really bad,0`` was read as text "bad", label " really bad", the rest silently dropped."""
    path = tmp_path / f"reviews{suffix}"
    path.write_text(("text,label\n" if suffix == ".csv" else "text\tlabel\n") + rows)
    with pytest.raises(DataError, match=f"'{path}' line {line}: {count} fields, the header has 2 \\(text, label\\)"):
        text(tmp_path / "cache", train_file=str(path))


def test_text_classes_are_reported_before_training(tmp_path, monkeypatch):
    messages = []
    monkeypatch.setattr(text_module, "rank_zero_info", messages.append)
    text(tmp_path, train_file=str(FIXTURES / "tiny.csv"))
    assert any("3 classes" in m and "cooking, science, sports" in m and "tiny.csv" in m for m in messages), messages


def test_truncation_is_explicit_and_reported(tmp_path):
    with pytest.raises(ValueError, match="more than max_seq_len=16; set truncation='keep_head' or 'keep_tail'"):
        text(tmp_path / "e", data_dir=str(ACLIMDB), max_seq_len=16).setup()
    originals = {p.read_text().encode() for p in ACLIMDB.glob("t*/[pn]*/*.txt")}
    for mode, prepend_cls in (("keep_head", False), ("keep_tail", True)):
        dm = text(tmp_path / mode, data_dir=str(ACLIMDB), max_seq_len=16, truncation=mode, prepend_cls=prepend_cls)
        with pytest.warns(UserWarning, match=f"texts are longer than max_seq_len=16 tokens and were truncated.*{mode}"):
            items = split_items(dm, "train")
        for tokens, _ in items:
            assert len(tokens) == 16
            if prepend_cls:
                assert tokens[0] == CLS_ID
                tokens = tokens[1:]
            kept = bytes(t - len(SPECIAL_TOKENS) for t in tokens)
            assert any(o.startswith(kept) if mode == "keep_head" else o.endswith(kept) for o in originals)


@pytest.mark.parametrize("kind", ["bpe", "wordpiece"])
def test_trained_tokenizer_is_saved_and_reusable(tmp_path, kind):
    tokenizers = pytest.importorskip("tokenizers")
    dm = text(tmp_path, train_file=str(FIXTURES / "tiny.csv"), tokenizer=kind, tokenizer_vocab_size=300)
    assert dm.vocab_size == 300
    check_contract(dm, all_batches(dm))
    saved = tokenizers.Tokenizer.from_file(str(dm.tokenizer_path))
    assert saved.get_vocab_size() <= 300 and [saved.id_to_token(i) for i in range(4)] == list(SPECIAL_TOKENS)
    first_text = dm.records("train")[0][0]
    first_tokens = split_items(dm, "train")[0][0]
    assert first_tokens == saved.encode(first_text).ids
    if kind == "bpe":  # byte-level BPE is lossless
        assert saved.decode(first_tokens) == first_text
    reused = text(
        tmp_path / "reuse", train_file=str(FIXTURES / "tiny.csv"), tokenizer=kind, tokenizer_file=str(dm.tokenizer_path)
    )
    assert reused.vocab_size == saved.get_vocab_size() and reused.tokenizer_path is None
    assert split_items(reused, "train")[0][0] == first_tokens
    with pytest.raises(ValueError, match="tokenizer_file needs tokenizer='bpe' or 'wordpiece'"):
        text(tmp_path, train_file=str(FIXTURES / "tiny.csv"), tokenizer_file=str(dm.tokenizer_path))


def test_hf_dataset_without_the_package_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import fails even where datasets is installed
    with pytest.raises(ImportError, match="hf_dataset='imdb' needs the Hugging Face `datasets` package"):
        text(tmp_path, hf_dataset="imdb")


def test_hf_dataset_source_reads_local_json_with_the_real_datasets_package(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf")  # not the user's cache
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    rows = [{"text": f"review number {i}", "label": ["neg", "pos"][i % 2]} for i in range(20)]
    files = {}
    for split, part in (("train", rows[:16]), ("test", rows[16:])):
        files[split] = str(tmp_path / f"{split}.jsonl")
        Path(files[split]).write_text("".join(json.dumps(row) + "\n" for row in part))
    dm = text(tmp_path, hf_dataset="json", hf_data_files=files)
    assert dm.label_names == ["neg", "pos"]
    check_contract(dm, all_batches(dm))
    test_items = [(decode_bytes(t), dm.label_names[label]) for t, label in split_items(dm, "test")]
    assert test_items == [(f"review number {i}", ["neg", "pos"][i % 2]) for i in range(16, 20)]
    assert len(dm.load_split("train")) + len(dm.load_split("val")) == 16  # val is carved from train


# ---- masked language modelling ---------------------------------------------------------------------------
def test_mlm_on_the_standard_library_follows_contract(tmp_path):
    dm = mlm(tmp_path)
    assert (dm.vocab_size, dm.num_classes, dm.pad_id, dm.target) == (260, 260, 0, "token")
    assert all(p.suffix == ".py" and "site-packages" not in p.parts for p in dm.files())
    sample = mlm(tmp_path, max_files=30).files()
    assert len(sample) == 30 and set(sample) < set(dm.files()) and sample != sorted(sample)  # a seeded sample
    batches = all_batches(dm)
    check_contract(dm, batches)
    sizes = {s: len(dm.load_split(s)) for s in ("train", "val", "test")}
    assert sizes["val"] > 0 and sizes["test"] > 0 and sizes["train"] > 10 * sizes["val"]
    total = sum(int(dm.load_split(s).lengths().sum()) for s in ("train", "val", "test"))
    assert total == 200_000  # max_bytes, one byte per token


def test_mlm_masking_proportions_follow_bert(tmp_path):
    dm = mlm(tmp_path)
    dm.setup("fit")
    dataset = dm.train_dataloader().dataset
    data = dm.load_split("train")
    selected = masked = randomized = kept = 0
    for index in range(len(dataset)):
        inputs, labels = dataset[(0, index)]
        original = data.sequence(index)
        chosen = labels != IGNORE_INDEX
        assert bool((labels[chosen] == original[chosen]).all()) and bool((inputs[~chosen] == original[~chosen]).all())
        selected += int(chosen.sum())
        masked += int((inputs[chosen] == MASK_ID).sum())
        kept += int((inputs[chosen] == original[chosen]).sum())
        randomized += int(((inputs[chosen] != MASK_ID) & (inputs[chosen] != original[chosen])).sum())
    real = int(data.lengths().sum())
    assert real > 150_000
    assert abs(selected / real - 0.15) < 0.005
    assert abs(masked / selected - 0.8) < 0.015
    assert abs(randomized / selected - 0.1) < 0.01 and abs(kept / selected - 0.1) < 0.01


def test_mlm_fixed_count_selects_as_many_tokens_as_original_bert(tmp_path):
    # google-research/bert create_masked_lm_predictions: num_to_predict = max(1, int(round(len(tokens) * p)))
    # positions, shuffled candidates taken without replacement; chunks of 37 bytes and a short last chunk
    # put n * p on both sides of .5
    for mask_prob in (0.15, 0.5):
        dm = mlm(tmp_path, max_bytes=4_000, max_seq_len=37, mask_prob=mask_prob, selection="fixed_count")
        dm.setup("fit")
        dataset, data = dm.train_dataloader().dataset, dm.load_split("train")
        lengths = set()
        for epoch in (0, 1):
            for index in range(len(dataset)):
                inputs, labels = dataset[(epoch, index)]
                original = data.sequence(index)
                chosen = labels != IGNORE_INDEX
                maskable = int((original >= len(SPECIAL_TOKENS)).sum())
                expected = min(maskable, max(1, int(round(len(original) * mask_prob))))
                assert int(chosen.sum()) == expected, (index, len(original))
                assert bool((labels[chosen] == original[chosen]).all())
                assert bool((inputs[~chosen] == original[~chosen]).all())
                lengths.add(len(original))
        assert len(lengths) == 2  # full chunks and the shorter last one
    per_token = mlm(tmp_path, max_bytes=4_000, max_seq_len=37)
    per_token.setup("fit")
    counts = {int((per_token.train_dataloader().dataset[(0, i)][1] != IGNORE_INDEX).sum()) for i in range(50)}
    assert len(counts) > 2  # the default draws a binomial count per chunk


def test_mlm_masks_are_redrawn_per_epoch_and_fixed_for_evaluation(tmp_path):
    dm = mlm(tmp_path, max_bytes=20_000)
    dm.setup()
    train, val = dm.train_dataloader(), dm.val_dataloader()

    def first_batch(loader, epoch):
        loader.sampler.set_epoch(epoch)
        return next(iter(loader))

    epoch0, epoch1 = first_batch(train, 0), first_batch(train, 1)
    assert not torch.equal(epoch0["labels"], epoch1["labels"])
    assert all(torch.equal(a, b) for a, b in zip(epoch0.values(), first_batch(train, 0).values(), strict=True))
    assert all(
        torch.equal(a, b) for a, b in zip(first_batch(val, 0).values(), first_batch(val, 5).values(), strict=True)
    )


def test_mlm_batches_do_not_depend_on_num_workers(tmp_path):
    inline = mlm(tmp_path, max_bytes=20_000)
    workers = mlm(tmp_path, max_bytes=20_000, num_workers=2)
    for dm in (inline, workers):
        dm.setup("fit")
    for a, b in zip(inline.train_dataloader(), workers.train_dataloader(), strict=True):
        assert all(torch.equal(a[key], b[key]) for key in a)


def test_mlm_from_a_local_folder_with_a_trained_tokenizer(tmp_path):
    pytest.importorskip("tokenizers")
    dm = mlm(tmp_path, corpus_dir=str(ACLIMDB), max_seq_len=16, batch_size=4, tokenizer="bpe", tokenizer_vocab_size=300)
    assert dm.vocab_size == 300 and len(dm.files()) == 17
    check_contract(dm, all_batches(dm))
    assert dm.tokenizer_path.is_file()


def test_mlm_errors_name_the_bad_value(tmp_path):
    with pytest.raises(FileNotFoundError, match="corpus_dir '.*nowhere' is not a folder"):
        mlm(tmp_path, corpus_dir=str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="no files matching '\\*.md' under"):
        mlm(tmp_path, corpus_dir=str(ACLIMDB), file_pattern="*.md").setup()
    with pytest.raises(ValueError, match="mask_prob must be in \\(0, 1\\], got 1.5"):
        mlm(tmp_path, mask_prob=1.5)
    with pytest.raises(ValueError, match="selection must be one of 'per_token', 'fixed_count'; got 'fixed'"):
        mlm(tmp_path, selection="fixed")


def test_split_stream_is_contiguous_and_proportional():
    documents = ["a" * 50, "b" * 30, "c" * 20]
    parts = split_stream(documents, {"train": 0.7, "val": 0.2, "test": 0.1})
    assert "".join(parts["train"] + parts["val"] + parts["test"]) == "".join(documents)
    assert [len("".join(parts[s])) for s in ("train", "val", "test")] == [70, 20, 10]


def test_lightning_sets_the_epoch_of_the_sampler(tmp_path):
    lightning = pytest.importorskip("lightning")

    class Recorder(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(()))
            self.seen: dict[str, list[torch.Tensor]] = {"train": [], "val": []}

        def training_step(self, batch, batch_idx):
            self.seen["train"].append(batch["tokens"])
            return self.weight * batch["tokens"].float().mean()

        def validation_step(self, batch, batch_idx):
            self.seen["val"].append(batch["tokens"])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

    dm = mlm(tmp_path, max_bytes=20_000, batch_size=4)
    model = Recorder()
    trainer = lightning.Trainer(
        max_epochs=2,
        limit_train_batches=1,
        limit_val_batches=1,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, dm)
    train, val = model.seen["train"], model.seen["val"]
    assert len(train) == len(val) == 2
    assert not torch.equal(train[0], train[1])  # shuffling and masks of epoch 1 differ from epoch 0
    assert torch.equal(val[0], val[1])  # evaluation sees the same masked inputs every epoch


# ---- the loader options every module shares ----------------------------------------------------------------
LOADER_OPTIONS = {"seed", "shuffle_seed", "batch_size", "num_workers", "pad_to_max_len", "cache_dir"}
MODULES = [
    ListOpsDataModule,
    AssociativeRecallDataModule,
    MajorityDataModule,
    MaskedLMDataModule,
    TextClassificationDataModule,
    TranslationDataModule,
]


def cli_defaults(module: type) -> dict:
    """The options of ``--data <module>`` with their defaults, as the CLI (jsonargparse) reads them."""
    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(module, "data")
    return dict(parser.get_defaults().data.items())


@pytest.mark.parametrize("module", MODULES, ids=lambda cls: cls.__name__)
def test_every_module_takes_the_loader_options_of_the_base_and_refuses_a_misspelt_one(module):
    defaults = cli_defaults(module)
    assert set(defaults) >= LOADER_OPTIONS
    assert defaults["batch_size"] == (8 if module is MajorityDataModule else 32)
    with pytest.raises(TypeError, match="'batchsize'"):
        module(batchsize=4)


def test_loader_options_reach_the_base(tmp_path):
    majority = MajorityDataModule(seq_len=8, seed=3, shuffle_seed=5, batch_size=2, cache_dir=str(tmp_path))
    assert (majority.seed, majority.shuffle_seed, majority.batch_size, majority.cache_dir) == (3, 5, 2, tmp_path)
    assert MajorityDataModule(seq_len=8, cache_dir=str(tmp_path)).batch_size == 8


@pytest.mark.parametrize("size", ["train_size", "val_size", "test_size"])
@pytest.mark.parametrize("module", [ListOpsDataModule, AssociativeRecallDataModule, MajorityDataModule])
@pytest.mark.parametrize("value", [0, True])
def test_generated_splits_need_at_least_one_example(module, size, value, tmp_path):
    with pytest.raises(ValueError, match=f"^{size} must be an int >= 1, got {value}$"):
        module(**{size: value}, cache_dir=str(tmp_path))
