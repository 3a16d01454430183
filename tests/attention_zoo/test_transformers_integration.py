"""Zoo cores inside Hugging Face transformers models (attention_zoo.integrations.transformers), on tiny models
built offline from configs: Llama (decoder, grouped-query attention), BERT (encoder, padding) and GPT-2; BART,
T5Gemma and T5 for encoder-decoder models (cross-attention keeps the model's own implementation).

Every mechanism runs forward and backward in each model with its first ``example_configs`` entry (so that n = 32
engages the approximation); ``full`` matches transformers' own sdpa to 1e-5; padding and causality are honoured
(changing padded tokens, or later tokens in a causal model, changes no real, or earlier, output); cached
generation equals recomputation; saving and reloading round-trips the zoo parameters bit for bit.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from transformers import (  # noqa: E402
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSeq2SeqLM,
    BartConfig,
    BertConfig,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    PreTrainedConfig,
    PreTrainedModel,
    T5Config,
    T5GemmaConfig,
    T5GemmaModuleConfig,
)
from transformers.masking_utils import AttentionMaskInterface  # noqa: E402

import attention_zoo as az  # noqa: E402
from attention_zoo.integrations import transformers as hf  # noqa: E402

VOCAB, N, MAX_LEN = 64, 32, 64
TINY = dict(vocab_size=VOCAB, max_position_embeddings=MAX_LEN)


def llama_config() -> LlamaConfig:
    return LlamaConfig(
        **TINY, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    )


def llama() -> PreTrainedModel:
    return AutoModelForCausalLM.from_config(llama_config(), attn_implementation="sdpa")


def gpt2() -> PreTrainedModel:
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=MAX_LEN, n_embd=32, n_layer=2, n_head=4, bos_token_id=1, eos_token_id=2,
        attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0,
    )  # fmt: skip
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def bert() -> PreTrainedModel:
    config = BertConfig(
        **TINY, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return AutoModel.from_config(config, attn_implementation="sdpa")


def bart_config() -> BartConfig:
    return BartConfig(
        **TINY, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
        encoder_ffn_dim=64, decoder_ffn_dim=64, dropout=0.0, attention_dropout=0.0,
    )  # fmt: skip


def bart() -> PreTrainedModel:
    return AutoModelForSeq2SeqLM.from_config(bart_config(), attn_implementation="sdpa")


def t5gemma_config() -> T5GemmaConfig:
    """A T5-layout encoder-decoder (encoder and decoder sub-configs, grouped-query attention, rotary positions),
    without the softcapping and sliding-window layers that the zoo cores refuse."""
    module = dict(
        **TINY, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, query_pre_attn_scalar=8, attn_logit_softcapping=None, final_logit_softcapping=None,
        layer_types=["full_attention"] * 2,
    )  # fmt: skip
    return T5GemmaConfig(encoder=T5GemmaModuleConfig(**module), decoder=T5GemmaModuleConfig(**module), vocab_size=VOCAB)


def t5gemma() -> PreTrainedModel:
    return AutoModelForSeq2SeqLM.from_config(t5gemma_config())  # eager: T5Gemma has no sdpa path


MODELS: dict[str, Callable[[], PreTrainedModel]] = {"llama": llama, "gpt2": gpt2, "bert": bert}
CAUSAL_MODELS = ("llama", "gpt2")
ENCODER_DECODERS: dict[str, Callable[[], PreTrainedModel]] = {"bart": bart, "t5gemma": t5gemma}


pytestmark = pytest.mark.usefixtures("one_thread")


def build(model: str, seed: int = 0) -> PreTrainedModel:
    torch.manual_seed(seed)
    return {**MODELS, **ENCODER_DECODERS}[model]().eval()


def batch(model: str, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and a padding mask (B = 2, N = 32): the second row padded, on the left for Llama (as for batched
    generation), on the right for the others."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (2, N), generator=generator)
    mask = torch.ones(2, N, dtype=torch.long)
    if model == "llama":
        mask[1, :7] = 0
    else:
        mask[1, -7:] = 0
    return ids, mask


def output(model: PreTrainedModel, ids: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    result = model(input_ids=ids, attention_mask=mask)
    return result.logits if hasattr(result, "logits") else result.last_hidden_state


def options_for(name: str) -> dict[str, Any]:
    """use_attention keywords for ``name``: its first example config, and its causal counterpart's for decoders."""
    cls = az.get_attention_class(name)
    options: dict[str, Any] = dict(cls.example_configs[0])
    if not cls.supports_causal and cls.causal_counterpart is not None:
        options["decoder_options"] = dict(az.get_attention_class(cls.causal_counterpart).example_configs[0])
    return options


SHARED_QK = [n for n in az.list_attentions() if az.get_attention_class(n).needs_shared_qk]
USABLE = [n for n in az.list_attentions() if n not in SHARED_QK]
CAUSAL_ONLY = az.list_attentions(causal_only=True)


def usable_in(model: str) -> list[str]:
    """The cores that model's layers can take: in a model with bidirectional layers, none that is causal only."""
    return [n for n in USABLE if model in CAUSAL_MODELS or n not in CAUSAL_ONLY]


def zoo_model(model: str, name: str, seed: int = 0) -> PreTrainedModel:
    return hf.use_attention(build(model, seed), name, **options_for(name))


def real(t: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return t[mask.bool()]


def test_importing_attention_zoo_does_not_import_transformers():
    code = "import sys, attention_zoo; assert 'transformers' not in sys.modules, 'transformers imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_mask_function_is_registered():
    # without one, transformers hands a custom implementation no mask at all (padding and causality dropped)
    assert AttentionMaskInterface._global_mapping[hf.IMPLEMENTATION] is hf.zoo_mask


@pytest.mark.parametrize("model", list(MODELS))
def test_full_matches_transformers_sdpa(model):
    net = build(model)
    ids, mask = batch(model)
    with torch.no_grad():
        reference = output(net, ids, mask)
        unpadded = output(net, ids, None)
        hf.use_attention(net, "full")
        assert net.config._attn_implementation == hf.IMPLEMENTATION
        torch.testing.assert_close(real(output(net, ids, mask), mask), real(reference, mask), rtol=0, atol=1e-5)
        torch.testing.assert_close(output(net, ids, None), unpadded, rtol=0, atol=1e-5)


@pytest.mark.parametrize(("model", "name"), [(m, n) for m in MODELS for n in usable_in(m)])
def test_every_mechanism_trains_in_every_model(model, name):
    net = zoo_model(model, name)
    ids, mask = batch(model)
    out = output(net, ids, mask)
    assert torch.isfinite(real(out, mask)).all()
    real(out, mask).square().mean().backward()
    grads = {k: p.grad for k, p in net.named_parameters()}
    assert all(torch.isfinite(g).all() for g in grads.values() if g is not None)  # BERT's unused pooler has None
    assert grads[next(k for k in grads if "embed" in k or "wte" in k)] is not None
    zoo = {k: g for k, g in grads.items() if f".{hf.CORE_ATTRIBUTE}." in k or k.startswith(hf.SHARED_ATTRIBUTE)}
    # a core with parameters (Linformer's E, F; Nystrom's conv) is a real submodule: it trains
    assert all(g is not None and g.abs().sum() > 0 for g in zoo.values()), [k for k, g in zoo.items() if g is None]


def test_attention_is_a_spec_string_a_spec_or_a_name_with_keywords():
    cores = lambda net: [
        (m.zoo_core.name, m.zoo_core.num_landmarks, m.zoo_core.pinv) for _, m in hf.attention_layers(net)
    ]
    by_string = hf.use_attention(build("bert"), "nystrom:num_landmarks=4:pinv=exact")
    by_spec = hf.use_attention(build("bert"), az.AttentionSpec("nystrom", {"num_landmarks": 4, "pinv": "exact"}))
    by_keywords = hf.use_attention(build("bert"), "nystrom", num_landmarks=4, pinv="exact")
    mixed = hf.use_attention(build("bert"), "nystrom:num_landmarks=4", pinv="exact")
    assert cores(by_string) == cores(by_spec) == cores(by_keywords) == cores(mixed) == [("nystrom", 4, "exact")] * 2
    assert getattr(by_string.config, hf.CONFIG_ATTRIBUTE)["options"] == {"num_landmarks": 4, "pinv": "exact"}


def test_a_bad_spec_is_refused_in_one_line_before_any_layer_changes():
    net = build("bert")
    with pytest.raises(ValueError, match=r"option\(s\) k given both in the spec and as keywords"):
        hf.use_attention(net, "linformer:k=16", k=32)
    with pytest.raises(ValueError, match="attention 'linformer' has no option 'kk'; valid options: k: "):
        hf.use_attention(net, "linformer:kk=16")
    assert not any(hasattr(m, hf.CORE_ATTRIBUTE) for _, m in hf.attention_layers(net))


def test_core_parameters_are_submodules_of_their_layers():
    net = hf.use_attention(build("bert"), "nystrom", num_landmarks=4, conv_kernel_size=3)
    core_parameters = [p for _, layer in hf.attention_layers(net) for p in layer.zoo_core.parameters()]
    assert core_parameters and {id(p) for p in core_parameters} <= {id(p) for p in net.parameters()}
    keys = [k for k in net.state_dict() if f".{hf.CORE_ATTRIBUTE}." in k]
    assert keys and all(k.startswith("encoder.layer.") for k in keys)


def test_attention_dropout_is_not_applied_and_says_so(caplog):
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=MAX_LEN, n_embd=32, n_layer=1, n_head=4, attn_pdrop=0.25)
    net = hf.use_attention(AutoModelForCausalLM.from_config(config), "full").train()
    with caplog.at_level("WARNING", logger=hf.__name__):
        net(input_ids=torch.randint(0, VOCAB, (1, 8)))
    assert "p=0.25 is not applied" in caplog.text


@pytest.mark.parametrize("model", CAUSAL_MODELS)
def test_decoder_rule_picks_causal_counterparts(model):
    net = hf.use_attention(build(model), "linformer", k=16, decoder_options={"block_size": 8, "block_k": 2})
    cores = [m.zoo_core for _, m in hf.attention_layers(net)]
    assert [c.name for c in cores] == ["linformer_causal"] * 2 and cores[0].context.num_layers == 2
    assert cores[0].block_size == 8
    assert {m.zoo_core.name for _, m in hf.attention_layers(hf.use_attention(build(model), "nystrom"))} == {"full"}


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("name", SHARED_QK)
def test_shared_qk_cores_are_refused_with_the_reason(model, name):
    with pytest.raises(ValueError, match="shared projection for queries and keys"):
        hf.use_attention(build(model), name)


@pytest.mark.parametrize("name", CAUSAL_ONLY)
def test_causal_only_cores_are_refused_by_bidirectional_models_in_one_line(name):
    with pytest.raises(ValueError, match=f"bidirectional attention layers and attention {name!r} is causal only"):
        hf.use_attention(build("bert"), name)


@pytest.mark.parametrize("name", usable_in("bert"))
def test_bert_padding_never_reaches_real_outputs(name):
    net = zoo_model("bert", name)
    ids, mask = batch("bert")
    changed = ids.masked_fill(~mask.bool(), 5)
    with torch.no_grad():
        torch.testing.assert_close(
            real(output(net, changed, mask), mask), real(output(net, ids, mask), mask), rtol=0, atol=1e-5
        )


@pytest.mark.parametrize("name", USABLE)
@pytest.mark.parametrize("model", CAUSAL_MODELS)
def test_causal_models_never_see_the_future(model, name):
    net = zoo_model(model, name)
    ids, _ = batch(model)
    later = 20
    changed = ids.clone()
    changed[:, later:] = (ids[:, later:] + 7) % VOCAB
    with torch.no_grad():
        before, after = output(net, ids, None), output(net, changed, None)
    torch.testing.assert_close(after[:, :later], before[:, :later], rtol=0, atol=1e-5)
    assert (after[:, later:] - before[:, later:]).abs().max() > 1e-4  # the change itself is seen


@pytest.mark.parametrize("name", USABLE)
@pytest.mark.parametrize("model", CAUSAL_MODELS)
def test_cached_generation_equals_recomputation(model, name):
    # transformers' cache hands the core only the new queries: the scores must be those of the full causal forward
    net = zoo_model(model, name)
    ids, mask = batch(model)
    prompt, prompt_mask = ids[:, :20], mask[:, :20]
    kwargs = dict(max_new_tokens=6, do_sample=False, output_scores=True, return_dict_in_generate=True, pad_token_id=0)
    with torch.no_grad():
        cached = net.generate(prompt, attention_mask=prompt_mask, use_cache=True, **kwargs)
        recomputed = net.generate(prompt, attention_mask=prompt_mask, use_cache=False, **kwargs)
    assert torch.equal(cached.sequences, recomputed.sequences)
    torch.testing.assert_close(torch.stack(cached.scores), torch.stack(recomputed.scores), rtol=0, atol=1e-4)


@pytest.mark.parametrize("model", CAUSAL_MODELS)
def test_greedy_generation_with_full_equals_sdpa(model):
    net = build(model)
    ids, mask = batch(model)
    kwargs = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        reference = net.generate(ids[:, :16], attention_mask=mask[:, :16], **kwargs)
        hf.use_attention(net, "full")
        assert torch.equal(net.generate(ids[:, :16], attention_mask=mask[:, :16], **kwargs), reference)


@pytest.mark.parametrize(
    ("model", "name", "options"),
    [
        ("bert", "linformer", {"k": 16}),
        ("bert", "linformer", {"k": 8, "sharing": "kv"}),
        ("bert", "linformer", {"k": 8, "sharing": "layerwise"}),
        ("llama", "linformer", {"k": 16, "decoder_options": {"block_size": 8, "block_k": 4, "sharing": "layerwise"}}),
        ("gpt2", "performer", {"nb_features": 16, "chunk_size": 8}),
        ("bart", "local", {"window": 4, "cross_attention": "linformer", "cross_options": {"k": 8}}),
    ],
)
def test_save_and_reload_round_trips_zoo_parameters(tmp_path, model, name, options):
    net = hf.use_attention(build(model), name, **options)
    with torch.no_grad():
        for key, tensor in net.state_dict().items():
            if hf.CORE_ATTRIBUTE in key or hf.SHARED_ATTRIBUTE in key:
                tensor.add_(torch.rand_like(tensor) if tensor.is_floating_point() else 1)  # not the init values
    net.save_pretrained(tmp_path)
    loader = AutoModelForCausalLM if model in CAUSAL_MODELS else AutoModelForSeq2SeqLM if model == "bart" else AutoModel
    reloaded = hf.from_pretrained(loader, tmp_path)  # the spec comes from the saved config
    saved, loaded = net.state_dict(), reloaded.state_dict()
    assert saved.keys() == loaded.keys() and any(hf.CORE_ATTRIBUTE in k for k in saved)
    assert all(torch.equal(saved[k], loaded[k]) for k in saved)
    ids, mask = batch(model)
    with torch.no_grad():
        assert torch.equal(output(reloaded, ids, mask), output(net, ids, mask))


def test_reloading_takes_a_spec_string(tmp_path):
    net = hf.use_attention(build("bert"), "linformer:k=16")
    net.save_pretrained(tmp_path)
    loaded = hf.from_pretrained(AutoModel, tmp_path, "linformer:k=16")
    assert {m.zoo_core.k for _, m in hf.attention_layers(loaded)} == {16}
    for (_, a), (_, b) in zip(hf.attention_layers(net), hf.attention_layers(loaded), strict=True):
        assert all(
            torch.equal(x, y)
            for x, y in zip(a.zoo_core.state_dict().values(), b.zoo_core.state_dict().values(), strict=True)
        )


def test_reloading_with_other_options_is_refused(tmp_path):
    hf.use_attention(build("bert"), "linformer", k=16).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="shape"):
        hf.from_pretrained(AutoModel, tmp_path, "linformer", k=8)
    with pytest.raises(ValueError, match="missing"):
        hf.from_pretrained(AutoModel, tmp_path, "nystrom", num_landmarks=4, conv_kernel_size=3)


def test_split_mask_reads_padding_and_causality():
    key_mask = torch.tensor([[True] * 5, [False, False, True, True, True]])
    visible = torch.ones(5, 5, dtype=torch.bool).tril()
    causal = key_mask[:, None, None, :] & visible
    assert hf.split_mask(None, 5, 5, default_causal=True) == (None, True)
    found, is_causal = hf.split_mask(causal, 5, 5, default_causal=False)
    assert is_causal and torch.equal(found, key_mask)
    found, is_causal = hf.split_mask(key_mask[:, None, None, :].expand(2, 1, 5, 5), 5, 5, default_causal=True)
    assert not is_causal and torch.equal(found, key_mask)
    additive = torch.zeros(2, 1, 5, 5).masked_fill(~causal, torch.finfo(torch.float32).min)
    assert hf.split_mask(additive, 5, 5, default_causal=False)[1]
    window = causal & torch.ones(5, 5, dtype=torch.bool).triu(-1)  # a sliding window of 2
    with pytest.raises(ValueError, match="not padding, nor padding plus causal"):
        hf.split_mask(window, 5, 5, default_causal=True)
    with pytest.raises(ValueError, match="additive bias"):
        hf.split_mask(additive + 0.5, 5, 5, default_causal=True)


def test_a_custom_4d_mask_that_is_not_padding_plus_causal_nor_packed_is_refused():
    # packed documents (a block-diagonal mask) are read as segments: test_transformers_packed.py
    net = hf.use_attention(build("gpt2"), "full")
    ids, _ = batch("gpt2")
    window = torch.ones(N, N, dtype=torch.bool).tril() & torch.ones(N, N, dtype=torch.bool).triu(-3)
    with pytest.raises(ValueError, match="not padding, nor padding plus causal .*, nor packed documents"):
        net(input_ids=ids, attention_mask=window.expand(2, 1, N, N))


def test_sliding_window_layers_are_refused():
    config = MistralConfig(
        **TINY, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        sliding_window=8,
    )  # fmt: skip
    net = hf.use_attention(AutoModelForCausalLM.from_config(config), "full")
    with pytest.raises(ValueError, match="sliding_window"):
        net(input_ids=torch.randint(0, VOCAB, (1, 16)))


# encoder-decoder models: cross-attention keeps the model's own implementation unless cross_attention names a core

CROSS_ATTENTION = {"bart": "encoder_attn", "t5gemma": "cross_attn"}  # what each model calls its cross-attention


def seq2seq_batch(seed: int = 1) -> dict[str, torch.Tensor]:
    """A source of 12 tokens (the second row padded by 3) and a target of 7: cross-attention has 7 queries for 12
    keys."""
    generator = torch.Generator().manual_seed(seed)
    source = torch.randint(3, VOCAB, (2, 12), generator=generator)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, -3:] = 0
    return dict(
        input_ids=source, attention_mask=mask, decoder_input_ids=torch.randint(3, VOCAB, (2, 7), generator=generator)
    )


def generate(net: PreTrainedModel, use_cache: bool = True) -> Any:
    inputs = seq2seq_batch()
    return net.generate(
        inputs["input_ids"], attention_mask=inputs["attention_mask"], max_new_tokens=5, min_new_tokens=5,
        do_sample=False, use_cache=use_cache, output_scores=True, return_dict_in_generate=True,
    )  # fmt: skip


@pytest.mark.parametrize("model", list(ENCODER_DECODERS))
def test_cross_attention_keeps_the_models_own_implementation(model):
    net = hf.use_attention(build(model), "local", window=4)
    layers = hf.attention_layers(net)
    assert [hasattr(m, hf.CORE_ATTRIBUTE) for p, m in layers if p.endswith(CROSS_ATTENTION[model])] == [False] * 2
    assert all(hasattr(m, hf.CORE_ATTRIBUTE) for p, m in layers if not p.endswith(CROSS_ATTENTION[model]))
    with torch.no_grad():
        logits = net(**seq2seq_batch()).logits
        cached, recomputed = generate(net), generate(net, use_cache=False)
    assert logits.shape == (2, 7, VOCAB) and torch.isfinite(logits).all()
    assert cached.sequences.shape[1] == 6 and torch.equal(cached.sequences, recomputed.sequences)
    torch.testing.assert_close(torch.stack(cached.scores), torch.stack(recomputed.scores), rtol=0, atol=1e-4)


@pytest.mark.parametrize("model", list(ENCODER_DECODERS))
def test_encoder_decoders_with_full_self_attention_match_the_unswapped_model(model):
    # BART's cross-attention stays on sdpa, T5Gemma's on eager (its bool mask made additive as transformers does)
    net = build(model)
    with torch.no_grad():
        reference, reference_generated = net(**seq2seq_batch()).logits, generate(net).sequences
        hf.use_attention(net, "full")
        torch.testing.assert_close(net(**seq2seq_batch()).logits, reference, rtol=0, atol=1e-5)
        assert torch.equal(generate(net).sequences, reference_generated)


def test_bart_cross_attention_gives_exactly_sdpa_outputs_beside_a_local_core():
    net, reference = hf.use_attention(build("bart"), "local", window=4), build("bart")
    seen: dict[str, Any] = {}
    net.model.decoder.layers[1].encoder_attn.register_forward_hook(
        lambda module, args, kwargs, out: seen.update(args=args, kwargs=kwargs, out=out[0]), with_kwargs=True
    )
    with torch.no_grad():
        net(**seq2seq_batch(), use_cache=False)
        expected = reference.model.decoder.layers[1].encoder_attn(*seen["args"], **seen["kwargs"])[
            0
        ]  # the same inputs, on sdpa
    assert seen["kwargs"]["key_value_states"].shape[1] == 12 and torch.equal(seen["out"], expected)


def test_cross_attention_can_run_a_zoo_core_that_supports_it():
    net = hf.use_attention(build("bart"), "local", window=4, cross_attention="linear")
    assert [m.zoo_core.name for p, m in hf.attention_layers(net) if p.endswith("encoder_attn")] == ["linear"] * 2
    inputs = seq2seq_batch()
    changed = dict(inputs, input_ids=inputs["input_ids"].masked_fill(~inputs["attention_mask"].bool(), 5))
    with torch.no_grad():
        # padding of the source never reaches the decoder through the core's key mask
        torch.testing.assert_close(net(**changed).logits, net(**inputs).logits, rtol=0, atol=1e-5)
        cached, recomputed = generate(net), generate(net, use_cache=False)
    assert torch.equal(cached.sequences, recomputed.sequences)
    torch.testing.assert_close(torch.stack(cached.scores), torch.stack(recomputed.scores), rtol=0, atol=1e-4)
    hf.use_attention(net, "full")  # applied again without cross_attention: the cross cores go
    assert not any(hasattr(m, hf.CORE_ATTRIBUTE) for p, m in hf.attention_layers(net) if p.endswith("encoder_attn"))


def test_a_cross_attention_core_that_cannot_attend_another_sequence_is_refused_by_name():
    with pytest.raises(ValueError, match="cross_attention 'local' cannot .*; cross-attention cores: full, ") as error:
        hf.use_attention(build("bart"), "full", cross_attention="local", cross_options={"window": 4})
    assert "\n" not in str(error.value)


def t5() -> PreTrainedModel:
    torch.manual_seed(0)
    config = T5Config(vocab_size=VOCAB, d_model=32, d_ff=64, d_kv=8, num_layers=2, num_heads=4, dropout_rate=0.0)
    return AutoModelForSeq2SeqLM.from_config(config, attn_implementation="sdpa").eval()


def test_t5_cross_attention_gets_no_core():
    cores = {path: hasattr(m, hf.CORE_ATTRIBUTE) for path, m in hf.attention_layers(hf.use_attention(t5(), "full"))}
    assert {path.rsplit(".", 1)[1] for path, has in cores.items() if has} == {"SelfAttention"}
    assert [has for path, has in cores.items() if path.endswith("EncDecAttention")] == [False] * 2


def test_t5_position_bias_is_refused_in_one_line_naming_it():
    net = hf.use_attention(t5(), "full")
    with pytest.raises(ValueError, match=r"with position_bias \(a tensor of shape \(1, 4, 12, 12\)\)") as error:
        net(**seq2seq_batch())
    assert "\n" not in str(error.value) and len(str(error.value)) < 200


@pytest.mark.parametrize("model", ["llama", "t5gemma"])
def test_a_config_shared_with_another_model_stays_that_models(model):
    config, loader = (
        (llama_config(), AutoModelForCausalLM) if model == "llama" else (t5gemma_config(), AutoModelForSeq2SeqLM)
    )
    torch.manual_seed(0)
    other, zoo = loader.from_config(config).eval(), loader.from_config(config).eval()
    assert other.config is zoo.config  # transformers keeps the config object it is given
    own = other.config._attn_implementation
    inputs = seq2seq_batch() if model == "t5gemma" else {"input_ids": batch(model)[0]}
    with torch.no_grad():
        before = other(**inputs).logits
        hf.use_attention(zoo, "local", window=4)
        after = other(**inputs).logits
        zoo(**inputs)
    assert torch.equal(after, before)
    other_configs = [v for m in other.modules() for v in vars(m).values() if isinstance(v, PreTrainedConfig)]
    zoo_configs = [v for m in zoo.modules() for v in vars(m).values() if isinstance(v, PreTrainedConfig)]
    assert {c._attn_implementation for c in other_configs} == {own}  # sub-configs (T5Gemma's encoder, decoder) too
    assert {c._attn_implementation for c in zoo_configs} == {hf.IMPLEMENTATION}
    assert not {id(c) for c in zoo_configs} & {id(c) for c in other_configs}


def test_a_core_replaced_in_causal_layers_is_a_warning_naming_what_runs(caplog):
    with caplog.at_level("WARNING", logger=hf.__name__):
        hf.use_attention(build("gpt2"), "nystrom", num_landmarks=4)
    [message] = [r.getMessage() for r in caplog.records if r.name == hf.__name__ and r.levelname == "WARNING"]
    assert "layers run full" in message and "not nystrom" in message and "options dropped: num_landmarks=4" in message
