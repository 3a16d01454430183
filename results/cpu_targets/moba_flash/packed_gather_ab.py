"""A try on causal MoBA's CPU backward, measured and dropped: each batch's rows of dO, q and O gathered in one
index_select from an (N, 3D) copy [dO | q | O] made once, in place of three gathers. Interleaved A/B against the
kernel's own backward (n = 4096, block 128, top-k 4, B = 1, H = 8, D = 64, float32, fwd + bwd, one thread, 8
rounds after one call each); the gradients of both are compared first. The try's backward runs the library's
for the own blocks (given no gated batch) and differs in the gated batches only.

    python -m results.cpu_targets.moba_flash.packed_gather_ab
"""

from types import SimpleNamespace

import torch
from einops import rearrange
from torch.autograd.function import once_differentiable

import attention_zoo as az
from attention_zoo.moba import flash
from attention_zoo.moba.layout import add_block, block_keys
from results.ab_timing import fwd_bwd, inputs, interleaved, largest_difference

torch.set_num_threads(1)
library_backward = flash.FlashMobaAttention.backward


@staticmethod
@once_differentiable
def packed_backward(ctx, grad_out):
    own_blocks_only = SimpleNamespace(**vars(ctx) | {"layout": ()}, saved_tensors=ctx.saved_tensors)
    grad_q, grad_k, grad_v, *rest = library_backward(own_blocks_only, grad_out)
    q, k, v, out, lse, key_bias = ctx.saved_tensors
    seqs, n, dim = q.shape
    size = ctx.block_size
    packed = torch.cat([grad_out.contiguous(), q, out], dim=-1).view(seqs * n, 3 * dim)  # the one copy
    blocks = [rearrange(t, "s (g j) d -> s g j d", j=size) for t in (k, v, grad_k, grad_v)]
    for batch in ctx.layout:
        rows, padded = flash._rows(batch, seqs, n, size)
        picked = rearrange(packed.index_select(0, rows), "(g m) (i d) -> i g 1 m d", m=batch.rows.shape[1], i=3)
        row_lse = lse.index_select(0, rows)
        if padded is not None:
            row_lse.masked_fill_(padded, torch.inf)
        keys, values = (block_keys(t, batch)[:, None] for t in blocks[:2])
        grad_rows, grad_keys, grad_values = flash._flash_backward(
            picked[0], picked[1], keys, values, picked[2], rearrange(row_lse, "(g m) -> g 1 m", g=len(batch.rows)),
            0.0, False, attn_mask=flash._block_mask(key_bias, batch, size), scale=ctx.scale,
        )  # fmt: skip
        grad_q.view(seqs * n, dim).index_add_(0, rows, grad_rows.flatten(0, 2))
        add_block(blocks[3], batch, grad_values[:, 0])
        add_block(blocks[2], batch, grad_keys[:, 0])
    return grad_q, grad_k, grad_v, *rest


n = 4096
core = az.create_attention("moba", dim_head=64, heads=8, max_seq_len=n, block_size=128, top_k=4)
q, k, v, grad = inputs(n)
step = fwd_bwd(lambda: core(q, k, v, causal=True), grad, q, k, v)


def with_backward(backward):
    def call():
        flash.FlashMobaAttention.backward = backward
        return step()[1:]

    return call


variants = {"three gathers": with_backward(library_backward), "one packed gather": with_backward(packed_backward)}
first, second = (call() for call in variants.values())
print(f"largest difference of the gradients: {largest_difference(first, second)}")
for name, timing in interleaved(variants, 8).items():
    print(f"{name}: min {min(timing.seconds) * 1e3:.1f} ms, median {sorted(timing.seconds)[4] * 1e3:.1f} ms")
