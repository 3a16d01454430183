"""MLM ``eval_tokens``: val and test hold the same text for every ``max_seq_len``, its masks follow the data's
seed (not the training order's), and the cache keeps the variants apart. A tiny corpus of a few .txt files."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tasks.data.base import IGNORE_INDEX, DataError
from tasks.data.mlm import MaskedLMDataModule

EVAL_TOKENS = 300


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    folder = tmp_path / "corpus"
    folder.mkdir()
    for i in range(4):  # 4 x 2,000 bytes: val and test (10 % each) hold 800 tokens
        (folder / f"doc{i}.txt").write_text("".join(chr(97 + (i * 7 + j * j) % 26) for j in range(2000)))
    return folder


def module(corpus: Path, tmp_path: Path, **options) -> MaskedLMDataModule:
    settings = dict(corpus_dir=str(corpus), max_seq_len=64, val_fraction=0.1, test_fraction=0.1, batch_size=4)
    return MaskedLMDataModule(**(settings | options), cache_dir=str(tmp_path / "cache"))


@pytest.mark.parametrize("split", ["val", "test"])
def test_the_eval_text_is_the_first_eval_tokens_of_the_split_for_every_max_seq_len(corpus, tmp_path, split):
    whole = module(corpus, tmp_path).load_split(split).tokens.long()
    assert len(whole) == 800 > EVAL_TOKENS
    texts = {}
    for n in (64, 100):  # 300 = 4 x 64 + 44 = 3 x 100: a shorter last chunk, and none
        data = module(corpus, tmp_path, max_seq_len=n, eval_tokens=EVAL_TOKENS).load_split(split)
        lengths = data.lengths().tolist()
        assert sum(lengths) == EVAL_TOKENS and all(length == n for length in lengths[:-1]) and lengths[-1] <= n
        texts[n] = torch.cat([data.sequence(i) for i in range(len(data))])
    assert torch.equal(texts[64], texts[100]) and torch.equal(texts[64], whole[:EVAL_TOKENS])


def test_training_keeps_its_whole_split(corpus, tmp_path):
    train = module(corpus, tmp_path, eval_tokens=EVAL_TOKENS).load_split("train")
    assert int(train.lengths().sum()) == 6400


def test_an_eval_split_shorter_than_eval_tokens_is_an_error_naming_both(corpus, tmp_path):
    with pytest.raises(DataError, match="the val part of the corpus has 800 tokens, fewer than eval_tokens=801"):
        module(corpus, tmp_path, eval_tokens=801).load_split("val")
    with pytest.raises(ValueError, match="eval_tokens must be an int >= 1 or None, got 0"):
        module(corpus, tmp_path, eval_tokens=0)


@pytest.mark.parametrize(
    ("option", "value"),
    [("eval_tokens", True), ("eval_tokens", 300.0), ("max_bytes", False), ("max_seq_len", True)],
)
def test_a_bool_or_float_is_not_a_count(corpus, tmp_path, option, value):
    """``True`` is an int to Python: ``eval_tokens=True`` was one evaluation token."""
    with pytest.raises(ValueError, match=rf"{option} must be an int >= \d( or None)?, got {value!r}"):
        module(corpus, tmp_path, **{option: value})


def test_the_cache_tells_eval_tokens_apart_and_keeps_the_old_key_without_it(corpus, tmp_path):
    default = module(corpus, tmp_path)
    assert "eval_tokens" not in default.cache_params()  # caches built before the option keep their keys
    paths = {tokens: module(corpus, tmp_path, eval_tokens=tokens).cache_path("val") for tokens in (200, 300)}
    assert len({default.cache_path("val"), *paths.values()}) == 3
    # built in turn in one cache folder, each reads back its own text
    for tokens in (None, 200, 300, None):
        expected = 800 if tokens is None else tokens
        assert int(module(corpus, tmp_path, eval_tokens=tokens).load_split("val").lengths().sum()) == expected


def test_eval_masks_follow_the_data_seed_not_the_training_order(corpus, tmp_path):
    def masked_labels(**options) -> list[torch.Tensor]:
        dm = module(corpus, tmp_path, eval_tokens=EVAL_TOKENS, **options)
        dm.setup("test")
        return [batch["labels"] for batch in dm.test_dataloader()]

    first = masked_labels(shuffle_seed=0)
    assert all(torch.equal(a, b) for a, b in zip(first, masked_labels(shuffle_seed=1), strict=True))
    other = masked_labels(seed=1)  # another data seed: other files first, other masks
    assert not all(torch.equal(a, b) for a, b in zip(first, other, strict=True))
    assert sum(int((labels != IGNORE_INDEX).sum()) for labels in first) > 0
