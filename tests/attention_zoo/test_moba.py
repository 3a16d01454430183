"""MoBA (``moba``): exact softmax attention over the blocks each query's gate selects.

The reference here is written from the paper's definitions (Lu et al. 2025, arXiv:2502.13189, Sec. 2),
one query at a time in float64, and shares no code with ``attention_zoo.moba.attention``: s_i = <q, mean of the real
keys of block i>, candidates = the blocks before the query's own (causal) or every other block, blocks
without a real key excluded, the top_k candidates by sorting, then an explicit softmax over the keys of
the own block and the chosen blocks (real keys only; j <= i when causal).
"""

from __future__ import annotations

import io
import re

import pytest
import torch
from rich.console import Console
from torch import Tensor

import attention_zoo as az
from attention_zoo.masks import pad_mask
from experiments.bench import targets
from experiments.bench.flops import FORMULAS
from tests.attention_zoo.allocations import LargestOutput

TIGHT = dict(rtol=0.0, atol=1e-10)  # float64, exact up to summation order
HEADS, DIM_HEAD = 2, 8


def make(
    block_size: int, top_k: int, dtype: torch.dtype = torch.float64, dim_head: int = DIM_HEAD, impl: str = "tiled"
) -> az.AttentionCore:
    core = az.create_attention("moba", dim_head=dim_head, heads=HEADS, block_size=block_size, top_k=top_k, impl=impl)
    return core.to(dtype)


def inputs(b: int, n: int, seed: int = 0, dim: int = DIM_HEAD) -> tuple[Tensor, Tensor, Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, HEADS, n, dim, generator=generator, dtype=torch.float64) for _ in range(3))


def reference_selection(q: Tensor, k: Tensor, mask: Tensor | None, causal: bool, block_size: int, top_k: int):
    """``(B, H, N, N)`` bool: the keys each query attends to, from the paper's gate."""
    b, h, n, _ = q.shape
    real = torch.ones(b, n, dtype=torch.bool) if mask is None else mask
    block_of = torch.arange(n) // block_size
    allowed = torch.zeros(b, h, n, n, dtype=torch.bool)
    for bi in range(b):
        for hi in range(h):
            means = {}
            for block in range(-(-n // block_size)):
                keys = [j for j in range(block * block_size, min(n, (block + 1) * block_size)) if real[bi, j]]
                if keys:
                    means[block] = k[bi, hi, keys].mean(dim=0)
            for i in range(n):
                own = i // block_size
                candidates = [g for g in means if (g < own if causal else g != own)]
                ranked = sorted(candidates, key=lambda g: float(q[bi, hi, i] @ means[g]), reverse=True)
                chosen = torch.tensor([own, *ranked[:top_k]])
                visible = torch.isin(block_of, chosen) & real[bi]
                if causal:
                    visible &= torch.arange(n) <= i
                allowed[bi, hi, i] = visible
    return allowed


def reference_moba(q, k, v, mask, causal, block_size, top_k) -> Tensor:
    """softmax(q K^T / sqrt(d)) V over the reference selection; zeros for a query that sees no key."""
    allowed = reference_selection(q.detach(), k.detach(), mask, causal, block_size, top_k)
    scores = torch.where(allowed, q @ k.mT * q.shape[-1] ** -0.5, float("-inf"))
    has_key = allowed.any(dim=-1, keepdim=True)
    probs = torch.where(has_key, scores, 0.0).softmax(dim=-1) * has_key
    return probs @ v


def mask_with_an_empty_block(n: int, block_size: int) -> Tensor:
    """Row 0 all real; row 1 right-padded; row 2 left-padded with a hole that empties a whole block."""
    mask = torch.ones(3, n, dtype=torch.bool)
    mask[1, n - 5 :] = False
    mask[2, :2] = False
    mask[2, 2 * block_size : 3 * block_size + 1] = False
    return mask


CONFIGS = [(4, 2), (8, 1), (5, 3), (3, 0), (6, 1)]


@pytest.mark.parametrize("impl", ["tiled", "dense"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("padded", [False, True], ids=["no-mask", "mask"])
@pytest.mark.parametrize(("block_size", "top_k"), CONFIGS)
@pytest.mark.parametrize("n", [17, 40])
def test_matches_the_reference(n, block_size, top_k, padded, causal, impl):
    core = make(block_size, top_k, impl=impl)
    q, k, v = inputs(3, n)
    mask = mask_with_an_empty_block(n, block_size) if padded else None
    out = core(q, k, v, mask=mask, causal=causal)
    expected = reference_moba(q, k, v, mask, causal, block_size, top_k)
    real = torch.ones(3, n, dtype=torch.bool) if mask is None else mask
    for b in range(3):
        torch.testing.assert_close(out[b][:, real[b]], expected[b][:, real[b]], **TIGHT)


def test_the_attention_weights_are_the_selection():
    """With V = I (D = N) the output row of query i is its attention distribution: nonzero exactly on the keys
    the paper's gate selects, summing to 1, so the selection really runs (not full attention)."""
    n, block_size, top_k = 24, 4, 2
    core = make(block_size, top_k, dim_head=n)
    q, k, _ = inputs(2, n, dim=n)
    v = torch.eye(n, dtype=torch.float64).expand(2, HEADS, n, n)
    mask = pad_mask(torch.tensor([24, 19]), n)
    for causal in (False, True):
        weights = core(q, k, v, mask=mask, causal=causal)
        allowed = reference_selection(q, k, mask, causal, block_size, top_k)
        for b, length in enumerate((24, 19)):
            assert torch.equal(weights[b, :, :length] > 0, allowed[b, :, :length])
            torch.testing.assert_close(weights[b, :, :length].sum(-1), torch.ones(HEADS, length, dtype=torch.float64))
        seen = (weights[0] > 0).sum(-1)  # row 0 has no padding
        if causal:
            assert (seen[:, block_size * (top_k + 1) :] < torch.arange(n)[block_size * (top_k + 1) :] + 1).all()
        else:
            assert (seen == (top_k + 1) * block_size).all(), "own block + top_k blocks, not all 6"


@pytest.mark.parametrize("impl", ["tiled", "dense"])
@pytest.mark.parametrize("causal", [False, True])
def test_gradients_match_the_reference(causal, impl):
    """The selection is piecewise constant: the gradient is the one of softmax attention over the selected keys."""
    n, block_size, top_k = 21, 4, 2
    core = make(block_size, top_k, impl=impl)
    mask = pad_mask(torch.tensor([21, 15]), n)
    grads = []
    for attention in (lambda *t: core(*t, mask=mask, causal=causal), lambda *t: reference_moba(*t, mask, causal, 4, 2)):
        q, k, v = (t.requires_grad_(True) for t in inputs(2, n, seed=3))
        out = attention(q, k, v)
        weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
        (out * weights * mask[:, None, :, None]).sum().backward()
        grads.append((q.grad, k.grad, v.grad))
    for got, expected in zip(*grads, strict=True):
        torch.testing.assert_close(got, expected, **TIGHT)


def test_padded_keys_stay_out_of_the_means_and_empty_blocks_are_never_chosen():
    """Block 0 holds one real key u (mean u over its real keys; u / 4 if padding were counted); block 1 four
    keys 0.6 u; block 2 only padding (mean 0 if it were a candidate); q = u sits in block 3 with top_k = 1."""
    n, block_size = 16, 4
    core = make(block_size, 1, dim_head=n)
    u = torch.zeros(n, dtype=torch.float64)
    u[0] = 1.0
    q = torch.zeros(1, HEADS, n, n, dtype=torch.float64)
    q[:, :, 12:] = u
    k = torch.zeros(1, HEADS, n, n, dtype=torch.float64)
    k[:, :, 0] = u
    k[:, :, 4:8] = 0.6 * u
    k[:, :, 12:] = -u
    v = torch.eye(n, dtype=torch.float64).expand(1, HEADS, n, n)
    mask = torch.ones(1, n, dtype=torch.bool)
    mask[0, 1:4] = False
    mask[0, 8:12] = False
    for causal in (False, True):
        weights = core(q, k, v, mask=mask, causal=causal)
        assert (weights[0, :, 12:, 0] > 0).all(), "block 0 (mean over its real key) must win"
        assert (weights[0, :, 12:, 4:12] == 0).all()
    k[:, :, 0], k[:, :, 4:8] = -u, -u  # now every real candidate scores below the empty block's 0
    weights = core(q, k, v, mask=mask, causal=True)
    assert (weights[0, :, 12:, 0] > 0).all() or (weights[0, :, 12:, 4:8] > 0).all(), "a real block fills the slot"
    empty = core(q, k, v, mask=torch.tensor([[False] * 4 + [True] * 12]), causal=True)
    assert (empty[0, :, :4] == 0).all(), "a query that sees no real key gets zeros"


def test_top_k_covering_every_block_is_full_attention():
    full = az.create_attention("full", dim_head=DIM_HEAD, heads=HEADS, backend="math").double()
    q, k, v = inputs(3, 23)
    mask = pad_mask(torch.tensor([23, 17, 9]), 23)
    for causal in (False, True):
        torch.testing.assert_close(
            make(4, 6)(q, k, v, mask=mask, causal=causal), full(q, k, v, mask=mask, causal=causal), **TIGHT
        )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_is_finite_and_close(dtype):
    """Gate and softmax run in float32: inputs of size 100 in half precision (q . k ~ 1e5 > fp16's 65504)."""
    core = make(4, 2, dtype)
    q, k, v = (100 * t for t in inputs(2, 20, seed=5))
    q, k, v = (t.to(dtype).requires_grad_(True) for t in (q, k, v))
    mask = pad_mask(torch.tensor([20, 13]), 20)
    for causal in (False, True):
        out = core(q, k, v, mask=mask, causal=causal)
        out.float().square().sum().backward()
        assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
        expected = reference_moba(q.double(), k.double(), v.double(), mask, causal, 4, 2)
        real = mask[:, None, :, None].expand_as(out)
        torch.testing.assert_close(out.double()[real], expected[real], rtol=2e-2, atol=2.0)


def test_decoding_reads_the_block_cache_not_the_prefix(monkeypatch):
    """Steps of 5 positions (across blocks of 4), with padding: the state holds the keys and values in whole
    blocks and each block's key sum and real-key count; the forward is never recomputed."""
    core = make(4, 2)
    n = 23
    q, k, v = inputs(2, n, seed=7)
    mask = torch.ones(2, n, dtype=torch.bool)
    mask[1, 5:10] = False
    full = core(q, k, v, mask=mask, causal=True)
    monkeypatch.setattr(core, "attend", lambda *a, **kw: pytest.fail("decoding recomputed the prefix"))
    state = core.start_decoding()
    step = lambda t, s: t[:, :, s : s + 5]
    decoded = torch.cat(
        [core.decode(step(q, s), step(k, s), step(v, s), state, mask=mask[:, s : s + 5]) for s in range(0, n, 5)],
        dim=-2,
    )
    for b in range(2):
        torch.testing.assert_close(decoded[b][:, mask[b]], full[b][:, mask[b]], **TIGHT)
    capacity = state.keys.shape[-2]
    assert capacity % 4 == 0 and n <= capacity and state.key_sums.shape[-2] == capacity // 4
    real_keys = k.masked_fill(~mask[:, None, :, None], 0.0)
    padded = torch.nn.functional.pad(real_keys, (0, 0, 0, capacity - n))
    torch.testing.assert_close(state.key_sums, padded.unflatten(2, (-1, 4)).sum(dim=3), **TIGHT)
    counts = torch.nn.functional.pad(mask, (0, capacity - n)).unflatten(1, (-1, 4)).sum(dim=2)
    assert torch.equal(state.key_counts, counts.double())


def test_options_are_checked():
    with pytest.raises(ValueError, match="block_size must be an int >= 1, got 0"):
        make(0, 2)
    with pytest.raises(ValueError, match="top_k must be an int >= 0"):
        make(4, -1)
    with pytest.raises(
        ValueError, match=re.escape("option impl='sparse' is not a valid 'auto' | 'tiled' | 'dense' | 'flex'")
    ):
        make(4, 2, impl="sparse")


def test_memory_grows_linearly_not_as_n_squared():
    """Forward + backward at n and 2n: no tensor near n^2, and the largest one at most doubles."""
    largest = []
    for n in (1024, 2048):
        core = make(16, 2)
        q, k, v = (t.requires_grad_(True) for t in inputs(1, n))
        with LargestOutput() as probe:
            core(q, k, v, mask=pad_mask(torch.tensor([n - 9]), n), causal=True).sum().backward()
        assert "index_add_" in probe.ops, "the probe saw the backward"
        assert probe.elements < n * n / 4
        largest.append(probe.elements)
    assert largest[1] <= 2.2 * largest[0]


@pytest.mark.parametrize("causal", [False, True])
def test_flops_count_the_reference_pairs(causal):
    """4 d per (query, key) pair the reference selects, 2 d per gate score of a candidate block (c | n)."""
    n, block_size, top_k, d = 24, 4, 2, DIM_HEAD
    q, k, _ = inputs(1, n)
    pairs = int(reference_selection(q, k, None, causal, block_size, top_k)[0, 0].sum())
    scored = sum((i // block_size) if causal else n // block_size - 1 for i in range(n))
    options = {"block_size": block_size, "top_k": top_k}
    assert FORMULAS["moba"](options, n, d, causal) == 4 * d * pairs + 2 * d * scored


def test_causal_targets_are_measured_against_causal_full_attention():
    cases = targets.target_cases({"moba"}, threads=1)
    assert targets.protocol_case("full", {}, 4096, 1, causal=True) in cases
    assert {c.causal for c in cases if c.attention == "moba"} == {False, True}
    rows = {}
    for case in cases:
        ms = (1000.0 if case.causal else 2000.0) if case.attention == "full" else case.seq_len / 10
        rows[case.key()] = {"status": "ok", "time_ms_min": ms, "peak_mb": case.seq_len / 100}
    console = Console(file=io.StringIO(), width=250)
    console.print(targets.targets_table(rows, {"moba"}, threads=1))
    lines = console.file.getvalue().splitlines()
    bidirectional = next(line for line in lines if "moba " in line and "causal" not in line)
    causal = next(line for line in lines if "moba (causal)" in line)
    # 2000 / 409.6 = 4.88x >= 3x, 1000 / 409.6 = 2.44x < 2.5x; time and memory grow 4x from 2048 to 8192
    assert "4.88x" in bidirectional and "4.00" in bidirectional and bidirectional.rstrip(" │").endswith("yes")
    assert "2.44x" in causal and causal.rstrip(" │").endswith("NO")
