"""The model config (``attention_zoo.config.ModelConfig``): its defaults, its validation, the attention specs it
normalises, one config building the encoder, the decoder and the encoder-decoder, the decoder rule, and the tasks'
flat flags, checkpoints and committed hyperparameters that build it."""

from __future__ import annotations

import dataclasses
import importlib
import json
import re
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import yaml

import attention_zoo as az
from attention_zoo.config import ModelConfig, resolve_decoder_attention
from attention_zoo.linformer.attention import LinformerAttention
from attention_zoo.linformer.causal import CausalLinformerAttention
from attention_zoo.seq2seq import Seq2SeqTransformer

ROOT = Path(__file__).resolve().parents[2]
SMALL = dict(vocab_size=11, max_seq_len=12, dim=16, depth=2, heads=2)


def test_every_field_has_the_default_its_docstring_lists():
    documented = dict(re.findall(r"^\s+([a-z_]+) \(([^)]*)\):", ModelConfig.__doc__, flags=re.MULTILINE))
    config = ModelConfig()
    assert set(documented) == {f.name for f in dataclasses.fields(ModelConfig)}
    for name, text in documented.items():
        value = getattr(config, name)
        shown = value.label if isinstance(value, az.AttentionSpec) else value
        assert text == repr(shown).replace("'", '"'), name
    assert config.attention == config.cross_attention == az.AttentionSpec("full")


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"dim": 30, "heads": 4}, "dim=30 is not divisible by heads=4; pass dim_head explicitly"),
        ({"dim": 0}, "dim must be >= 1 (an int), got 0"),
        ({"depth": True}, "depth must be >= 1 (an int), got True"),
        ({"vocab_size": None}, "vocab_size must be >= 1 (an int), got None"),
        ({"dim_head": 0}, "dim_head must be >= 1 (an int, or None), got 0"),
        ({"max_target_len": 0}, "max_target_len must be >= 1 (an int, or None), got 0"),
        ({"short_convolution": -1}, "short_convolution must be >= 0 (an int; 0: none), got -1"),
        ({"dropout": 1.0}, "dropout must be a number in [0, 1), got 1.0"),
        ({"dropout": -0.1}, "dropout must be a number in [0, 1), got -0.1"),
        ({"positional": "rotary"}, "positional must be 'learned' or 'sinusoidal', got 'rotary'"),
        ({"attention": "nope"}, "unknown attention 'nope'; known: "),
        ({"attention": "linformer:q=3"}, "attention 'linformer' has no option 'q'; valid options: "),
        ({"cross_attention": "linformer:k=x"}, "attention 'linformer': option k='x' is not a valid"),
        ({"decoder_attention": "local:window=4", "decoder_attention_options": {"window": 8}}, "give the options in"),
        ({"decoder_attention_options": 3}, "decoder_attention_options must be a mapping of options or None, got 3"),
    ],
)
def test_a_bad_field_is_one_line_naming_the_value_and_what_is_allowed(fields, message):
    with pytest.raises(ValueError) as error:
        ModelConfig(**fields)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_dim_head_given_frees_dim_from_a_multiple_of_heads():
    assert ModelConfig(dim=30, heads=4, dim_head=8).dim_head == 8


def test_a_spec_in_the_flag_syntax_a_mapping_or_a_spec_is_one_and_the_same():
    spec = az.AttentionSpec("linformer", {"k": 32, "sharing": "kv"})
    given = [spec, "linformer:k=32,sharing=kv", {"name": "linformer", "options": {"sharing": "kv", "k": 32}}]
    configs = [ModelConfig(attention=value, cross_attention=value) for value in given]
    assert all(c.attention == spec and c.cross_attention == spec for c in configs)
    assert configs[0] == configs[1] == configs[2]
    assert ModelConfig(decoder_attention="local:window=4").decoder_attention == az.AttentionSpec("local", {"window": 4})


def parameter_shapes(module: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    return {name: tuple(p.shape) for name, p in module.state_dict().items()}


def test_one_config_builds_the_encoder_the_decoder_and_the_encoder_decoder():
    config = ModelConfig(
        **SMALL, max_target_len=10, decoder_depth=1, attention="linformer:k=4", cross_attention="linformer:k=3"
    )
    torch.manual_seed(0)
    encoder, decoder, model = az.TransformerEncoder(config), az.TransformerDecoder(config), Seq2SeqTransformer(config)
    # the encoder: depth layers of the attention spec over max_seq_len positions
    assert len(encoder.layers) == 2 and encoder.position_embedding.max_seq_len == 12
    assert all(isinstance(layer.attn.core, LinformerAttention) and layer.attn.core.k == 4 for layer in encoder.layers)
    # the decoder: decoder_depth layers over max_target_len positions; self-attention by the decoder rule,
    # cross-attention over max_seq_len memory positions
    assert len(decoder.layers) == 1 and decoder.position_embedding.max_seq_len == 10
    assert isinstance(decoder.layers[0].self_attn.core, CausalLinformerAttention)
    assert decoder.layers[0].cross_attn.core.k == 3
    # the encoder-decoder is exactly those two, its decoder sharing the encoder's token embedding
    assert parameter_shapes(model.encoder) == parameter_shapes(encoder)
    assert parameter_shapes(model.decoder) == parameter_shapes(decoder)
    assert model.decoder.token_embedding is model.encoder.token_embedding
    assert (model.max_source_len, model.max_target_len) == (12, 10)
    assert model.decoder_rule == decoder.decoder_rule == config.decoder_rule()
    source, target = torch.randint(0, 11, (2, 12)), torch.randint(0, 11, (2, 10))
    assert model(source, None, target).shape == (2, 10, 11)


def test_the_decoder_has_no_short_convolution_and_the_encoder_its_own():
    config = ModelConfig(**SMALL, short_convolution=3)
    model = Seq2SeqTransformer(config)
    assert model.encoder.short_convolution.conv.kernel_size == (3,)
    assert not any("short_convolution" in name for name in model.decoder.state_dict())


RULES = [
    # (the config's slots, the flat arguments of resolve_decoder_attention, the rule)
    (
        {"attention": "local:window=8"},
        ("local", {"window": 8}, None, None),
        ("local", {"window": 8}, "local supports causal attention: used with the encoder's options"),
    ),
    (
        {"attention": "local:window=8", "decoder_attention_options": {"window": 4}},
        ("local", {"window": 8}, None, {"window": 4}),
        ("local", {"window": 4}, "local supports causal attention: used with decoder_attention_options"),
    ),
    (
        {"attention": "linformer:k=32"},
        ("linformer", {"k": 32}, None, None),
        (
            "linformer_causal",
            {},
            "linformer is not causal: its declared causal_counterpart linformer_causal, with its default options",
        ),
    ),
    (
        {"attention": "linformer:k=32", "decoder_attention_options": {"block_size": 8, "block_k": 2}},
        ("linformer", {"k": 32}, None, {"block_size": 8, "block_k": 2}),
        (
            "linformer_causal",
            {"block_size": 8, "block_k": 2},
            "linformer is not causal: its declared causal_counterpart linformer_causal, with decoder_attention_options",
        ),
    ),
    (
        {"attention": "nystrom", "decoder_attention": "local:window=4"},
        ("nystrom", {}, "local", {"window": 4}),
        ("local", {"window": 4}, "set by decoder_attention"),
    ),
]


@pytest.mark.parametrize(("slots", "flat", "rule"), RULES)
def test_the_decoder_rule_reads_the_config_as_it_read_the_flat_arguments(slots, flat, rule):
    config = ModelConfig(**SMALL, **slots)
    resolved = config.decoder_rule()
    assert resolved == resolve_decoder_attention(*flat)
    assert (resolved.attention, resolved.options, resolved.reason) == rule
    decoder = az.TransformerDecoder(config)
    core = decoder.layers[0].self_attn.core
    assert isinstance(core, az.get_attention_class(rule[0]))


def test_a_non_causal_decoder_attention_is_refused_when_the_decoder_is_built():
    config = ModelConfig(**SMALL, decoder_attention="nystrom")  # a valid spec: the encoder alone is fine
    az.TransformerEncoder(config)
    with pytest.raises(ValueError, match="decoder_attention 'nystrom' is not causal; causal cores: .*full"):
        Seq2SeqTransformer(config)


# --- the tasks: flat flags, their checkpoints, committed hyperparameters ------------------------------------


def save(task: pl.LightningModule, path: Path) -> Path:
    """``task`` written to ``path`` as Lightning writes a checkpoint."""
    trainer = pl.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False, accelerator="cpu")
    trainer.strategy.connect(task)
    trainer.save_checkpoint(path, weights_only=True)
    return path


def test_a_task_built_from_flat_flags_saves_them_and_loads_back(tmp_path):
    from tasks.token_prediction import TokenPrediction

    flags = dict(attention="linformer", attention_options={"k": 4}, dim=16, depth=1, heads=2, short_convolution=2)
    task = TokenPrediction(vocab_size=11, max_seq_len=16, num_classes=11, **flags)
    path = save(task, tmp_path / "a.ckpt")
    saved = torch.load(path, weights_only=True)["hyper_parameters"]
    assert {k: saved[k] for k in flags} == flags  # flat keys, as zoo fit has always saved
    loaded = TokenPrediction.load_from_checkpoint(path)
    assert loaded.encoder.config == task.encoder.config
    assert loaded.encoder.config.attention == az.AttentionSpec("linformer", {"k": 4})
    for key, value in task.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key


def test_a_translation_task_keeps_its_decoder_rule_through_a_checkpoint(tmp_path):
    from tasks.translation import TranslationTask

    task = TranslationTask(
        11, 8, 8, attention="linformer", decoder_attention_options={"block_size": 4, "block_k": 2}, dim=16, depth=1,
        heads=2, cross_attention="linformer", cross_attention_options={"k": 4},
    )  # fmt: skip
    loaded = TranslationTask.load_from_checkpoint(save(task, tmp_path / "t.ckpt"))
    assert loaded.model.decoder_rule == task.model.decoder_rule
    assert loaded.model.decoder_rule.reason.endswith("linformer_causal, with decoder_attention_options")
    assert loaded.model.config.cross_attention == az.AttentionSpec("linformer", {"k": 4})
    assert parameter_shapes(loaded) == parameter_shapes(task)


COMMITTED = ROOT / "results" / "translation" / "runs" / "tr-msg-linformer-k4-encoder" / "linformer" / "seed-0"


def test_a_committed_runs_hyperparameters_still_build_its_task():
    """The run's saved ``hparams.yaml`` (flat keys, written before the config existed) builds the task its
    ``config.yaml`` names, with the parameter count and the decoder rule its ``run.json`` recorded."""
    class_path = yaml.safe_load((COMMITTED / "config.yaml").read_text())["model"]["class_path"]
    module, name = class_path.rsplit(".", 1)
    hparams = yaml.safe_load((COMMITTED / "hparams.yaml").read_text())
    task = getattr(importlib.import_module(module), name)(**{k: v for k, v in hparams.items() if k[0] != "_"})
    record = json.loads((COMMITTED / "run.json").read_text())
    assert sum(p.numel() for p in task.parameters()) == record["parameters"]
    rule = task.model.decoder_rule
    assert {"attention": rule.attention, "options": rule.options, "rule": rule.reason} == record["decoder_attention"]
    assert task.model.config.attention == az.AttentionSpec(hparams["attention"], hparams["attention_options"])
