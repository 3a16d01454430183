"""MoBA's block-level kernel (``attention_zoo.moba.tiled``) against the paper's attention over a given selection.

Lu et al. 2025, arXiv:2502.13189, Sec. 2: MoBA(q, K, V) = Softmax(q K[I]^T / sqrt(d)) V[I] with I the query's own
block and its gated blocks. The selection is drawn at random here (not by the gate), so these tests pin the
kernel alone; the reference is that formula in float64, one query at a time, over real keys only and, when
causal, keys at or before the query inside its own block. Every test runs both kernels: the CPU's, on torch's
flash-attention op (``moba_kernel_flash``), and the products kernel that other devices run.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from attention_zoo.moba import tiled as moba_kernel
from attention_zoo.moba.layout import gated_layout
from attention_zoo.moba.tiled import moba_attention

B, H, D = 2, 2, 4


@pytest.fixture(autouse=True, params=["flash", "products"])
def kernel(request, monkeypatch):
    if request.param == "products":
        monkeypatch.setattr(moba_kernel, "_FLASH_DEVICES", ())
    return request.param


def random_selection(n: int, block_size: int, top_k: int, causal: bool, seed: int) -> Tensor:
    """(B, H, N, 1 + top_k): own block, then up to ``top_k`` distinct other blocks (earlier ones when causal),
    -1 where a query takes fewer."""
    generator = torch.Generator().manual_seed(seed)
    selected = torch.full((B, H, n, 1 + top_k), -1, dtype=torch.long)
    for b in range(B):
        for h in range(H):
            for i in range(n):
                own = i // block_size
                candidates = [g for g in range(n // block_size) if (g < own if causal else g != own)]
                order = torch.randperm(len(candidates), generator=generator).tolist()
                take = int(torch.randint(0, top_k + 1, (), generator=generator))
                selected[b, h, i, 0] = own
                for rank, pick in enumerate(order[:take]):
                    selected[b, h, i, 1 + rank] = candidates[pick]
    return selected


def reference(q, k, v, selected, real, block_size, causal):
    """The paper's softmax over each query's selected keys, float64, zeros for a query that sees no key."""
    out = torch.zeros_like(q)
    n = q.shape[2]
    for b in range(B):
        for h in range(H):
            for i in range(n):
                blocks = {int(g) for g in selected[b, h, i] if g >= 0}
                keys = [
                    j
                    for j in range(n)
                    if j // block_size in blocks
                    and real[b, j]
                    and not (causal and j // block_size == i // block_size and j > i)
                ]
                if keys:
                    weights = torch.softmax(q[b, h, i] @ k[b, h, keys].T / math.sqrt(D), dim=0)
                    out[b, h, i] = weights @ v[b, h, keys]
    return out


def tensors(n: int, seed: int) -> list[Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, n, D, generator=generator, dtype=torch.float64, requires_grad=True) for _ in range(3)]


def assert_matches_the_paper(q, k, v, selected, real, block_size, causal, *, with_mask: bool = True) -> Tensor:
    """The kernel's output and its gradients (of a random weighting) against :func:`reference` in float64;
    ``with_mask=False`` hands the kernel no key mask (``real`` must then be all True)."""
    got = moba_attention(q, k, v, selected, real if with_mask else None, block_size, causal, 1 / math.sqrt(D))
    want = reference(q, k, v, selected, real, block_size, causal)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    weights = torch.randn(B, H, q.shape[2], D, dtype=torch.float64)
    got_grads = torch.autograd.grad((got * weights).sum(), (q, k, v))
    want_grads = torch.autograd.grad((want * weights).sum(), (q, k, v))
    for got_grad, want_grad in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(got_grad, want_grad, rtol=0, atol=1e-12)
    return got


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("budget", [None, 24])  # 24 scores per chunk: lists cut, one sequence per batch
def test_matches_the_paper_with_gradients(causal, padded, budget, monkeypatch):
    if budget is not None:
        monkeypatch.setattr(moba_kernel, "_CHUNK_ELEMENTS", budget)
    n, block_size, top_k = 24, 4, 2
    q, k, v = tensors(n, seed=1)
    selected = random_selection(n, block_size, top_k, causal, seed=2)
    real = torch.ones(B, n, dtype=torch.bool)
    if padded:  # a whole padded block, and a partly padded one
        real[0, 8:12] = False
        real[1, 17:22] = False
        assert (selected[0, :, :, 1:] == 2).any()  # queries that gated in the whole padded block
    assert_matches_the_paper(q, k, v, selected, real, block_size, causal, with_mask=padded)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("padded", [False, True])
def test_blocks_of_16_keys_or_more_match_the_paper_and_keep_a_nan_query(causal, padded):
    # from 16 keys a block without padding goes to torch's op with no mask (below, with a zero mask: the op
    # hides a NaN query over fewer keys without one)
    n, block_size, top_k = 64, 16, 2
    q, k, v = tensors(n, seed=8)
    selected = random_selection(n, block_size, top_k, causal, seed=9)
    real = torch.ones(B, n, dtype=torch.bool)
    if padded:  # a whole block and part of the next, and a few keys inside a block
        real[0, 16:36] = False
        real[1, 50:53] = False
    assert_matches_the_paper(q, k, v, selected, real, block_size, causal, with_mask=padded)
    poisoned = q.detach().clone()
    poisoned[0, 1, 37, 2] = math.nan
    out = moba_attention(poisoned, k, v, selected, None, block_size, causal, 1 / math.sqrt(D))
    assert out[0, 1, 37].isnan().all()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("padded", [False, True])
def test_rows_that_only_pad_a_batch_change_nothing(causal, padded):
    # 10 queries of sequence 0 and 9 of sequence 1 gate in block 0: one batch, the shorter list padded by a row
    n, block_size = 16, 4
    q, k, v = tensors(n, seed=6)
    selected = torch.full((B, H, n, 2), -1, dtype=torch.long)
    selected[..., 0] = torch.arange(n) // block_size
    selected[0, 0, 4:14, 1] = 0
    selected[0, 1, 4:13, 1] = 0
    real = torch.ones(B, n, dtype=torch.bool)
    real[0, 2] = real[1, 9:12] = not padded
    layout = gated_layout(selected[..., 1:], block_size, 1 << 12)
    assert [int((batch.rows == B * H * n).sum()) for batch in layout] == [1]
    assert_matches_the_paper(q, k, v, selected, real, block_size, causal, with_mask=padded)


@pytest.mark.parametrize("causal", [False, True])
def test_blocks_without_keys_leave_a_query_its_other_blocks(causal):
    # blocks 0 and 2 are all padding; queries of blocks 2 and 3 gate in block 0, then block 1: a query of block 2
    # sees no key until block 1, which is all it sees
    n, block_size = 16, 4
    q, k, v = tensors(n, seed=7)
    selected = torch.full((B, H, n, 3), -1, dtype=torch.long)
    selected[..., 0] = torch.arange(n) // block_size
    selected[:, :, 8:, 1] = 0
    selected[:, :, 8:, 2] = 1
    real = torch.ones(B, n, dtype=torch.bool)
    real[:, 0:4] = real[:, 8:12] = False
    got = assert_matches_the_paper(q, k, v, selected, real, block_size, causal)
    assert got[:, :, 8:].abs().amin() > 0


def test_a_query_that_sees_no_key_gives_zeros_and_no_nan():
    n, block_size = 8, 4
    q, k, v = tensors(n, seed=3)
    selected = random_selection(n, block_size, 1, causal=True, seed=4)
    selected[..., 1:] = -1  # own block only
    real = torch.ones(B, n, dtype=torch.bool)
    real[:, 4] = False  # query 4 sees only key 4 (causal), which is padding
    out = moba_attention(q, k, v, selected, real, block_size, True, 1 / math.sqrt(D))
    assert torch.equal(out[:, :, 4], torch.zeros(B, H, D, dtype=torch.float64))
    assert out[:, :, 5].abs().sum() > 0
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert all(torch.isfinite(grad).all() for grad in grads)
    assert torch.equal(grads[0][:, :, 4], torch.zeros(B, H, D, dtype=torch.float64))


@pytest.mark.parametrize("rising", [True, False])
@pytest.mark.parametrize("causal", [False, True])
def test_gated_blocks_far_above_the_own_block_merge_without_overflow(rising, causal):
    # the queries of block 3 gate in blocks 0 and 1 with scores about 60 and 120 above their own block's (120 and
    # 60 when falling): exp(120) is past float32's range, so a merge of the pieces must stay in log space
    n, block_size = 16, 4
    generator = torch.Generator().manual_seed(11)
    direction = torch.nn.functional.normalize(torch.randn(D, generator=generator, dtype=torch.float64), dim=0)
    q, k, v = (torch.randn(B, H, n, D, generator=generator, dtype=torch.float64) for _ in range(3))
    q[:, :, 12:] = q[:, :, 12:] * 0.1 + 10 * direction
    heights = (12.0, 24.0) if rising else (24.0, 12.0)  # score = 10 * height / sqrt(D) = 5 * height
    for block, height in enumerate(heights):
        k[:, :, block * 4 : block * 4 + 4] = k[:, :, block * 4 : block * 4 + 4] * 0.3 + height * direction
    selected = torch.full((B, H, n, 3), -1, dtype=torch.long)
    selected[..., 0] = torch.arange(n) // block_size
    selected[:, :, 12:, 1], selected[:, :, 12:, 2] = 0, 1
    real = torch.ones(B, n, dtype=torch.bool)
    want = reference(q, k, v, selected, real, block_size, causal)
    leaves = [t.float().requires_grad_() for t in (q, k, v)]
    got = moba_attention(*leaves, selected, None, block_size, causal, 1 / math.sqrt(D))
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)
    weights = torch.randn(B, H, n, D, generator=generator, dtype=torch.float64)
    got_grads = torch.autograd.grad((got * weights.float()).sum(), leaves)
    want_grads = torch.autograd.grad(
        (reference(*(t.requires_grad_() for t in (q, k, v)), selected, real, block_size, causal) * weights).sum(),
        (q, k, v),
    )
    for got_grad, want_grad in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(got_grad.double(), want_grad, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("budget", [1 << 12, 40])
def test_the_layout_holds_every_pair_once_within_the_budget_and_15_percent_of_padding(budget):
    n, block_size, top_k = 32, 4, 3
    selected = random_selection(n, block_size, top_k, causal=False, seed=5)
    layout = gated_layout(selected[..., 1:], block_size, budget)
    pairs = []
    for batch in layout:
        assert batch.rows.numel() * block_size <= budget
        assert int((batch.rows < B * H * n).sum()) >= 0.85 * batch.rows.numel()
        sequences = torch.arange(B * H) if batch.sequences is None else batch.sequences
        assert len(sequences) == batch.rows.shape[0]
        for sequence, rows in zip(sequences.tolist(), batch.rows, strict=True):
            real = rows[rows < B * H * n]
            assert (real // n == sequence).all()  # a row's keys are its own sequence's block
            pairs += [(int(row), batch.block) for row in real]
    want = [
        (s * n + i, int(g))
        for s, per_query in enumerate(selected[..., 1:].flatten(0, 1))
        for i, blocks in enumerate(per_query)
        for g in blocks
        if g >= 0
    ]
    assert sorted(pairs) == sorted(want)
