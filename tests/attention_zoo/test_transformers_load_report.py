"""Reloading with ``attention_zoo.integrations.transformers.from_pretrained`` is quiet about the zoo's own tensors.

transformers' plain loading skips the zoo tensors and would print its LOAD REPORT listing them as UNEXPECTED, though
the integration then loads them. Checked on a tiny Llama (built offline) whose Linformer cores have parameters, with
their own and model-wide shared tensors: nothing about them on stdout, stderr or any log, and every tensor equal to
the saved one. A key outside the zoo's that is missing or foreign still gets one warning line naming it, and a
mis-shaped one still fails with transformers' full report.
"""

from __future__ import annotations

import logging

import pytest
import torch

pytest.importorskip("transformers")

from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedModel  # noqa: E402

from attention_zoo.integrations import transformers as hf  # noqa: E402

REPORT_WORDS = ("LOAD REPORT", "UNEXPECTED", "MISSING", "not ok")


def linformer_llama(sharing: str = "headwise") -> PreTrainedModel:
    config = LlamaConfig(
        vocab_size=64, max_position_embeddings=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    return hf.use_attention(model, "linformer_causal", block_size=8, block_k=4, sharing=sharing)


@pytest.fixture
def logs(monkeypatch, caplog):
    """caplog, seeing transformers' records too (its logger does not propagate; its handler writes to the stderr
    of import time, which capfd reads)."""
    monkeypatch.setattr(logging.getLogger("transformers"), "propagate", True)
    caplog.set_level(logging.INFO)
    return caplog


def saved(tmp_path, sharing: str = "headwise") -> PreTrainedModel:
    model = linformer_llama(sharing)
    with torch.no_grad():
        for key, tensor in model.state_dict().items():
            if hf.CORE_ATTRIBUTE in key or hf.SHARED_ATTRIBUTE in key:
                tensor.add_(torch.rand_like(tensor))  # not what a fresh core would hold
    model.save_pretrained(tmp_path)
    return model


def printed(capfd, logs) -> str:
    out, err = capfd.readouterr()
    return out + err + logs.text


@pytest.mark.parametrize("sharing", ["headwise", "layerwise"])
def test_reloading_prints_nothing_about_the_zoo_tensors(tmp_path, capfd, logs, sharing):
    model = saved(tmp_path, sharing)
    assert any(hf.CORE_ATTRIBUTE in k for k in model.state_dict())
    capfd.readouterr()
    logs.clear()
    reloaded = hf.from_pretrained(AutoModelForCausalLM, tmp_path)
    text = printed(capfd, logs)
    assert not [word for word in REPORT_WORDS if word in text], text
    assert not [r for r in logs.records if r.levelno >= logging.WARNING], text
    before, after = model.state_dict(), reloaded.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("change", ["foreign", "missing"])
def test_a_key_outside_the_zoo_gets_one_line(tmp_path, capfd, logs, change):
    saved(tmp_path)
    file = tmp_path / "model.safetensors"
    tensors = load_file(file)
    if change == "foreign":
        key = "model.layers.0.foreign_adapter.weight"
        tensors[key] = torch.ones(3)
    else:
        key = "model.norm.weight"
        del tensors[key]
    save_file(tensors, file, metadata={"format": "pt"})
    capfd.readouterr()
    logs.clear()
    hf.from_pretrained(AutoModelForCausalLM, tmp_path)
    text = printed(capfd, logs)
    assert "LOAD REPORT" not in text, text
    naming = [line for line in text.splitlines() if key in line]
    assert len(naming) == 1, text
    assert ("unexpected" if change == "foreign" else "missing") in naming[0]
    assert hf.CORE_ATTRIBUTE not in text  # the zoo's own tensors are not among them


def test_a_misshaped_key_fails_with_transformers_report(tmp_path, capfd, logs):
    saved(tmp_path)
    file = tmp_path / "model.safetensors"
    tensors = load_file(file)
    tensors["model.norm.weight"] = torch.ones(5)
    save_file(tensors, file, metadata={"format": "pt"})
    capfd.readouterr()
    with pytest.raises(RuntimeError, match="report"):
        hf.from_pretrained(AutoModelForCausalLM, tmp_path)
    text = printed(capfd, logs)
    assert "LOAD REPORT" in text and "model.norm.weight" in text
