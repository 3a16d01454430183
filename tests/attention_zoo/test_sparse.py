"""Sparse attention (``local``, ``sparse``, ``longformer``, ``bigbird``): exact on its pattern.

The reference here is independent of the code under test: each pattern's connectivity sets are written
out again with Python loops from the papers' definitions, and attention over them is computed in float64
with an explicit softmax. Both implementations (``impl="blocked"`` and ``impl="dense"``) must match it
to 1e-10, with and without causal masking and key padding, at lengths that are not multiples of any tile.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor
from torch.nn.attention.flex_attention import and_masks, create_mask

import attention_zoo as az
from attention_zoo.masks import pad_mask
from attention_zoo.sparse import attention as sparse
from attention_zoo.sparse.mask_mods import (
    bigbird_random_blocks,
    causal_mask,
    dense_mask,
    generate_sliding_window,
    generate_strided,
    generate_strided_columns,
)
from attention_zoo.sparse.patterns import (
    BigBirdPattern,
    BlockwisePattern,
    FixedPattern,
    LocalPattern,
    LongformerPattern,
    StridedPattern,
    pattern_named,
)
from attention_zoo.sparse.tiled import layout_from_mask
from tests.attention_zoo.allocations import LargestOutput

TIGHT = dict(rtol=0.0, atol=1e-10)  # float64, exact up to summation order
HEADS, DIM_HEAD = 2, 8

CONFIGS = [
    ("local", {"window": 8}),
    ("local", {"window": 2}),
    ("sparse", {"pattern": "strided", "stride": 6}),
    ("sparse", {"pattern": "fixed", "stride": 8, "summary_columns": 2}),
    ("sparse", {"pattern": "blockwise", "block_size": 6}),
    ("sparse", {"pattern": "longformer", "window": 8, "global_tokens": 2}),
    ("sparse", {"pattern": "bigbird", "block_size": 4, "global_tokens": 4, "random_blocks": 1}),
    ("longformer", {"window": 6, "global_tokens": 3}),
    ("bigbird", {"block_size": 5, "window_blocks": 1, "global_tokens": 2, "random_blocks": 2, "seed": 7}),
    ("bigbird", {"block_size": 3, "random_blocks": 1, "seed": 2}),
    ("bigbird", {"block_size": 3, "global_tokens": 3, "random_blocks": 2, "global_placement": "start"}),
]
IDS = [f"{name}-{'-'.join(map(str, options.values()))}" for name, options in CONFIGS]


def reference_allowed(name: str, options: dict, n: int, causal: bool) -> Tensor:
    """``(n, n)`` connectivity from the papers' set definitions, one (i, j) at a time."""
    o = {"pattern": name, **options}
    kind = o["pattern"]
    if kind == "bigbird":
        o = {"window_blocks": 3, "random_blocks": 3, "seed": 0, "global_placement": "ends", **o}
        b, wb = o["block_size"], o["window_blocks"]
        g = o.get("global_tokens", 2 * b)
        # the authors' ITC: the first and last g/2 of the sequence padded to whole blocks; causal: the first
        lead = g if o["global_placement"] == "start" else g // 2
        trail = 0 if o["global_placement"] == "start" or causal else g // 2
        trail_start = -(-n // b) * b - trail
        table = bigbird_random_blocks(
            -(-n // b),
            window_blocks=wb,
            global_blocks=lead // b,
            random_blocks=o["random_blocks"],
            seed=o["seed"],
            causal=causal,
            trailing_global_blocks=trail // b,
        ).tolist()
    allowed = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        for j in range(n):
            if kind == "local":
                ok = abs(i - j) <= o["window"] // 2
            elif kind == "strided":
                ok = abs(i - j) <= o["stride"] or (i - j) % o["stride"] == 0
            elif kind == "fixed":
                ok = i // o["stride"] == j // o["stride"] or j % o["stride"] >= o["stride"] - o["summary_columns"]
            elif kind == "blockwise":
                ok = i // o["block_size"] == j // o["block_size"]
            elif kind == "longformer":
                ok = abs(i - j) <= o["window"] // 2 or i < o["global_tokens"] or j < o["global_tokens"]
            else:
                ok = abs(i // b - j // b) <= wb // 2 or min(i, j) < lead or max(i, j) >= trail_start
                ok = ok or j // b in table[i // b]
            allowed[i, j] = ok and (j <= i or not causal)
    return allowed


def reference_attention(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor) -> Tensor:
    """softmax over allowed keys only, explicit; rows with no allowed key are 0. ``allowed``: (B, 1, N, N)."""
    scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    scores = torch.where(allowed, scores, torch.full_like(scores, float("-inf")))
    weights = torch.exp(scores - scores.amax(dim=-1, keepdim=True).nan_to_num(neginf=0.0))
    total = weights.sum(dim=-1, keepdim=True)
    return (weights / torch.where(total > 0, total, torch.ones_like(total))) @ v


def make(name: str, options: dict, **extra) -> az.AttentionCore:
    return az.create_attention(name, dim_head=DIM_HEAD, heads=HEADS, max_seq_len=None, **options, **extra).double()


def inputs(b: int, n: int, seed: int = 0) -> list[Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(b, HEADS, n, DIM_HEAD, generator=generator, dtype=torch.float64) for _ in range(3)]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n", [17, 29, 40])
@pytest.mark.parametrize(("name", "options"), CONFIGS, ids=IDS)
def test_equals_full_attention_restricted_to_the_pattern(name, options, n, causal):
    q, k, v = inputs(3, n)
    mask = pad_mask(torch.tensor([n, n - 7, 0]), n)  # the last batch item has no real key at all
    allowed = reference_allowed(name, options, n, causal)[None, None] & mask[:, None, None, :]
    expected = reference_attention(q, k, v, allowed)
    for impl in ("blocked", "dense"):
        out = make(name, options, impl=impl)(q, k, v, mask=mask, causal=causal)
        torch.testing.assert_close(out, expected, **TIGHT, msg=f"impl={impl}")
    assert not allowed[0, 0].all(), "the pattern should be sparse at this length"


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("name", "options"), CONFIGS, ids=IDS)
def test_gradients_match_the_dense_reference(name, options, causal):
    n = 37
    mask = pad_mask(torch.tensor([n, 30]), n)
    grad = inputs(2, n, seed=3)[0]
    grads = {}
    for impl in ("blocked", "dense"):
        q, k, v = (t.requires_grad_(True) for t in inputs(2, n))
        make(name, options, impl=impl)(q, k, v, mask=mask, causal=causal).backward(grad)
        grads[impl] = (q.grad, k.grad, v.grad)
    for blocked, dense in zip(grads["blocked"], grads["dense"], strict=True):
        torch.testing.assert_close(blocked, dense, **TIGHT)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("name", "options"), CONFIGS, ids=IDS)
def test_mask_functions_follow_flex_attention_convention(name, options, causal):
    """The same function under FlexAttention's vmap-based ``create_mask`` gives the same dense mask."""
    n = 29
    mask_mod = make(name, options).mask_mod(n, causal)
    expected = reference_allowed(name, options, n, causal)
    assert torch.equal(dense_mask(mask_mod, n), expected)
    assert torch.equal(create_mask(mask_mod, 1, 1, n, n, device="cpu")[0, 0], expected)


@pytest.mark.parametrize("stride", [1, 3, 6])
def test_strided_splits_into_a_window_and_disjoint_columns(stride):
    """The blocked path runs the strided pattern as two tile-friendly parts; they must partition it."""
    n = 40
    window = dense_mask(generate_sliding_window(2 * stride), n)
    columns = dense_mask(generate_strided_columns(stride), n)
    assert not (window & columns).any()
    assert torch.equal(window | columns, dense_mask(generate_strided(stride), n))


def test_bigbird_random_blocks_are_seeded():
    n = 64
    first = make("bigbird", {"block_size": 4, "random_blocks": 2, "seed": 1}).mask_mod(n, False)
    again = make("bigbird", {"block_size": 4, "random_blocks": 2, "seed": 1}).mask_mod(n, False)
    other = make("bigbird", {"block_size": 4, "random_blocks": 2, "seed": 2}).mask_mod(n, False)
    assert torch.equal(dense_mask(first, n), dense_mask(again, n))
    assert not torch.equal(dense_mask(first, n), dense_mask(other, n))


def test_bigbird_random_blocks_avoid_seen_blocks_and_the_future():
    options = dict(window_blocks=3, global_blocks=1, random_blocks=3, seed=0)
    table = bigbird_random_blocks(16, **options, causal=False)
    causal = bigbird_random_blocks(16, **options, causal=True)
    ends = bigbird_random_blocks(16, **options, causal=False, trailing_global_blocks=1)
    for row in range(16):
        for drawn, earliest_excluded in ((table[row], 16), (causal[row], row - 1), (ends[row], 15)):
            real = drawn[drawn >= 0]
            assert len(set(real.tolist())) == len(real), "drawn without replacement"
            assert ((real - row).abs() > 1).all() and (real >= 1).all(), "outside the window and the global block"
            assert (real < earliest_excluded).all()
    assert (table >= 0).sum() == 16 * 3, "every query block has 3 blocks to draw from when not causal"
    assert (ends >= 0).sum() == 16 * 3 and (ends < 15).all(), "the trailing global block is never drawn"
    # causal rows depend on the query block only: a shorter sequence's table is a prefix
    torch.testing.assert_close(bigbird_random_blocks(9, **options, causal=True), causal[:9], rtol=0, atol=0)


def block_rows(rows: list[str], block_size: int, n: int) -> Tensor:
    """A block-level pattern written as strings of 0/1 (one per query block), expanded to (n, n) tokens."""
    blocks = torch.tensor([[int(c) for c in row] for row in rows], dtype=torch.bool)
    return blocks.repeat_interleave(block_size, 0).repeat_interleave(block_size, 1)[:n, :n]


@pytest.mark.parametrize("n", [12, 11])
def test_bigbird_global_blocks_are_the_first_and_the_last(n):
    """The authors' ITC (google-research/bigbird ``full_bigbird_mask``: rows and columns [:b] and [-b:]
    global, window of 3 blocks; Hugging Face pads to whole blocks, so a partial last block is global),
    written out for 6 blocks of 2 tokens with g = 2 blocks and no random blocks."""
    itc = ["111111", "111001", "111101", "101111", "100111", "111111"]
    core = make("bigbird", {"block_size": 2, "random_blocks": 0})
    assert core.pattern.global_tokens == 4 and core.pattern.global_placement == "ends"
    assert torch.equal(dense_mask(core.mask_mod(n, False), n), block_rows(itc, 2, n))
    # causal: only the leading block is global (a trailing one would depend on the final length)
    leading_only = ["111111", "111000", "111100", "101110", "100111", "100011"]
    causal = block_rows(leading_only, 2, n) & torch.ones(n, n, dtype=torch.bool).tril()
    assert torch.equal(dense_mask(core.mask_mod(n, True), n), causal)
    # the previous placement, kept as an option: both global blocks at the start
    start = make("bigbird", {"block_size": 2, "random_blocks": 0, "global_placement": "start"})
    leading = ["111111", "111111", "111100", "111110", "110111", "110011"]
    assert torch.equal(dense_mask(start.mask_mod(n, False), n), block_rows(leading, 2, n))


@pytest.mark.parametrize("causal", [False, True])
def test_bigbird_random_blocks_come_from_the_middle_blocks(causal):
    """What the pattern adds to the window and the global blocks is, for each middle query block, exactly
    r distinct whole key blocks, never global, outside the window (and earlier when causal)."""
    b, num_blocks, r = 3, 12, 2
    n = b * num_blocks
    core = make("bigbird", {"block_size": b, "random_blocks": r, "seed": 5})
    blocks = dense_mask(core.mask_mod(n, causal), n)[::b, ::b]  # one token per block: whole blocks
    last = num_blocks - 1 if not causal else num_blocks
    for row in range(1, last):
        extra = [col for col in range(num_blocks) if blocks[row, col] and abs(col - row) > 1 and 0 < col < last]
        candidates = [col for col in range(1, last) if abs(col - row) > 1 and (col < row or not causal)]
        assert len(extra) == min(r, len(candidates)), f"query block {row}"
        for col in range(num_blocks):
            expected = abs(col - row) <= 1 or col in (0, last) or col in extra
            assert blocks[row, col] == (expected and (col <= row or not causal)), f"query block {row}, key {col}"


def test_bigbird_random_blocks_are_uniform_over_the_middle_blocks():
    """Each query block draws r blocks uniformly without replacement from its candidates (the authors'
    ``np.random.permutation(candidates)[:r]``): over 300 seeds every candidate comes up about r / |C| of
    the time (binomial standard deviation 0.02 here; the bound is 4 of them)."""
    num_blocks, r, seeds = 9, 2, 300
    counts = torch.zeros(num_blocks, num_blocks)
    for seed in range(seeds):
        table = bigbird_random_blocks(
            num_blocks,
            window_blocks=3,
            global_blocks=1,
            random_blocks=r,
            seed=seed,
            causal=False,
            trailing_global_blocks=1,
        )
        for row in range(num_blocks):
            counts[row, table[row]] += 1
    for row in range(1, num_blocks - 1):
        candidates = [col for col in range(1, num_blocks - 1) if abs(col - row) > 1]
        frequency = counts[row] / seeds
        assert frequency[[c for c in range(num_blocks) if c not in candidates]].sum() == 0
        torch.testing.assert_close(
            frequency[candidates], torch.full((len(candidates),), r / len(candidates)), rtol=0, atol=0.08
        )


def test_bigbird_rule_holds_a_block_table_only_with_random_blocks():
    """The rule looks random blocks up in a (blocks, blocks) table; without random blocks it holds none, so
    the bounded BigBird decoding cache does not keep a table that grows with the square of its length."""

    def tensors(rule) -> list[Tensor]:
        return [cell.cell_contents for cell in rule.__closure__ if isinstance(cell.cell_contents, Tensor)]

    assert not tensors(BigBirdPattern(block_size=4, random_blocks=0).rule(4096, True, "cpu"))
    drawn = tensors(BigBirdPattern(block_size=4, random_blocks=1).rule(64, True, "cpu"))
    assert [t.shape for t in drawn] == [(16, 16)]


def test_aliases_equal_sparse_with_their_pattern():
    q, k, v = inputs(2, 40)
    for alias, options in [
        ("longformer", {"window": 8, "global_tokens": 2}),
        ("bigbird", {"block_size": 4, "random_blocks": 1, "seed": 3}),
    ]:
        for causal in (False, True):
            expected = make("sparse", {"pattern": alias, **options})(q, k, v, causal=causal)
            torch.testing.assert_close(make(alias, options)(q, k, v, causal=causal), expected, rtol=0, atol=0)


INVALID_OPTIONS = [
    ({"pattern": "strided", "stride": 4, "block_size": 8}, "does not use block_size"),
    ({"pattern": "blockwise", "block_size": 4, "seed": 1}, "does not use seed"),
    ({"pattern": "fixed", "stride": 4}, "summary_columns must be <= stride, got 8 > 4"),
    ({"pattern": "fixed", "stride": 4, "summary_columns": 5}, "summary_columns must be <= stride"),
    ({"pattern": "longformer", "window": 7}, "window must be an even int"),
    ({"pattern": "bigbird", "window_blocks": 2}, "window_blocks must be odd"),
    ({"pattern": "bigbird", "random_blocks": -1}, "random_blocks must be >= 0"),
    ({"pattern": "bigbird", "global_tokens": 3}, "global_tokens must be even"),
    ({"pattern": "strided", "stride": 4, "global_placement": "start"}, "does not use global_placement"),
]


@pytest.mark.parametrize(("options", "message"), INVALID_OPTIONS)
def test_invalid_options_raise(options, message):
    with pytest.raises(ValueError, match=message):
        make("sparse", options)


@pytest.mark.parametrize(("options", "message"), INVALID_OPTIONS)
def test_the_pattern_objects_raise_the_same(options, message):
    settings = {option: value for option, value in options.items() if option != "pattern"}
    with pytest.raises(ValueError, match=message):
        pattern_named(options["pattern"], **settings)


def test_each_pattern_has_its_own_typed_defaults():
    """``"sparse"`` with only a pattern name, and each alias with no option, get that pattern's defaults
    (Child et al.'s stride 128 and 8 summary columns, blockwise 128, Longformer's w = 256 with one global
    token, BigBird's block 64, 3 window and 3 random blocks and two global blocks at the ends)."""
    expected = {
        "strided": StridedPattern(stride=128),
        "fixed": FixedPattern(stride=128, summary_columns=8),
        "blockwise": BlockwisePattern(block_size=128),
        "longformer": LongformerPattern(window=256, global_tokens=1),
        "bigbird": BigBirdPattern(block_size=64, window_blocks=3, global_tokens=128, random_blocks=3, seed=0,
                                  global_placement="ends"),
    }  # fmt: skip
    for name, pattern in expected.items():
        assert make("sparse", {"pattern": name}).pattern == pattern, name
    assert make("sparse", {}).pattern == expected["strided"]
    assert make("local", {}).pattern == LocalPattern(window=256)
    for alias in ("longformer", "bigbird"):
        assert make(alias, {}).pattern == expected[alias], alias
        defaults = {s.name: s.default for s in az.attention_options(az.get_attention_class(alias))}
        own = ("impl", "global_tokens", "sink_logit")  # the core's, not the pattern's
        assert all(defaults[o] == getattr(expected[alias], o) for o in defaults if o not in own)
    assert az.attention_options(az.get_attention_class("local"))[0].default == 256


@pytest.mark.parametrize(
    ("name", "options"),
    [*CONFIGS, ("bigbird", {"block_size": 3, "random_blocks": 0}), ("sparse", {"pattern": "strided", "stride": 4})],
)
def test_a_decoding_cache_keeps_exactly_the_keys_later_queries_attend(name, options):
    """``still_reachable`` after n positions, against the causal pattern of 90 positions: every key that some
    query at a position >= n attends is kept, and no other (with random blocks: every key is kept)."""
    horizon = 90
    pattern = make(name, options).pattern
    allowed = dense_mask(pattern.mask_mod(horizon, True), horizon)
    random_blocks = isinstance(pattern, BigBirdPattern) and pattern.random_blocks > 0
    for n in range(1, 60):
        needed = allowed[n:, :n].any(dim=0)
        kept = pattern.still_reachable(torch.arange(n), n)
        assert not (needed & ~kept).any(), f"n={n}: a key a later query attends was dropped"
        assert random_blocks or torch.equal(kept, needed), f"n={n}: an unreachable key was kept"


def test_local_window_must_be_even():
    with pytest.raises(ValueError, match="even int >= 2.*got 5"):
        make("local", {"window": 5})


def test_half_precision_is_computed_in_float32():
    q, k, v = (t.float() for t in inputs(2, 40))
    core = make("sparse", {"pattern": "bigbird", "block_size": 4, "global_tokens": 4, "random_blocks": 1}).float()
    expected = core(q, k, v, causal=True)
    low = [t.bfloat16().requires_grad_(True) for t in (q, k, v)]
    out = core(*low, causal=True)
    out.float().sum().backward()
    assert out.dtype == torch.bfloat16 and all(t.grad.dtype == torch.bfloat16 for t in low)
    torch.testing.assert_close(out.float(), expected, rtol=0.0, atol=3e-2)  # bf16 inputs: 8-bit mantissa


def test_cross_attention_is_refused():
    q, k, v = inputs(1, 24)
    k, v = inputs(1, 40)[1:]
    with pytest.raises(ValueError, match="self-attention only"):
        make("local", {"window": 8})(q, k, v)


@pytest.mark.parametrize(
    ("name", "options", "keys_per_query"),
    [
        ("local", {"window": 16}, 8 + 16),  # tiles of 8 queries, each against a band of 8 + 16 keys
        ("sparse", {"pattern": "bigbird", "block_size": 8, "global_tokens": 0, "random_blocks": 1}, (3 + 1) * 8),
    ],
)
def test_blocked_path_memory_is_linear_in_n(name, options, keys_per_query):
    """No tensor of the blocked forward + backward grows as n^2: the largest is heads x n x (keys per tile)."""
    n = 512
    core = make(name, options)
    q, k, v = (t.requires_grad_(True) for t in inputs(1, n))
    core(q, k, v)  # the layout is built (and cached) once per length
    with LargestOutput() as forward:
        out = core(q, k, v, mask=pad_mask(torch.tensor([500]), n))
    with LargestOutput() as probe:
        out.sum().backward()
    assert "bmm" in probe.ops, "the probe saw the backward's products"
    assert max(forward.numel, probe.numel) <= HEADS * n * keys_per_query < n * n
    with LargestOutput() as dense:
        make(name, options, impl="dense")(q, k, v)
    assert dense.numel >= HEADS * n * n, "the probe sees an n x n tensor where there is one"


def test_causal_mask_composes_like_flex_attention():
    mask_mod = and_masks(make("local", {"window": 4}).pattern.rule(6, True, "cpu"), causal_mask)
    expected = torch.tensor([[abs(i - j) <= 2 and j <= i for j in range(6)] for i in range(6)])
    assert torch.equal(dense_mask(mask_mod, 6), expected)


def test_a_layout_leaves_out_the_tiles_that_touch_no_key():
    # only queries 0 and 1 attend (keys 5..): of the four tiles of 4 rows, only the first has work
    def first_rows(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (q_idx < 2) & (kv_idx >= 5)

    layout = layout_from_mask(first_rows, 16, 4, torch.device("cpu"))
    assert [group.rows.tolist() for group in layout] == [[[0, 1, 2, 3]]]
    assert layout[0].key_index.tolist() == [list(range(5, 16))]
    assert layout_from_mask(lambda b, h, q_idx, kv_idx: q_idx < 0, 16, 4, torch.device("cpu")) == ()


@pytest.mark.parametrize("pattern", [{"pattern": "strided", "stride": 4}, {"pattern": "longformer", "window": 6}])
def test_a_band_plus_rest_pattern_runs_its_band_on_the_band_kernel(pattern, monkeypatch):
    calls = []
    real = sparse.band_and_tiled_attention
    monkeypatch.setattr(sparse, "band_and_tiled_attention", lambda *a: calls.append(a[3]) or real(*a))
    core = az.create_attention("sparse", dim_head=8, heads=2, max_seq_len=32, **pattern).double()
    q, k, v = (torch.randn(2, 2, 32, 8, dtype=torch.float64) for _ in range(3))
    core(q, k, v)
    assert calls == [core.pattern.banded(False)]
