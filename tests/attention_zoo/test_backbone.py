from __future__ import annotations

import pytest
import torch

import attention_zoo as az
from attention_zoo.core import AttentionCore
from attention_zoo.masks import pad_mask


def encoder(**kw):
    torch.manual_seed(0)
    defaults = dict(vocab_size=50, dim=32, depth=2, heads=4, max_seq_len=24)
    return az.TransformerEncoder(az.ModelConfig(**{**defaults, **kw})).eval()


@pytest.mark.parametrize("positional", ["learned", "sinusoidal"])
def test_encoder_shape_and_padding(positional):
    model = encoder(positional=positional).double()
    tokens = torch.randint(0, 50, (2, 20))
    mask = pad_mask(torch.tensor([20, 12]), 20)
    out = model(tokens, mask)
    assert out.shape == (2, 20, 32)
    changed = tokens.clone()
    changed[1, 12:] = (changed[1, 12:] + 7) % 50
    torch.testing.assert_close(model(changed, mask)[1, :12], out[1, :12], rtol=0, atol=1e-9)


def test_encoder_rejects_too_long_input():
    with pytest.raises(ValueError, match="exceeds max_seq_len=24"):
        encoder()(torch.randint(0, 50, (1, 25)))


def test_every_layer_has_its_own_core_and_the_shared_state_is_one_module():
    model = encoder(depth=3)
    cores = [layer.attn.core for layer in model.layers]
    assert len({id(c) for c in cores}) == 3
    assert [c.context.layer_index for c in cores] == [0, 1, 2]
    assert all(c.context.shared is model.shared_attention_state for c in cores)


def test_decoder_is_causal_and_uses_memory():
    torch.manual_seed(0)
    model = (
        az.TransformerDecoder(az.ModelConfig(vocab_size=50, dim=32, depth=2, heads=4, max_seq_len=16)).eval().double()
    )
    memory = torch.randn(2, 9, 32, dtype=torch.float64)
    memory_mask = pad_mask(torch.tensor([9, 5]), 9)
    tokens = torch.randint(0, 50, (2, 12))
    out = model(tokens, memory, memory_mask=memory_mask)
    assert out.shape == (2, 12, 32)
    later = tokens.clone()
    later[:, 7:] = (later[:, 7:] + 1) % 50
    torch.testing.assert_close(model(later, memory, memory_mask=memory_mask)[:, :7], out[:, :7], rtol=0, atol=1e-9)
    padded_memory = memory.clone()
    padded_memory[1, 5:] += 3.0
    torch.testing.assert_close(model(tokens, padded_memory, memory_mask=memory_mask), out, rtol=0, atol=1e-9)
    assert not torch.allclose(model(tokens, memory + 1.0, memory_mask=memory_mask), out)


def test_multihead_validates_capabilities(scratch_registry):

    @az.register_attention("no_causal_no_cross")
    class Limited(AttentionCore):
        approximation = "none"
        supports_causal = False
        supports_cross_attention = False

    with pytest.raises(ValueError, match="does not support causal attention. Causal cores: .*full"):
        az.MultiHeadAttention(16, 2, attention="no_causal_no_cross", causal=True)
    with pytest.raises(ValueError, match="does not support cross-attention; cores that do: .*full"):
        az.MultiHeadAttention(16, 2, attention="no_causal_no_cross", cross_attention=True)
    config = az.ModelConfig(vocab_size=10, dim=16, depth=1, heads=2, max_seq_len=8, attention="no_causal_no_cross")
    with pytest.raises(ValueError, match="'no_causal_no_cross' is not causal and declares no causal_counterpart"):
        az.TransformerDecoder(config)


def test_shared_qk_cores_get_one_projection(scratch_registry):

    @az.register_attention("shared_qk_probe")
    class SharedQK(AttentionCore):
        approximation = "hashing"
        needs_shared_qk = True

        def attend(self, q, k, v, *, mask, causal):
            assert q is k
            return v

    block = az.MultiHeadAttention(16, 2, attention="shared_qk_probe")
    assert hasattr(block, "to_qk") and not hasattr(block, "to_q")
    assert block(torch.randn(2, 5, 16)).shape == (2, 5, 16)


def test_attention_options_reach_the_core():
    model = encoder(attention="full:backend=math")
    assert all(layer.attn.core.backend == "math" for layer in model.layers)
    with pytest.raises(ValueError, match="no option 'k'"):
        encoder(attention="full:k=4")


def test_block_checks_memory_argument():
    block = az.MultiHeadAttention(16, 2)
    with pytest.raises(ValueError, match="self-attention"):
        block(torch.randn(1, 3, 16), torch.randn(1, 4, 16))
    with pytest.raises(ValueError, match="not divisible"):
        az.MultiHeadAttention(15, 2)
