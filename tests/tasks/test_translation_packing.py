"""Packed translation batches (``TranslationDataModule(pack=True)``, :class:`tasks.data.translation.PackedPairCollate`):
the layout against the pairs themselves, the loss per pair against the padded batch through the unpacked path, a
training step through ``zoo fit --data.pack true``, and the throughput command on a tiny setting."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from attention_zoo.packing import document_ids
from experiments import cli
from experiments.packing_throughput import main as throughput_main
from tasks.base import ConfigError
from tasks.data.base import IGNORE_INDEX
from tasks.data.tokenize import BOS_ID, EOS_ID, PAD_ID
from tasks.data.translation import PairCollate, TranslationDataModule
from tasks.translation import TranslationTask
from tests.tasks.test_translation_task import tiny_args

pytestmark = pytest.mark.usefixtures("one_thread_and_private_cache")

#: the synthetic pair (sources of 5 to 13 tokens with EOS); rows of 32 source and 40 target tokens hold 2 to 5 pairs
DATA = dict(
    source="synthetic",
    synthetic_pairs=300,
    synthetic_words=32,
    bpe_vocab_size=1000,
    max_source_len=32,
    max_target_len=40,
    batch_size=12,
)


def items(dm: TranslationDataModule, count: int) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    dataset = dm.make_dataset("train", dm.load_split("train"))
    return [dataset[i] for i in range(count)]


def tiny_task(dm: TranslationDataModule) -> TranslationTask:
    torch.manual_seed(0)
    task = TranslationTask(
        dm.vocab_size, dm.max_source_len, dm.max_target_len, attention="full", dim=32, depth=2, heads=2, dropout=0.0
    )
    return task.eval()


@pytest.mark.parametrize("pad_to_max_len", [False, True])
def test_packed_rows_hold_each_pair_once_with_its_boundaries_on_both_sides(pad_to_max_len):
    dm = TranslationDataModule(**DATA, pad_to_max_len=pad_to_max_len)
    pairs = items(dm, 12)
    batch = dm.packed_collate()(pairs)
    assert set(batch) == {
        "source", "source_mask", "target_in", "target_out", "target_mask", "source_segments", "target_segments", "index"
    }  # fmt: skip
    source, target_in, target_out = batch["source"], batch["target_in"], batch["target_out"]
    rows, width_s = source.shape
    width_t = target_in.shape[1]
    assert 1 < rows < len(pairs)  # packed, and more than one row
    assert (
        target_out.shape == target_in.shape == batch["target_mask"].shape and batch["source_mask"].shape == source.shape
    )
    assert batch["source_segments"].shape == batch["target_segments"].shape  # pair d: source d and target d
    assert sorted(batch["index"].tolist()) == sorted(index for _, _, index in pairs)
    by_index = {index: (s, t) for s, t, index in pairs}
    order = iter(batch["index"].tolist())
    fills = []
    for r in range(rows):
        at_s = at_t = 0
        bounds_s, bounds_t = [0], [0]
        members = int((batch["source_segments"][r, 1:] > batch["source_segments"][r, :-1]).sum())
        for _ in range(members):
            s, t = by_index[next(order)]
            m = len(t) + 1
            assert torch.equal(source[r, at_s : at_s + len(s)], s) and source[r, at_s + len(s) - 1] == EOS_ID
            assert torch.equal(target_in[r, at_t : at_t + m], torch.cat([torch.tensor([BOS_ID]), t]))
            assert torch.equal(target_out[r, at_t : at_t + m], torch.cat([t, torch.tensor([EOS_ID])]))
            at_s, at_t = at_s + len(s), at_t + m
            bounds_s.append(at_s)
            bounds_t.append(at_t)
        assert at_s <= dm.max_source_len and at_t <= dm.max_target_len
        segments_s, segments_t = batch["source_segments"][r].tolist(), batch["target_segments"][r].tolist()
        # a row with fewer pairs than the widest repeats its last boundary
        assert segments_s == bounds_s + [at_s] * (len(segments_s) - len(bounds_s))
        assert segments_t == bounds_t + [at_t] * (len(segments_t) - len(bounds_t))
        assert batch["source_mask"][r].tolist() == [p < at_s for p in range(width_s)]
        assert batch["target_mask"][r].tolist() == [p < at_t for p in range(width_t)]
        assert bool((source[r, at_s:] == PAD_ID).all()) and bool((target_in[r, at_t:] == PAD_ID).all())
        assert bool((target_out[r, at_t:] == IGNORE_INDEX).all())
        fills.append((at_s, at_t))
    assert next(order, None) is None
    if pad_to_max_len:
        assert (width_s, width_t) == (dm.max_source_len, dm.max_target_len)
    else:
        assert (width_s, width_t) == (max(f[0] for f in fills), max(f[1] for f in fills))


def test_only_the_training_loader_packs_and_its_batches_hold_the_sampler_s_pairs():
    padded = TranslationDataModule(**DATA)
    packed = TranslationDataModule(**DATA, pack=True)
    for dm in (padded, packed):
        dm.setup("fit")
    for plain, batch in zip(padded.train_dataloader(), packed.train_dataloader(), strict=True):
        assert "source_segments" in batch and batch["source"].shape[0] <= plain["source"].shape[0]
        assert sorted(batch["index"].tolist()) == sorted(plain["index"].tolist())
        assert int(batch["target_mask"].sum()) == int(plain["target_mask"].sum())
    for plain, batch in zip(padded.val_dataloader(), packed.val_dataloader(), strict=True):
        assert set(batch) == set(plain) and all(torch.equal(batch[k], plain[k]) for k in plain)


def test_packed_and_padded_give_the_same_loss_per_pair_with_full_attention():
    """Sum of token cross-entropies per pair; the reference is the padded batch through the model's unpacked path."""
    dm = TranslationDataModule(**DATA)
    pairs = items(dm, 12)
    task = tiny_task(dm)
    padded, packed = PairCollate()(pairs), dm.packed_collate()(pairs)
    assert packed["source"].shape[0] < padded["source"].shape[0]
    with torch.no_grad():
        reference_logits = task.model(
            padded["source"], padded["source_mask"], padded["target_in"], padded["target_mask"]
        )
        packed_logits = task(packed)
    per_token = F.cross_entropy(reference_logits.transpose(1, 2), padded["target_out"], reduction="none")
    reference = dict(zip(padded["index"].tolist(), per_token.sum(1).tolist(), strict=True))
    per_token = F.cross_entropy(packed_logits.transpose(1, 2), packed["target_out"], reduction="none")
    documents = document_ids(packed["target_segments"], packed["target_in"].shape[1])
    offset = torch.cumsum(torch.tensor([0, *(documents.amax(1) + 1).tolist()]), 0)  # documents before each row
    flat = torch.zeros(len(pairs)).index_add_(
        0, (documents + offset[:-1, None])[documents >= 0], per_token[documents >= 0]
    )
    losses = dict(zip(packed["index"].tolist(), flat.tolist(), strict=True))
    assert set(losses) == set(reference)
    order = sorted(reference)
    torch.testing.assert_close(
        torch.tensor([losses[i] for i in order]), torch.tensor([reference[i] for i in order]), rtol=1e-5, atol=1e-5
    )
    # the task's loss (label-smoothed mean over the real target tokens) is the same too
    with torch.no_grad():
        torch.testing.assert_close(
            task.loss(packed_logits, packed["target_out"]),
            task.loss(reference_logits, padded["target_out"]),
            rtol=1e-5,
            atol=1e-6,
        )
    assert task.real_tokens(packed) == task.real_tokens(padded)


def test_a_packed_batch_is_refused_where_the_task_decodes():
    dm = TranslationDataModule(**DATA)
    task = tiny_task(dm)
    with pytest.raises(ConfigError, match="test decodes its sources, which cannot be packed"):
        task.test_step(dm.packed_collate()(items(dm, 4)), 0)


def test_zoo_fit_trains_on_packed_batches(tmp_path, monkeypatch):
    seen = []
    step = TranslationTask.training_step

    def recording_step(self, batch, batch_idx):
        seen.append("source_segments" in batch)
        return step(self, batch, batch_idx)

    monkeypatch.setattr(TranslationTask, "training_step", recording_step)
    runs = tmp_path / "runs"
    args = tiny_args(runs) + ["--data.pack", "true", "--trainer.max_steps", "2", "--trainer.limit_val_batches", "0"]
    assert cli.main(["fit", *args]) == 0
    fitted = json.loads((runs / "translation" / "full" / "version_0" / "run.json").read_text())
    assert fitted["status"] == "finished" and fitted["step"] == 2 and fitted["tokens_per_s"] > 0
    assert seen == [True, True]


def test_throughput_command_on_a_tiny_setting(tmp_path, capsys):
    out = tmp_path / "throughput.json"
    data = ["source=synthetic", "synthetic_pairs=300", "bpe_vocab_size=1000", "max_source_len=16", "max_target_len=20"]
    data.append("batch_size=8")
    argv = ["--batches", "2", "--repeats", "2", "--json", str(out)]
    argv += [arg for pair in data for arg in ("--set", pair)]
    argv += ["--model", "dim=16", "--model", "depth=1", "--model", "heads=2"]
    assert throughput_main(argv) == 0
    result = json.loads(out.read_text())
    assert set(result["arms"]) == {"padded", "packed"}
    padded, packed = result["arms"]["padded"], result["arms"]["packed"]
    assert len(padded["tokens_per_s"]) == len(packed["tokens_per_s"]) == 2
    assert padded["real_tokens"] == packed["real_tokens"] > 0  # the same pairs in both arms
    assert packed["rows"] < padded["rows"] == 2 * 8
    assert result["ratio_median"] > 0 and "packed / padded" in capsys.readouterr().out
