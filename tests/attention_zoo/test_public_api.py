"""The package's public names: what ``attention_zoo`` exported before its mechanisms moved into family folders
still imports from the same place, and each family folder gives its registered cores by their class names."""

from __future__ import annotations

import importlib

import pytest

import attention_zoo as az

#: ``attention_zoo.__all__`` before the family folders: every name must still be exported
EXPORTED_BEFORE = (
    "AttentionCore", "BuildContext", "DoubleBackwardError", "Geometry", "MultiHeadAttention", "Seq2SeqTransformer",
    "TransformerDecoder", "TransformerEncoder", "allowed_mask", "attention_options", "beam_search",
    "create_attention", "get_attention_class", "greedy_search", "list_attentions", "masked_softmax", "pad_mask",
    "register_attention",
)  # fmt: skip

#: a family folder (an old module path) -> the classes it gives
FAMILIES = {
    "attention_zoo.linformer": ("LinformerAttention", "CausalLinformerAttention"),
    "attention_zoo.nystrom": ("NystromAttention",),
    "attention_zoo.lsh": ("LSHAttention",),
    "attention_zoo.moba": ("MixtureOfBlockAttention",),
    "attention_zoo.sparse": (
        "PatternAttention",
        "LocalAttention",
        "SparseAttention",
        "LongformerAttention",
        "BigBirdAttention",
        "StreamingLLMAttention",
    ),  # fmt: skip
    "attention_zoo.gated_deltanet": ("GatedDeltaNet",),
    "attention_zoo.nsa": ("NativeSparseAttention",),
    "attention_zoo.kernel": ("PerformerAttention", "LinearAttention", "CosFormerAttention"),
    "attention_zoo.decoding": ("beam_search", "greedy_search"),
}


@pytest.mark.parametrize("name", EXPORTED_BEFORE)
def test_every_name_exported_before_is_exported(name):
    assert name in az.__all__ and getattr(az, name) is not None


@pytest.mark.parametrize("module", FAMILIES)
def test_a_family_folder_gives_its_cores_by_the_old_module_path(module):
    family = importlib.import_module(module)
    for name in FAMILIES[module]:
        assert name in family.__all__, f"{module} does not export {name}"
        cls = getattr(family, name)
        registered = getattr(cls, "name", "")
        if registered:
            assert az.get_attention_class(registered) is cls


def test_every_registered_core_is_exported_by_its_family_folder():
    given = {getattr(importlib.import_module(m), n) for m, names in FAMILIES.items() for n in names}
    missing = [name for name in az.list_attentions() if az.get_attention_class(name) not in given]
    assert set(missing) <= {"full", "self_only"}, missing  # the reference and the control are top-level modules
