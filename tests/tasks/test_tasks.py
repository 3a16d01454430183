"""Task modules without the CLI: pooling, losses and metrics against hand computations, the attention
errors raised at construction, ``init_from`` (loading and every mismatch), the data-target check and the
learning-rate schedule."""

from __future__ import annotations

import math

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import attention_zoo as az
from tasks.base import ConfigError, flatten_hparams, hparams_for_view
from tasks.classification import SequenceClassification
from tasks.token_prediction import TokenPrediction

SIZES = dict(vocab_size=11, max_seq_len=16, dim=16, depth=2, heads=2)


class BatchesData(pl.LightningDataModule):
    """A data module over fixed batches, following the data contract."""

    def __init__(self, batches: list[dict[str, torch.Tensor]], target: str, num_classes: int) -> None:
        super().__init__()
        self.batches, self.target = batches, target
        self.vocab_size, self.max_seq_len, self.num_classes, self.pad_id = 11, 16, num_classes, 0

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.batches, batch_size=None)

    val_dataloader = train_dataloader


def token_batch(generator: torch.Generator, batch: int = 4, n: int = 12) -> dict[str, torch.Tensor]:
    tokens = torch.randint(1, 11, (batch, n), generator=generator)
    labels = torch.where(torch.rand(batch, n, generator=generator) < 0.3, tokens, -100)
    labels[:, 0] = tokens[:, 0]  # at least one scored position per row
    return {"tokens": tokens, "mask": torch.ones(batch, n, dtype=torch.bool), "labels": labels}


def quiet_trainer(tmp_path, **kwargs) -> pl.Trainer:
    options = dict(
        default_root_dir=tmp_path, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, accelerator="cpu",
    )  # fmt: skip
    return pl.Trainer(**(options | kwargs))


def test_mean_pooling_ignores_padding_in_float64():
    torch.manual_seed(0)
    model = SequenceClassification(num_classes=3, **SIZES).double().eval()
    tokens = torch.randint(1, 11, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.bool)
    padded_tokens = torch.cat([tokens, torch.randint(1, 11, (2, 5))], dim=1)  # garbage after the real tokens
    padded_mask = torch.cat([mask, torch.zeros(2, 5, dtype=torch.bool)], dim=1)
    torch.testing.assert_close(model(padded_tokens, padded_mask), model(tokens, mask), rtol=0, atol=1e-9)


def test_cls_pooling_reads_the_first_position():
    torch.manual_seed(0)
    model = SequenceClassification(num_classes=3, pooling="cls", **SIZES).double().eval()
    tokens, mask = torch.randint(1, 11, (2, 9)), torch.ones(2, 9, dtype=torch.bool)
    expected = model.head(model.encoder(tokens, mask)[:, 0])
    torch.testing.assert_close(model(tokens, mask), expected, rtol=0, atol=0)


def test_token_loss_and_perplexity_count_only_labelled_positions():
    torch.manual_seed(0)
    model = TokenPrediction(num_classes=11, **SIZES).double()
    batch = token_batch(torch.Generator().manual_seed(1))
    logits = model(batch["tokens"], batch["mask"])
    scored = batch["labels"] != -100
    expected = -torch.log_softmax(logits, -1)[scored].gather(-1, batch["labels"][scored][:, None]).mean()
    torch.testing.assert_close(model.loss(logits, batch["labels"]), expected, rtol=1e-12, atol=1e-12)
    metrics = model.update_metrics("val", logits.detach(), batch["labels"])
    assert metrics["val/ppl"].compute().item() == pytest.approx(math.exp(expected.item()), rel=1e-5)
    accuracy = (logits.argmax(-1)[scored] == batch["labels"][scored]).double().mean().item()
    assert metrics["val/acc"].compute().item() == pytest.approx(accuracy, abs=1e-6)


@pytest.mark.parametrize("stage", ["val", "test"])
def test_epoch_loss_weights_batches_by_scored_tokens_so_its_exp_is_the_perplexity(tmp_path, stage):
    torch.manual_seed(0)
    model = TokenPrediction(num_classes=11, **SIZES)
    with torch.no_grad():
        model.head.bias[3] = 6.0  # class 3 is predicted everywhere: labels 3 cost little, the others much
    generator = torch.Generator().manual_seed(5)
    tokens = [torch.randint(1, 11, (4, 12), generator=generator) for _ in range(2)]
    few = torch.full((4, 12), -100)
    few[:, 0] = 3  # 4 scored tokens, all cheap
    many = torch.randint(4, 11, (4, 12), generator=generator)  # 48 scored tokens, all dear
    mask = torch.ones(4, 12, dtype=torch.bool)
    batches = [{"tokens": t, "mask": mask, "labels": y} for t, y in zip(tokens, (few, many), strict=True)]
    trainer = quiet_trainer(tmp_path)
    run = trainer.validate if stage == "val" else trainer.test
    (logged,) = run(model, DataLoader(batches, batch_size=None), verbose=False)
    # the definition: perplexity = exp(mean negative log-likelihood over every scored token of the stage)
    nll, batch_means = [], []
    with torch.no_grad():
        for batch in batches:
            log_p = torch.log_softmax(model(batch["tokens"], batch["mask"]).double(), dim=-1)
            scored = batch["labels"] != -100
            token_nll = -log_p[scored].gather(-1, batch["labels"][scored][:, None]).squeeze(-1)
            nll.append(token_nll)
            batch_means.append(token_nll.mean())
    expected = torch.cat(nll).mean().item()
    assert logged[f"{stage}/loss"] == pytest.approx(expected, rel=1e-5)
    assert math.exp(logged[f"{stage}/loss"]) == pytest.approx(logged[f"{stage}/ppl"], rel=1e-5)
    assert logged[f"{stage}/ppl"] == pytest.approx(math.exp(expected), rel=1e-5)
    per_sequence = torch.stack(batch_means).mean().item()  # both batches hold 4 sequences: the old weighting
    assert abs(per_sequence - expected) > 0.2 * expected  # so the assertions above tell the two apart


def test_classification_metrics_match_hand_computation():
    model = SequenceClassification(num_classes=3, **SIZES)
    logits = torch.tensor([[2.0, 0, 0], [0, 2.0, 0], [0, 2.0, 0], [0, 0, 2.0]])
    labels = torch.tensor([0, 1, 2, 2])
    metrics = model.update_metrics("test", logits, labels)
    assert metrics["test/acc"].compute().item() == pytest.approx(0.75)
    # per-class F1: class 0: 1, class 1: P=1/2 R=1 -> 2/3, class 2: P=1 R=1/2 -> 2/3
    assert metrics["test/f1"].compute().item() == pytest.approx((1 + 2 / 3 + 2 / 3) / 3, abs=1e-6)
    assert model.loss(logits, labels).item() == pytest.approx(F.cross_entropy(logits, labels).item())


def test_unknown_attention_fails_at_construction_with_the_known_names():
    with pytest.raises(ConfigError, match="unknown attention 'flash'") as error:
        SequenceClassification(num_classes=3, attention="flash", **SIZES)
    assert all(name in str(error.value) for name in az.list_attentions())


def test_unknown_option_fails_at_construction_with_the_valid_options():
    with pytest.raises(ConfigError, match="has no option 'window'.*valid options: backend"):
        SequenceClassification(num_classes=3, attention="full", attention_options={"window": 4}, **SIZES)
    with pytest.raises(ConfigError, match="backend=.*not a valid"):
        SequenceClassification(num_classes=3, attention="full", attention_options={"backend": "cuda"}, **SIZES)


def test_hparams_carry_the_attention_and_flatten_for_tensorboard():
    model = SequenceClassification(num_classes=3, attention="full", attention_options={"backend": "math"}, **SIZES)
    assert model.hparams.attention == "full" and model.hparams.attention_options == {"backend": "math"}
    flat = flatten_hparams(dict(model.hparams))
    assert flat["attention"] == "full" and flat["attention_options/backend"] == "math"
    assert flat["dim_head"] == "None"
    assert flatten_hparams({"attention_options": {}}) == {"attention_options": "{}"}


def test_hparams_view_shows_attention_and_a_short_options_string_without_cli_bookkeeping():
    params = {
        "attention": "linformer",
        "attention_options": {"k": 64, "sharing": "kv"},
        "dim": 64,
        "_class_path": "tasks.token_prediction.TokenPrediction",
        "_instantiator": "lightning.pytorch.cli.instantiate_module",
    }
    assert hparams_for_view(params) == {"attention": "linformer", "attention_options": "k=64 sharing=kv", "dim": 64}
    assert hparams_for_view({"attention": "full", "attention_options": {}})["attention_options"] == "-"


def pretrained_checkpoint(tmp_path, **overrides) -> str:
    """A real Lightning checkpoint of a TokenPrediction (MLM-like) model after one training step."""
    torch.manual_seed(0)
    model = TokenPrediction(num_classes=11, **(SIZES | overrides))
    data = BatchesData([token_batch(torch.Generator().manual_seed(2))], "token", 11)
    trainer = quiet_trainer(tmp_path, max_steps=1, limit_val_batches=0)
    trainer.fit(model, datamodule=data)
    path = tmp_path / "pretrained.ckpt"
    trainer.save_checkpoint(path)
    return str(path)


def test_init_from_loads_the_encoder_of_a_lightning_checkpoint(tmp_path):
    path = pretrained_checkpoint(tmp_path)
    assert torch.load(path, weights_only=True)["hyper_parameters"]["attention"] == "full"  # no pickled code needed
    saved = torch.load(path, weights_only=True)["state_dict"]
    torch.manual_seed(123)  # a different initialisation, to be overwritten
    model = SequenceClassification(num_classes=3, init_from=path, **SIZES)
    for key, value in model.encoder.state_dict().items():
        torch.testing.assert_close(value, saved[f"encoder.{key}"], rtol=0, atol=0)
    assert model.head.out_features == 3  # the MLM head is not copied


def test_init_from_names_mismatching_attention(tmp_path):
    path = pretrained_checkpoint(tmp_path)
    other = "nystrom" if "nystrom" in az.list_attentions() else None
    if other is None:
        pytest.skip("needs a second registered mechanism")
    with pytest.raises(ConfigError, match=r"trained with attention 'full', this model uses 'nystrom'"):
        SequenceClassification(num_classes=3, attention=other, init_from=path, **SIZES)


def test_init_from_names_every_mismatching_shape(tmp_path):
    path = pretrained_checkpoint(tmp_path)
    with pytest.raises(ConfigError) as error:
        SequenceClassification(num_classes=3, init_from=path, **(SIZES | {"max_seq_len": 32, "depth": 1}))
    message = str(error.value)
    assert "position_embedding.table.weight: checkpoint (16, 16) vs model (32, 16)" in message
    assert "unexpected layers.1.attn.to_q.weight (16, 16)" in message


def test_init_from_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="no checkpoint file"):
        SequenceClassification(num_classes=3, init_from=str(tmp_path / "nope.ckpt"), **SIZES)


def test_task_refuses_data_with_the_other_kind_of_labels(tmp_path):
    model = SequenceClassification(num_classes=11, **SIZES)
    data = BatchesData([token_batch(torch.Generator().manual_seed(3))], "token", 11)
    with pytest.raises(ConfigError, match="per-sequence labels but BatchesData gives per-token labels"):
        quiet_trainer(tmp_path, max_steps=1).fit(model, datamodule=data)


def test_schedule_warms_up_then_decays_to_zero(tmp_path):
    model = TokenPrediction(num_classes=11, lr=1e-2, warmup_steps=4, **SIZES)
    data = BatchesData([token_batch(torch.Generator().manual_seed(4))] * 20, "token", 11)
    learning_rates = []

    class Record(pl.Callback):
        def on_train_batch_start(self, trainer, *args):
            learning_rates.append(trainer.optimizers[0].param_groups[0]["lr"])

    quiet_trainer(tmp_path, max_steps=20, limit_val_batches=0, callbacks=[Record()]).fit(model, datamodule=data)
    assert learning_rates[:4] == pytest.approx([2.5e-3, 5e-3, 7.5e-3, 1e-2])
    expected_tail = [0.5e-2 * (1 + math.cos(math.pi * (s - 4) / 16)) for s in range(4, 20)]
    assert learning_rates[4:] == pytest.approx(expected_tail)
    groups = model.configure_optimizers()["optimizer"].param_groups
    assert [g["weight_decay"] for g in groups] == [0.01, 0.0]
    assert all(p.ndim >= 2 for p in groups[0]["params"]) and all(p.ndim < 2 for p in groups[1]["params"])
