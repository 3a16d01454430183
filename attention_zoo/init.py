"""Weight initialisation of every model the library builds: √d-scaled embeddings, Xavier Linears, and residual
output projections scaled down by depth.

The convention combines Vaswani et al. 2017 (arXiv:1706.03762, section 3.4: embedding weights multiplied by √d)
with the residual scaling of GPT-2 (Radford et al. 2019, section 2.3):

    token and learned position embeddings E ~ N(0, 1/d), used as √d · E   (unit scale in the stream; sinusoids
                                                                           have unit amplitude)
    every Linear W ~ Xavier-uniform, b = 0              (q/k/v, feed-forward, task heads)
    W_out ← W_out / √R                                  the Linear that writes a residual branch back into the
                                                        stream, R = residual branches: 2 · depth in an encoder,
                                                        3 · depth in a decoder (self-attention, cross, feed-forward)
    LayerNorm γ = 1, β = 0

A tied output projection (``Seq2SeqTransformer``) uses E itself, so its logits have unit variance. Parameters of
an attention core itself (Linformer's E/F, Nystrom's convolution, Performer's features) keep the core's own
initialisation: :func:`init_transformer_` leaves every parameter an :class:`~attention_zoo.core.AttentionCore`
holds, including state the cores of a model share (Linformer's layerwise projection).

Why: the residual stream must differ from position to position at initialisation, or every attention pattern
gives nearly the same output and every mechanism looks "on par". √d-scaled embeddings keep the token identity
dominant over the blocks' outputs; zero biases add no position-common offset; the 1/√R scaling keeps that true
at any depth.
"""

from __future__ import annotations

import math

from torch import nn

from attention_zoo.core import AttentionCore


def init_linear_(linear: nn.Linear) -> None:
    """Xavier-uniform weight, zero bias."""
    nn.init.xavier_uniform_(linear.weight)
    if linear.bias is not None:
        nn.init.zeros_(linear.bias)


def init_transformer_(model: nn.Module, residual_branches: int) -> None:
    """Initialise ``model`` in place by the convention of the module docstring.

    The residual output projections are the ``residual_projection`` of every submodule that declares one
    (the multi-head block's W^O, the feed-forward's second Linear); they are scaled by 1 / √``residual_branches``.
    """
    if residual_branches < 1:
        raise ValueError(f"residual_branches must be >= 1, got {residual_branches}")
    owned_by_cores = {id(p) for m in model.modules() if isinstance(m, AttentionCore) for p in m.parameters()}
    residual = []
    for module in model.modules():
        if any(id(p) in owned_by_cores for p in module.parameters(recurse=False)):
            continue
        if isinstance(module, nn.Linear):
            init_linear_(module)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=module.embedding_dim**-0.5)  # times √d in the forward
        elif isinstance(module, nn.LayerNorm) and module.elementwise_affine:
            nn.init.ones_(module.weight)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        projection = getattr(module, "residual_projection", None)
        if isinstance(projection, nn.Linear):
            residual.append(projection)
    for projection in residual:
        projection.weight.data /= math.sqrt(residual_branches)
