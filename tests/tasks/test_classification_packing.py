"""Packed text classification (data option ``pack``): the collate's rows, boundaries and label order against hand
computations, a packed batch's per-example loss against the same examples padded (``full``) and alone (an
approximate core), the data modules' packed batches against their padded ones, a long text truncated as when
padded, and one packed ``zoo fit`` step."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml

from experiments import cli
from tasks.classification import SequenceClassification
from tasks.data.base import DataError, PackCollate, PadCollate
from tasks.data.listops import ListOpsDataModule
from tasks.data.text import TextClassificationDataModule
from tasks.retrieval import DocumentMatching
from tests.tasks.test_cli_fit import record, tiny_args

SIZES = dict(vocab_size=11, max_seq_len=16, num_classes=3, dim=16, depth=2, heads=2, dropout=0.0)

pytestmark = pytest.mark.usefixtures("one_thread_and_private_cache")


def items_of(lengths: list[int], seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Random examples of the given lengths (tokens 1..10) with labels 0..2; no two alike."""
    generator = torch.Generator().manual_seed(seed)
    items = [
        (torch.randint(1, 11, (n,), generator=generator), torch.randint(0, 3, (), generator=generator)) for n in lengths
    ]
    assert len({tuple(tokens.tolist()) for tokens, _ in items}) == len(items)
    return items


def documents(batch: dict[str, torch.Tensor]) -> list[tuple[int, ...]]:
    """The token tuples of a packed batch's non-empty documents, row by row, read from its segments."""
    found = []
    for row, edges in enumerate(batch["segments"].tolist()):
        for start, end in zip(edges[:-1], edges[1:], strict=True):
            if end > start:
                found.append(tuple(batch["tokens"][row, start:end].tolist()))
    return found


def example_order(batch: dict[str, torch.Tensor], items: list[tuple[torch.Tensor, torch.Tensor]]) -> list[int]:
    """For each document of a packed batch, the index of the item it holds (matched by its tokens)."""
    where = {tuple(tokens.tolist()): index for index, (tokens, _) in enumerate(items)}
    return [where[doc] for doc in documents(batch)]


def test_collate_packs_known_lengths_first_fit_decreasing():
    lengths = [6, 3, 5, 4, 2, 10]
    items = [(torch.full((n,), i + 1), torch.tensor(i)) for i, n in enumerate(lengths)]
    batch = PackCollate(pad_id=0, length=12)(items)
    # longest first into the first row with room: 10 -> row 0, 6 -> row 1, 5 -> row 1, 4 -> row 2, 3 -> row 2,
    # 2 -> row 0 (2 left); each row then lists its examples in batch order
    assert batch["labels"].tolist() == [4, 5, 0, 2, 1, 3]
    assert batch["segments"].tolist() == [[0, 2, 12], [0, 6, 11], [0, 3, 7]]
    expected_rows = [[5] * 2 + [6] * 10, [1] * 6 + [3] * 5 + [0], [2] * 3 + [4] * 4 + [0] * 5]
    assert batch["tokens"].tolist() == expected_rows
    assert batch["mask"].tolist() == [[True] * 12, [True] * 11 + [False], [True] * 7 + [False] * 5]


def test_collate_rows_are_as_wide_as_the_fullest_unless_padded_to_the_length():
    items = [(torch.full((n,), 7), torch.tensor(0)) for n in (3, 4)]
    assert PackCollate(pad_id=0, length=12)(items)["tokens"].shape == (1, 7)
    padded = PackCollate(pad_id=0, length=12, pad_to=True)(items)
    assert padded["tokens"].shape == (1, 12) and padded["mask"].sum() == 7
    assert padded["segments"].tolist() == [[0, 3, 7]]


def test_collate_refuses_an_empty_or_an_overlong_example():
    with pytest.raises(ValueError, match="example 1 of the batch: it has no tokens"):
        PackCollate(pad_id=0, length=8)([(torch.ones(3, dtype=torch.long), torch.tensor(0)),
                                         (torch.ones(0, dtype=torch.long), torch.tensor(1))])  # fmt: skip
    with pytest.raises(ValueError, match="example 0: side 0 has 9 tokens; a row holds 0 .. 8"):
        PackCollate(pad_id=0, length=8)([(torch.ones(9, dtype=torch.long), torch.tensor(0))])


# lengths with a single token, a document that fills the row, and rows left part empty
LENGTHS = [16, 1, 7, 5, 9, 3, 12, 2, 4]


@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_packed_loss_equals_padded_loss_with_full(pooling):
    torch.manual_seed(0)
    model = SequenceClassification(attention="full", pooling=pooling, **SIZES).eval()
    items = items_of(LENGTHS)
    padded, packed = PadCollate(pad_id=0)(items), PackCollate(pad_id=0, length=16)(items)
    assert packed["tokens"].shape[0] < len(items)
    order = example_order(packed, items)
    assert sorted(order) == list(range(len(items)))
    assert packed["labels"].tolist() == [int(items[i][1]) for i in order]
    with torch.no_grad():
        reference = F.cross_entropy(model(padded["tokens"], padded["mask"]), padded["labels"], reduction="none")
        logits = model(packed["tokens"], packed["mask"], packed["segments"])
    assert logits.shape == (len(items), SIZES["num_classes"])
    loss = F.cross_entropy(logits, packed["labels"], reduction="none")
    torch.testing.assert_close(loss, reference[order], rtol=0, atol=1e-5)


@pytest.mark.parametrize(("attention", "options"), [("linformer", {"k": 4}), ("nystrom", {"num_landmarks": 4})])
def test_packed_loss_equals_each_example_alone_for_an_approximate_core(attention, options):
    torch.manual_seed(0)
    model = SequenceClassification(attention=attention, attention_options=options, **SIZES).eval()
    items = items_of(LENGTHS, seed=1)
    packed = PackCollate(pad_id=0, length=16)(items)
    with torch.no_grad():
        # each example on its own: one row, no padding
        alone = torch.stack(
            [F.cross_entropy(model(tokens[None], torch.ones(1, len(tokens), dtype=torch.bool)), label[None])
             for tokens, label in items]
        )  # fmt: skip
        logits = model(packed["tokens"], packed["mask"], packed["segments"])
    loss = F.cross_entropy(logits, packed["labels"], reduction="none")
    torch.testing.assert_close(loss, alone[example_order(packed, items)], rtol=0, atol=1e-5)


def test_empty_document_slots_give_no_output():
    torch.manual_seed(0)
    model = SequenceClassification(attention="full", **SIZES).eval()
    tokens = torch.randint(1, 11, (2, 8))
    segments = torch.tensor([[0, 3, 3, 7], [0, 8, 8, 8]])  # an empty slot between two documents; a full row
    mask = torch.arange(8)[None, :] < segments[:, -1:]
    with torch.no_grad():
        logits = model(tokens, mask, segments)
        alone = [model(doc[None], torch.ones(1, len(doc), dtype=torch.bool))[0]
                 for doc in (tokens[0, :3], tokens[0, 3:7], tokens[1])]  # fmt: skip
    torch.testing.assert_close(logits, torch.stack(alone), rtol=0, atol=1e-5)


def test_document_matching_refuses_packed_rows():
    model = DocumentMatching(vocab_size=11, max_seq_len=8, num_classes=2, dim=16, depth=1, heads=2)
    tokens, mask = torch.ones(2, 2, 8, dtype=torch.long), torch.ones(2, 2, 8, dtype=torch.bool)
    with pytest.raises(ValueError, match="DocumentMatching takes pairs of documents.*not packed rows"):
        model(tokens, mask, torch.tensor([[0, 8], [0, 8]]))


@pytest.fixture
def reviews_csv(tmp_path) -> Path:
    """Reviews of 1 to ~60 bytes, some longer than the 24 bytes the modules below keep."""
    path = tmp_path / "reviews.csv"
    words = ["great", "awful", "fine", "boring", "superb", "poor"]
    rows = [f"{' '.join(words[: 1 + i % 6] * (1 + i % 3))} {i},{'pos' if i % 2 else 'neg'}" for i in range(40)]
    path.write_text("text,label\n" + "\n".join(rows) + "\n")
    return path


def batches(module) -> list[dict[str, torch.Tensor]]:
    module.setup("fit")
    return list(module.train_dataloader())


def assert_same_examples_per_step(padded: list[dict], packed: list[dict]) -> None:
    """Each packed step holds the padded step's examples and labels (as a multiset), in no more rows."""
    assert len(padded) == len(packed)
    fewer_rows = False
    for plain, pack in zip(padded, packed, strict=True):
        lengths = plain["mask"].sum(dim=1).tolist()
        expected = Counter(
            (tuple(row[:n].tolist()), int(label))
            for row, n, label in zip(plain["tokens"], lengths, plain["labels"], strict=True)
        )
        assert Counter(zip(documents(pack), pack["labels"].tolist(), strict=True)) == expected
        assert pack["tokens"].shape[0] <= plain["tokens"].shape[0]
        assert int(pack["mask"].sum()) == int(plain["mask"].sum())
        fewer_rows |= pack["tokens"].shape[0] < plain["tokens"].shape[0]
    assert fewer_rows


def test_text_module_packs_the_padded_batches_examples_and_truncates_long_texts_alike(reviews_csv):
    options = dict(train_file=str(reviews_csv), max_seq_len=24, truncation="keep_head", batch_size=8)
    padded = batches(TextClassificationDataModule(**options))
    packed = batches(TextClassificationDataModule(pack=True, **options))
    # the long reviews are cut to their first 24 bytes before batching, packed or not, and then fill a row alone
    assert any(int(batch["mask"].sum(dim=1).max()) == 24 for batch in padded)
    assert_same_examples_per_step(padded, packed)


def test_text_module_refuses_a_long_text_with_truncation_error_when_packed_too(reviews_csv):
    module = TextClassificationDataModule(train_file=str(reviews_csv), max_seq_len=24, pack=True)
    with pytest.raises(DataError, match="more than max_seq_len=24; set truncation="):
        module.setup("fit")


def test_listops_module_packs_the_padded_batches_examples():
    options = dict(min_length=2, max_length=40, max_depth=3, train_size=32, val_size=8, test_size=8, batch_size=8)
    assert_same_examples_per_step(
        batches(ListOpsDataModule(**options)), batches(ListOpsDataModule(pack=True, **options))
    )


def test_fit_listops_packed_through_the_cli(tmp_path):
    runs = tmp_path / "runs"
    args = tiny_args("listops", runs, reviews_csv=None, steps=2) + ["--data.pack", "true"]
    assert cli.main(["fit", *args]) == 0
    result = record(runs / "listops" / "full" / "version_0")
    assert result["status"] == "finished" and result["step"] == 2
    assert 0 <= result["metrics"]["val/acc"] <= 1 and result["metrics"]["val/loss"] > 0
    saved = yaml.safe_load((runs / "listops" / "full" / "version_0" / "config.yaml").read_text())
    assert saved["data"]["init_args"]["pack"] is True
