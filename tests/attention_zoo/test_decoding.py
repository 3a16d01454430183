"""Incremental decoding of the encoder-decoder (``attention_zoo.seq2seq``, ``attention_zoo.decoding.search``): the
decoder rule, the cache against recomputation over the registry, beam search against a hand-worked
example, and the cross-attention memory projected once."""

from __future__ import annotations

import math

import pytest
import torch

import attention_zoo as az
from attention_zoo.config import ModelConfig
from attention_zoo.decoding.search import beam_search, greedy_search, length_penalty, max_lengths
from attention_zoo.masks import pad_mask
from attention_zoo.nystrom.attention import NystromAttention
from attention_zoo.seq2seq import Seq2SeqTransformer, causal_cores, resolve_decoder_attention

PAD, BOS, EOS = 0, 1, 2
VOCAB = 40


def tiny_model(*, eos_scale: float | None = None, **options) -> Seq2SeqTransformer:
    """A float64 model of two layers. ``eos_scale`` scales the EOS embedding (tied to the output projection):
    3 makes untrained decoding stop at varied lengths, 0 (logit 0, below the best of 39 random logits)
    never stop before the limit."""
    torch.manual_seed(0)
    sizes = dict(dim=32, depth=2, heads=4, dropout=0.0)
    config = ModelConfig(vocab_size=VOCAB, max_seq_len=16, max_target_len=20, **(sizes | options))
    model = Seq2SeqTransformer(config).double().eval()
    if eos_scale is not None:
        with torch.no_grad():
            model.decoder.token_embedding.weight[EOS] *= eos_scale
    return model


def sources(lengths=(16, 11, 5, 8)) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    mask = pad_mask(torch.tensor(lengths), max(lengths))
    tokens = torch.randint(3, VOCAB, mask.shape).masked_fill(~mask, PAD)
    return tokens, mask


IDS = dict(bos_id=BOS, eos_id=EOS, pad_id=PAD)


# --- the decoder rule -----------------------------------------------------------------------------------


def test_decoder_rule_uses_the_mechanism_when_it_is_causal():
    rule = resolve_decoder_attention("local", {"window": 8})
    assert (rule.attention, rule.options) == ("local", {"window": 8})
    rule = resolve_decoder_attention("local", {"window": 8}, decoder_attention_options={"window": 4})
    assert rule.options == {"window": 4} and "decoder_attention_options" in rule.reason


def test_decoder_rule_uses_the_declared_causal_counterpart():
    rule = resolve_decoder_attention("linformer", {"k": 32})
    assert (rule.attention, rule.options) == ("linformer_causal", {})  # k belongs to linformer, not to it
    assert "causal_counterpart linformer_causal" in rule.reason
    assert resolve_decoder_attention("nystrom", {"num_landmarks": 8}).attention == "full"
    options = {"block_size": 8, "block_k": 2}
    assert resolve_decoder_attention("linformer", {}, None, options).options == options


def test_decoder_rule_error_lists_the_causal_cores(monkeypatch):
    with pytest.raises(ValueError, match="decoder_attention 'nystrom' is not causal") as error:
        resolve_decoder_attention("full", None, "nystrom")
    assert all(name in str(error.value) for name in causal_cores())
    monkeypatch.setattr(NystromAttention, "causal_counterpart", None)
    with pytest.raises(ValueError, match="declares no causal_counterpart") as error:
        resolve_decoder_attention("nystrom")
    assert all(name in str(error.value) for name in causal_cores())


def test_every_non_causal_core_declares_a_registered_causal_counterpart():
    """So that ``--model.attention NAME`` alone builds a decoder for every registered NAME."""
    for name in az.list_attentions():
        cls = az.get_attention_class(name)
        if not cls.supports_causal:
            assert cls.causal_counterpart in az.list_attentions(), name
            assert az.get_attention_class(cls.causal_counterpart).supports_causal, name


def test_shared_vocabulary_ties_all_three_matrices_and_a_target_vocabulary_ties_two():
    shared = tiny_model()
    assert shared.decoder.token_embedding.weight is shared.encoder.token_embedding.weight
    sizes = dict(vocab_size=VOCAB, max_seq_len=16, max_target_len=20, target_vocab_size=25, dim=32, depth=1, heads=4)
    separate = Seq2SeqTransformer(ModelConfig(**sizes))
    assert separate.decoder.token_embedding.weight is not separate.encoder.token_embedding.weight
    source, mask = sources()
    logits = separate(source, mask, torch.randint(0, 25, (4, 6)))
    assert logits.shape == (4, 6, 25)
    expected = separate.decoder(torch.randint(0, 25, (4, 6)), separate.encode(source, mask), None, mask)
    torch.testing.assert_close(separate.output_logits(expected), expected @ separate.decoder.token_embedding.weight.T)


# --- incremental decoding equals the full forward --------------------------------------------------------


@pytest.mark.parametrize("chunks", [(1,) * 12, (5, 1, 6)])
def test_decoder_fed_in_pieces_equals_its_forward(chunks):
    model = tiny_model(positional="sinusoidal")
    source, mask = sources()
    memory = model.encode(source, mask)
    tokens = torch.randint(3, VOCAB, (4, sum(chunks)))
    full = model.decoder(tokens, memory, None, mask)
    state = model.decoder.start_decoding(memory, mask)
    pieces, start = [], 0
    for size in chunks:
        pieces.append(model.decoder.decode(tokens[:, start : start + size], state))
        start += size
    assert state.length == sum(chunks)
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=0, atol=1e-10)


def test_hypotheses_of_one_source_share_its_memory():
    """G hypotheses per source attend to the source's memory, projected once, as if it were repeated."""
    model = tiny_model()
    source, mask = sources()
    memory = model.encode(source, mask)
    tokens = torch.randint(3, VOCAB, (4 * 3, 7))
    repeated = model.decoder(tokens, memory.repeat_interleave(3, 0), None, mask.repeat_interleave(3, 0))
    state = model.decoder.start_decoding(memory, mask, hypotheses_per_source=3)
    torch.testing.assert_close(model.decoder.decode(tokens, state), repeated, rtol=0, atol=1e-10)


def test_reorder_keeps_hypotheses_with_their_source():
    model = tiny_model()
    source, mask = sources()
    state = model.decoder.start_decoding(model.encode(source, mask), mask, hypotheses_per_source=2)
    model.decoder.decode(torch.randint(3, VOCAB, (8, 2)), state)
    state.reorder(torch.tensor([1, 1, 2, 3, 5, 4, 6, 6]))
    with pytest.raises(ValueError, match="moves a hypothesis to another source"):
        state.reorder(torch.tensor([2, 1, 2, 3, 5, 4, 6, 6]))


# --- search ---------------------------------------------------------------------------------------------


def causal_configs():
    for name in az.list_attentions():
        cls = az.get_attention_class(name)
        if cls.supports_causal:
            for i, options in enumerate(cls.example_configs):
                yield pytest.param(name, options, id=f"{name}-{i}")


@pytest.mark.parametrize(("attention", "options"), list(causal_configs()))
def test_cached_and_recomputed_decoding_give_the_same_tokens_for_every_causal_core(attention, options):
    model = tiny_model(decoder_attention=az.AttentionSpec(attention, options), eos_scale=3.0)
    source, mask = sources()
    for search, kwargs in ((greedy_search, {}), (beam_search, {"beam_size": 3})):
        cached = search(model, source, mask, use_cache=True, **IDS, **kwargs)
        recomputed = search(model, source, mask, use_cache=False, **IDS, **kwargs)
        assert torch.equal(cached.tokens, recomputed.tokens), search.__name__
        torch.testing.assert_close(cached.scores, recomputed.scores, rtol=0, atol=1e-9)


def test_linformer_cross_attention_on_short_padded_sources_decodes_the_same_cached():
    """Linformer projects the memory with E, F sized for max_source_len = 16 and slices them for shorter
    sources; the cached path projects it once, the recomputed path at every step."""
    model = tiny_model(cross_attention="linformer:k=4", eos_scale=3.0)
    source, mask = sources((9, 6, 3, 7))
    cached = greedy_search(model, source, mask, use_cache=True, **IDS)
    recomputed = greedy_search(model, source, mask, use_cache=False, **IDS)
    assert torch.equal(cached.tokens, recomputed.tokens)


def test_beam_of_one_is_greedy():
    model = tiny_model(eos_scale=3.0)
    source, mask = sources()
    greedy = greedy_search(model, source, mask, **IDS)
    beam = beam_search(model, source, mask, beam_size=1, alpha=0.6, **IDS)
    assert torch.equal(beam.tokens, greedy.tokens)
    lengths = (greedy.tokens != PAD).sum(dim=1)
    expected = greedy.scores / torch.tensor([length_penalty(int(n), 0.6) for n in lengths], dtype=torch.float64)
    torch.testing.assert_close(beam.scores, expected)
    assert (greedy.tokens == EOS).any(), "the fixture should stop some sequences at EOS"


def test_outputs_stop_at_eos_or_at_source_length_plus_extra_capped_by_max_target_len():
    model = tiny_model(eos_scale=3.0)
    source, mask = sources((16, 11, 5, 8))
    limits = max_lengths(source, mask, model.max_target_len, extra_len=4)
    assert limits.tolist() == [20, 15, 9, 12]  # 16 + 4, 11 + 4, ... capped by max_target_len = 20
    for search in (greedy_search, beam_search):
        tokens = search(model, source, mask, extra_len=4, **IDS).tokens
        for row, limit in zip(tokens.tolist(), limits.tolist(), strict=True):
            length = row.index(EOS) + 1 if EOS in row else len([t for t in row if t != PAD])
            assert length <= limit
            assert EOS in row or length == limit  # no EOS: it ran to its limit
            assert all(t == PAD for t in row[length:]) and PAD not in row[:length] and BOS not in row[:length]


class FixedModel:
    """A fake model whose next-token distribution depends only on the prefix (BOS dropped), given as
    probabilities over the tokens a, b and EOS (every other token: probability 0). Tokens: a = 3, b = 4."""

    max_target_len = 10
    TABLE = {
        (): {"a": 0.6, "b": 0.4},
        ("a",): {"a": 0.45, "b": 0.30, "EOS": 0.25},
        ("b",): {"a": 0.05, "b": 0.05, "EOS": 0.9},
        ("a", "a"): {"EOS": 1.0},
        ("a", "b"): {"a": 0.25, "b": 0.25, "EOS": 0.5},
    }
    NAMES = {"a": 3, "b": 4, "EOS": EOS}

    def start_decoding(self, source, source_mask, *, hypotheses_per_source, use_cache):
        return self

    def next_log_probs(self, prefix: torch.Tensor) -> torch.Tensor:
        rows = []
        for row in prefix[:, 1:].tolist():
            names = tuple({3: "a", 4: "b"}.get(t, "?") for t in row)
            probabilities = torch.zeros(5, dtype=torch.float64)
            for name, p in self.TABLE.get(names, {"EOS": 1.0}).items():
                probabilities[self.NAMES[name]] = p
            rows.append(probabilities.log())
        return torch.stack(rows)

    def reorder(self, index: torch.Tensor) -> None:
        pass


def test_beam_search_by_hand():
    """Worked from the definition (module docstring of attention_zoo.decoding.search), beam size 2:

    greedy: a (0.6), then a (0.45), then EOS (1.0): "a a EOS", P = 0.27.
    beam, step 1: candidates a 0.6, b 0.4 -> live {a, b}.
    step 2: b EOS 0.36, a a 0.27, a b 0.18, a EOS 0.15, ... -> the best two are "b EOS" (finished, |Y| = 2)
        and "a a"; live = the best two without EOS: {a a, a b}.
    step 3: a a EOS 0.27, a b EOS 0.09, a b a 0.045, ... -> both best two end in EOS: finished, 3 >= 2: done.
    alpha = 0: s = log P: "b EOS" log 0.36 = -1.022 beats "a a EOS" log 0.27 = -1.309 (greedy's choice).
    alpha = 3: lp(2) = (7/6)^3 = 1.588, lp(3) = (8/6)^3 = 2.370: "b EOS" -0.643, "a a EOS" -0.552: a a wins.
    """
    source, mask = torch.ones(1, 3, dtype=torch.long), None
    greedy = greedy_search(FixedModel(), source, mask, **IDS)
    assert greedy.tokens.tolist() == [[3, 3, EOS]]
    assert greedy.scores.item() == pytest.approx(math.log(0.27))
    plain = beam_search(FixedModel(), source, mask, beam_size=2, alpha=0.0, **IDS)
    assert plain.tokens.tolist() == [[4, EOS]]
    assert plain.scores.item() == pytest.approx(math.log(0.36))
    long = beam_search(FixedModel(), source, mask, beam_size=2, alpha=3.0, **IDS)
    assert long.tokens.tolist() == [[3, 3, EOS]]
    assert long.scores.item() == pytest.approx(math.log(0.27) / (8 / 6) ** 3)


# --- the memory is projected once per source ------------------------------------------------------------


def test_cross_attention_memory_is_projected_once_per_source():
    model = tiny_model(eos_scale=0.0)
    source, mask = sources()
    calls = {"k": 0, "v": 0}
    for layer in model.decoder.layers:
        for name in calls:
            projection = getattr(layer.cross_attn, f"to_{name}")
            projection.register_forward_hook(lambda *_, name=name: calls.__setitem__(name, calls[name] + 1))
    for search, kwargs in ((greedy_search, {}), (beam_search, {"beam_size": 3})):
        calls.update(k=0, v=0)
        decoded = search(model, source, mask, use_cache=True, **IDS, **kwargs)
        assert decoded.tokens.shape[1] == 20  # 20 steps (the untrained model never says EOS here)
        assert calls == {"k": 2, "v": 2}  # once per layer, not once per step
    calls.update(k=0, v=0)
    greedy_search(model, source, mask, use_cache=False, **IDS)
    assert calls == {"k": 2 * 20, "v": 2 * 20}  # the reference recomputes it at every step


# --- what attend_memory relies on -----------------------------------------------------------------------


def cross_configs():
    for name in az.list_attentions():
        cls = az.get_attention_class(name)
        if cls.supports_cross_attention and cls.position_free_queries:
            for i, options in enumerate(cls.example_configs):
                yield pytest.param(name, options, id=f"{name}-{i}")


@pytest.mark.parametrize(("attention", "options"), list(cross_configs()))
def test_cross_attention_queries_are_independent(attention, options):
    """Stacking several hypotheses' queries on one source row (beam search) is exact only if a query's
    output depends on no other query: every core that supports cross-attention must have this property."""
    torch.manual_seed(0)
    core = az.create_attention(attention, dim_head=8, heads=2, max_seq_len=64, **options).double().eval()
    q = torch.randn(2, 2, 6, 8, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 24, 8, dtype=torch.float64) for _ in range(2))
    mask = pad_mask(torch.tensor([24, 17]), 24)
    together = core(q, k, v, mask=mask)
    for i in range(6):
        alone = core(q[:, :, i : i + 1], k, v, mask=mask)
        torch.testing.assert_close(together[:, :, i : i + 1], alone, rtol=0, atol=1e-12)


def test_a_decoder_refuses_cross_attention_that_weights_queries_by_position():
    position_weighted = [n for n in az.list_attentions() if not az.get_attention_class(n).position_free_queries]
    assert "cosformer" in position_weighted
    for name in position_weighted:
        with pytest.raises(ValueError, match=f"cross_attention={name!r} weights a query by its position.*use one of"):
            az.TransformerDecoder(
                ModelConfig(vocab_size=50, dim=16, depth=1, heads=2, max_seq_len=32, cross_attention=name)
            )
    # the property the refusal protects: cosformer's cross-attention output of a query depends on its index
    core = az.create_attention("cosformer", dim_head=8, heads=2, max_seq_len=64).double()
    q, k = torch.randn(1, 2, 3, 8, dtype=torch.float64), torch.randn(1, 2, 10, 8, dtype=torch.float64)
    assert not torch.allclose(core(q, k, k)[:, :, 2:], core(q[:, :, 2:], k, k))
