"""MoBA's layout (``attention_zoo.moba.layout.gated_layout``) at a given commit (default abedbc0: the pairs
filtered by a boolean mask, an int64 stable sort, each pair's slot by a division) against the working tree's (one
int32 stable sort that puts unrouted pairs last, a slot without division when no query list is cut): the
batches of both compared, exactly, on 300 random selections (blocks of 1-5 keys, 0-3 picks, budgets of 1-199
scores: lists cut and not) and on the gate's selections at n = 4096, block 128, top-k 4, B = 1, H = 8; then
timed there, interleaved, one thread, minimum of 15 calls, four times.

    python -m results.cpu_targets.moba_flash.layout_ab [--commit C]
"""

import argparse

import torch
from einops import reduce

import attention_zoo as az
from attention_zoo.moba.layout import gated_layout
from results.ab_timing import at_commit, best_ms

parser = argparse.ArgumentParser()
parser.add_argument("--commit", default="abedbc0")
args = parser.parse_args()
torch.set_num_threads(1)
old = at_commit(args.commit, "attention_zoo/moba_layout.py", "moba_layout_at_commit")


def assert_same(a, b) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.block == y.block and torch.equal(x.rows, y.rows)
        assert (x.sequences is None) == (y.sequences is None)
        assert x.sequences is None or torch.equal(x.sequences, y.sequences)


generator = torch.Generator().manual_seed(0)
draw = lambda low, high: int(torch.randint(low, high, (), generator=generator))
for _ in range(300):
    batch, heads, block_size, blocks, picks = draw(1, 3), draw(1, 4), draw(1, 6), draw(1, 8), draw(0, 4)
    gated = torch.randint(-1, blocks, (batch, heads, block_size * blocks, picks), generator=generator)
    budget = draw(1, 200)
    assert_same(old.gated_layout(gated, block_size, budget), gated_layout(gated, block_size, budget))
print("300 random selections: the same batches")
n = 4096
core = az.create_attention("moba", dim_head=64, heads=8, max_seq_len=n, block_size=128, top_k=4)
q, k = (torch.randn(1, 8, n, 64, generator=generator) for _ in range(2))
sums = reduce(k, "b h (g j) d -> b h g d", "sum", j=128)


for causal in (True, False):
    gated = core.select_blocks(q, sums, torch.full((1, 32), 128.0), offset=0, causal=causal)[..., 1:]
    assert_same(old.gated_layout(gated, 128, 1 << 19), gated_layout(gated, 128, 1 << 19))
    for _ in range(4):
        then = best_ms(lambda g=gated: old.gated_layout(g, 128, 1 << 19), 15)
        now = best_ms(lambda g=gated: gated_layout(g, 128, 1 << 19), 15)
        print(f"n = {n}, causal = {causal}: the same batches; {args.commit} {then:.2f} ms, now {now:.2f} ms")
