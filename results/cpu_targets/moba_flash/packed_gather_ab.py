"""A try on causal MoBA's CPU backward, measured and dropped: each batch's rows of dO, q and O gathered in one
index_select from an (N, 3D) copy [dO | q | O] made once, in place of three gathers. Interleaved A/B against the
kernel's own backward (n = 4096, block 128, top-k 4, B = 1, H = 8, D = 64, float32, fwd + bwd, one thread, 8
rounds after one call each); the gradients of both are compared first.

    python results/cpu_targets/moba_flash/packed_gather_ab.py
"""

import time

import torch
from einops import rearrange
from torch.autograd.function import once_differentiable

import attention_zoo as az
from attention_zoo.moba import flash as kernel
from attention_zoo.moba.layout import add_block, block_keys

torch.set_num_threads(1)


@staticmethod
@once_differentiable
def packed_backward(ctx, grad_out):
    q, k, v, out, lse, key_bias = ctx.saved_tensors
    block_size, scale = ctx.block_size, ctx.scale
    seqs, n, dim = q.shape
    total = seqs * n
    grad_out = grad_out.contiguous()
    by_block = lambda t: t.view(-1, 1, block_size, dim)
    own = [by_block(t) for t in (grad_out, q, k, v, out)]
    own_mask = kernel._own_mask(key_bias, block_size)
    lses = lse.view(-1, 1, block_size)
    grads = kernel._flash_backward(*own, lses, 0.0, ctx.causal, attn_mask=own_mask, scale=scale)
    grad_q, grad_k, grad_v = (t.view(seqs, n, dim) for t in grads)
    packed = torch.cat([grad_out, q, out], dim=-1).view(total, 3 * dim)
    blocks = [rearrange(t, "s (g j) d -> s g j d", j=block_size) for t in (k, v, grad_k, grad_v)]
    for batch in ctx.layout:
        rows, padded = kernel._rows(batch, seqs, n, block_size)
        mask = kernel._block_mask(key_bias, batch, block_size)
        rows_of = packed.index_select(0, rows).view(*batch.rows.shape, 3, dim)
        grad_rows_out, queries, outs = (rows_of[:, :, i][:, None] for i in range(3))
        row_lse = lse.index_select(0, rows)
        if padded is not None:
            row_lse.masked_fill_(padded, torch.inf)
        keys, values = (block_keys(t, batch)[:, None] for t in blocks[:2])
        row_lse = row_lse.view(*batch.rows.shape, 1).transpose(1, 2)
        grad_rows, grad_keys, grad_values = kernel._flash_backward(
            grad_rows_out, queries, keys, values, outs, row_lse, 0.0, False, attn_mask=mask, scale=scale
        )
        grad_q.view(total, dim).index_add_(0, rows, grad_rows.flatten(0, 2))
        add_block(blocks[3], batch, grad_values[:, 0])
        add_block(blocks[2], batch, grad_keys[:, 0])
    return grad_q, grad_k, grad_v, None, None, None, None, None


n = 4096
core = az.create_attention("moba", dim_head=64, heads=8, max_seq_len=n, block_size=128, top_k=4)
generator = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, 8, n, 64, generator=generator).requires_grad_() for _ in range(3))
grad = torch.randn(1, 8, n, 64, generator=generator)


def step() -> list[torch.Tensor]:
    core(q, k, v, causal=True).backward(grad)
    grads = [t.grad for t in (q, k, v)]
    q.grad = k.grad = v.grad = None
    return grads


variants = {"three gathers": kernel.FlashMobaAttention.backward, "one packed gather": packed_backward}
results = {}
for name, backward in variants.items():
    kernel.FlashMobaAttention.backward = backward
    results[name] = step()
difference = max((a - b).abs().max().item() for a, b in zip(*results.values(), strict=True))
print(f"largest difference of the gradients: {difference}")
seconds: dict[str, list[float]] = {name: [] for name in variants}
for _ in range(8):
    for name, backward in variants.items():
        kernel.FlashMobaAttention.backward = backward
        start = time.perf_counter()
        step()
        seconds[name].append(time.perf_counter() - start)
for name, times in seconds.items():
    print(f"{name}: min {min(times) * 1e3:.1f} ms, median {sorted(times)[4] * 1e3:.1f} ms")
