"""attention-zoo: efficient attention mechanisms behind one interface (pure PyTorch).

>>> import attention_zoo as az
>>> core = az.create_attention("full", dim_head=64, heads=8)
>>> model = az.TransformerEncoder(
...     az.ModelConfig(vocab_size=256, max_seq_len=512, dim=128, depth=2, heads=4, attention="linformer:k=32")
... )
>>> translator = az.Seq2SeqTransformer(az.ModelConfig(vocab_size=8000, max_seq_len=128, attention="linformer"))
>>> translator.decoder_rule.attention  # the decoder rule: linformer's causal counterpart
'linformer_causal'
"""

# importing each mechanism's module registers it
from attention_zoo import full, gated_deltanet, kernel, linformer, lsh, moba, nsa, nystrom, self_only, sparse  # noqa: F401
from attention_zoo.config import ModelConfig
from attention_zoo.core import AttentionCore, BuildContext, DoubleBackwardError, Geometry
from attention_zoo.decoding import beam_search, greedy_search
from attention_zoo.masks import allowed_mask, masked_softmax, pad_mask
from attention_zoo.mha import MultiHeadAttention
from attention_zoo.registry import (
    attention_options,
    create_attention,
    get_attention_class,
    list_attentions,
    register_attention,
)
from attention_zoo.seq2seq import Seq2SeqTransformer
from attention_zoo.spec import AttentionSpec
from attention_zoo.transformer import TransformerDecoder, TransformerEncoder

__all__ = [
    "AttentionCore",
    "AttentionSpec",
    "BuildContext",
    "DoubleBackwardError",
    "Geometry",
    "ModelConfig",
    "MultiHeadAttention",
    "Seq2SeqTransformer",
    "TransformerDecoder",
    "TransformerEncoder",
    "allowed_mask",
    "attention_options",
    "beam_search",
    "create_attention",
    "get_attention_class",
    "greedy_search",
    "list_attentions",
    "masked_softmax",
    "pad_mask",
    "register_attention",
]
