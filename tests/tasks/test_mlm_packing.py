"""MLM with ``pack=True``: each chunk's file boundaries reach the batch as ``segments`` (attention_zoo.packing),
against boundaries computed from the files' own byte counts; everything else is the batch of ``pack=False``."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from tasks.data.mlm import MaskedLMDataModule
from tasks.token_prediction import TokenPrediction

ROW = 16
# byte-level: one token per byte. In corpus order (beta, gamma, delta, alpha: the seeded shuffle) and split
# 60 / 20 / 20 % by characters: beta and gamma start in train, gamma (over three rows) runs into val, where
# delta starts, and alpha starts in test
TEXTS = {
    "alpha.txt": "0123456789",
    "beta.txt": "abc",
    "gamma.txt": "the quick brown fox jumps over the lazy dog, then n",
    "delta.txt": "lorem ipsum do",
}


def module(tmp_path: Path, **options) -> MaskedLMDataModule:
    folder = tmp_path / "corpus"
    if not folder.exists():  # written once, so that every module of a test sees the same files
        folder.mkdir()
        for name, text in TEXTS.items():
            (folder / name).write_text(text)
    settings = dict(max_seq_len=ROW, batch_size=3, val_fraction=0.2, test_fraction=0.2)
    return MaskedLMDataModule(corpus_dir=str(folder), cache_dir=str(tmp_path / "cache"), **(settings | options))


def expected_boundaries(files: list[Path]) -> dict[str, list[list[int]]]:
    """Per split, per chunk: 0, every file start strictly inside the chunk, the chunk's length; from the byte
    counts of the files in corpus order and the split's character fractions (0.6 / 0.2 / 0.2)."""
    sizes = [len(path.read_bytes()) for path in files]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    total = sum(sizes)
    edges = {"train": (0, round(0.6 * total)), "val": (round(0.6 * total), round(0.8 * total)), "test": (0, 0)}
    edges["test"] = (edges["val"][1], total)
    chunks = {}
    for split, (low, high) in edges.items():
        rows = []
        for chunk_start in range(low, high, ROW):
            chunk_end = min(chunk_start + ROW, high)
            inside = [s - chunk_start for s in starts if chunk_start < s < chunk_end]
            rows.append([0, *inside, chunk_end - chunk_start])
        chunks[split] = rows
    return chunks


def loaders(dm: MaskedLMDataModule) -> dict[str, torch.utils.data.DataLoader]:
    dm.prepare_data()
    dm.setup()
    return {"train": dm.train_dataloader(), "val": dm.val_dataloader(), "test": dm.test_dataloader()}


@pytest.mark.parametrize("pad_to_max_len", [False, True])
def test_segments_are_the_files_boundaries_inside_each_chunk(tmp_path, pad_to_max_len):
    dm = module(tmp_path, pack=True, pad_to_max_len=pad_to_max_len)
    expected = expected_boundaries(dm.files())
    assert all(any(len(row) > 2 for row in rows) for rows in expected.values())  # a file starts in every split
    for split, loader in loaders(dm).items():
        chunk_order = [index for _, index in loader.sampler]  # train is shuffled: follow the sampler's order
        rows = [row for batch in loader for row in batch["segments"].tolist()]
        widths = [batch["tokens"].shape[1] for batch in loader for _ in batch["tokens"]]
        assert len(rows) == len(expected[split]) and sorted(chunk_order) == list(range(len(rows)))
        for row, index, width in zip(rows, chunk_order, widths, strict=True):
            boundaries = expected[split][index]
            # a chunk with fewer documents than the batch's most repeats its last boundary
            assert row == boundaries + [boundaries[-1]] * (len(row) - len(boundaries)), (split, index)
            assert boundaries[-1] <= width and (width == ROW or not pad_to_max_len)
        for batch in loader:
            ends = batch["segments"][:, -1]
            assert torch.equal(batch["mask"], torch.arange(batch["tokens"].shape[1])[None, :] < ends[:, None])
            assert batch["segments"].dtype == torch.long


def test_tokens_labels_and_masks_are_those_of_pack_false(tmp_path):
    packed, plain = module(tmp_path, pack=True), module(tmp_path)
    assert "pack" not in plain.cache_params()  # the caches built before the option keep their keys
    assert packed.cache_path("train") != plain.cache_path("train")
    packed_loaders, plain_loaders = loaders(packed), loaders(plain)
    for split in ("train", "val", "test"):
        for epoch in (0, 1):
            packed_loaders[split].sampler.set_epoch(epoch)
            plain_loaders[split].sampler.set_epoch(epoch)
            pairs = list(zip(packed_loaders[split], plain_loaders[split], strict=True))
            assert pairs
            for with_segments, without in pairs:
                assert set(with_segments) == {"tokens", "mask", "labels", "segments"}
                assert set(without) == {"tokens", "mask", "labels"}
                for key in ("tokens", "mask", "labels"):
                    assert torch.equal(with_segments[key], without[key]), (split, epoch, key)


def test_a_training_step_runs_on_packed_batches(tmp_path):
    dm = module(tmp_path, pack=True)
    torch.manual_seed(0)
    model = TokenPrediction(num_classes=dm.num_classes, vocab_size=dm.vocab_size, max_seq_len=ROW, dim=16, depth=1,
                            heads=2)  # fmt: skip
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    trainer = pl.Trainer(default_root_dir=tmp_path, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", max_steps=2,
                         limit_val_batches=1, num_sanity_val_steps=0)  # fmt: skip
    trainer.fit(model, datamodule=dm)
    assert trainer.global_step == 2 and torch.isfinite(trainer.callback_metrics["val/loss"])
    assert any(not torch.equal(p, before[name]) for name, p in model.named_parameters())


def test_attention_stops_at_file_boundaries_and_only_there(tmp_path):
    dm = module(tmp_path, pack=True)
    torch.manual_seed(0)
    encoder = TokenPrediction(num_classes=dm.num_classes, vocab_size=dm.vocab_size, max_seq_len=ROW, dim=16, depth=2,
                              heads=2).double().eval().encoder  # fmt: skip
    checked = {"inside": 0, "crossing": 0}
    for loader in loaders(dm).values():
        for batch in loader:
            segments, tokens, mask = batch["segments"], batch["tokens"], batch["mask"]
            with torch.no_grad():
                packed, plain = encoder(tokens, mask, segments), encoder(tokens, mask)
            for row, edges in enumerate(sorted(set(bounds)) for bounds in segments.tolist()):
                if len(edges) == 2:  # the chunk lies inside one file: nothing changes
                    torch.testing.assert_close(packed[row, : edges[1]], plain[row, : edges[1]], rtol=0, atol=1e-12)
                    checked["inside"] += 1
                    continue
                # the first file's part already differs: attention no longer reaches the next file
                assert not torch.allclose(packed[row, : edges[1]], plain[row, : edges[1]], atol=1e-6)
                # each document is the encoder on that document alone (positions count from its start)
                for start, end in zip(edges[:-1], edges[1:], strict=True):
                    with torch.no_grad():
                        alone = encoder(tokens[row : row + 1, start:end])[0]
                    torch.testing.assert_close(packed[row, start:end], alone, rtol=0, atol=1e-10)
                checked["crossing"] += 1
    assert checked["inside"] >= 2 and checked["crossing"] >= 3, checked


def test_pack_must_be_a_bool(tmp_path):
    with pytest.raises(ValueError, match="pack must be true or false, got 'yes'"):
        module(tmp_path, pack="yes")
