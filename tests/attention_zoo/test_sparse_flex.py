"""The sparse family's FlexAttention path (``impl="flex"``, and ``impl="auto"``'s choice of it).

On the CPU, FlexAttention runs only as torch's eager fallback, forward only: there ``impl="flex"`` must equal
``impl="dense"`` (the (n, n) reference from the same mask function) in float64 to 1e-10 for every pattern,
causal and not, with key padding that empties whole rows (a fully padded sequence; left padding, so the first
causal queries have no allowed key), and those rows must be exactly zero. One comparison uses a reference
written out here from the pattern's definition, independent of the library's mask functions. ``auto`` picks
the blocked kernel on the CPU, and training with ``impl="flex"`` there fails with a message naming
``impl='blocked'``.

Patterns run as parts (:class:`~attention_zoo.sparse.flex.FlexPart`: BigBird at tiles of its block, strided with its
columns in residue order, fixed with its summary columns gathered): flex equals dense and blocked in float64, causal
and not, with padding, a learned sink (strided), lengths that are multiples of neither tile nor stride; the parts'
rules are pointwise and disjoint, and cover the pattern. Tile densities: counted by hand on a small case, the
chunked count equals the block masks' own, a block-aligned BigBird's equals its fraction of allowed pairs, and the
strided and fixed splits are strictly sparser than one call in position order.

On CUDA (``@pytest.mark.cuda``, skipped elsewhere): the compiled kernel, forward and backward, in float32,
bfloat16 and float16 at n = 1024 and 2048 with head dim 64, against the dense path run in float64 on the same
inputs; the parts (BigBird at tiles of 64, autotuned; strided; fixed) in bfloat16 at n = 1000, causal and not.
The bound is on the relative error ||x - ref|| / ||ref|| of the output and of each gradient: float32 1e-3 (TF32
matmuls, where enabled, round to 10 mantissa bits), bfloat16 2e-2 (8 bits), float16 5e-3 (11 bits).
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

import attention_zoo as az
from attention_zoo.core import Geometry
from attention_zoo.masks import pad_mask
from attention_zoo.sparse import flex as flex_module
from attention_zoo.sparse.attention import PatternAttention
from attention_zoo.sparse.mask_mods import dense_mask, generate_blockwise, generate_sliding_window
from attention_zoo.sparse.patterns import BigBirdPattern, FixedPattern, StridedPattern
from tests.attention_zoo.allocations import LargestOutput
from tests.attention_zoo.test_sparse import CONFIGS, reference_allowed  # the family's configurations

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile"),
]

TIGHT = dict(rtol=0.0, atol=1e-10)  # float64: equal up to summation order
HEADS, DIM_HEAD = 2, 16

IDS = [f"{name}-{'-'.join(map(str, options.values()))}" for name, options in CONFIGS]


def make(name: str, options: dict, dim_head: int = DIM_HEAD, **extra) -> az.AttentionCore:
    return az.create_attention(name, dim_head=dim_head, heads=HEADS, **options, **extra)


def inputs(b: int, n: int, dim_head: int = DIM_HEAD, dtype=torch.float64, seed: int = 0) -> list[Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(b, HEADS, n, dim_head, generator=generator, dtype=dtype) for _ in range(3)]


def padding(n: int) -> Tensor:
    """Right padding, left padding (the first 10 keys: early causal queries see nothing) and all padding."""
    mask = pad_mask(torch.tensor([n, n - 11, n, 0]), n)
    mask[2, :10] = False
    return mask


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("name", "options"), CONFIGS, ids=IDS)
def test_flex_equals_dense(name, options, causal):
    flex, dense = make(name, options, impl="flex"), make(name, options, impl="dense")
    for n in (32, 48):  # one core for all: a second length and the key padding reuse its traces
        q, k, v = inputs(4, n)
        for mask in (None, padding(n)):
            with torch.no_grad():
                out = flex(q, k, v, mask=mask, causal=causal)
                expected = dense(q, k, v, mask=mask, causal=causal)
            torch.testing.assert_close(out, expected, **TIGHT, msg=f"n={n}, padded={mask is not None}")
            if mask is not None:
                assert torch.equal(out[3], torch.zeros_like(out[3])), "a fully padded sequence gives zeros"
            if mask is not None and causal:  # queries 0..9 of the left-padded sequence have no allowed key
                assert torch.equal(out[2, :, :10], torch.zeros_like(out[2, :, :10]))
    assert set(flex._block_masks) == {(n, causal, torch.device("cpu")) for n in (32, 48)}


#: what Inductor lowers inside a pointwise subgraph: elementwise ops on the indices, and the lookup of an
#: element in a table made beforehand; no reduction (BigBird's table gathered and reduced over r), no copy
POINTWISE_OPS = {
    "abs", "sub", "add", "mul", "remainder", "floor_divide", "eq", "ne", "lt", "le", "gt", "ge",
    "bitwise_or", "bitwise_and", "bitwise_not", "logical_or", "logical_and", "logical_not", "index",
}  # fmt: skip


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n", [20, 37, 64])
@pytest.mark.parametrize(("name", "options"), CONFIGS, ids=IDS)
def test_the_one_rule_is_pointwise_and_the_pattern(name, options, n, causal):
    """The compiled kernel and the blocked and dense paths evaluate one mask function per pattern: it must be
    pointwise for the kernel (BigBird's random blocks included), and it is the pattern as written from the
    papers' definitions in tests/attention_zoo/test_sparse.py."""
    core = make(name, options)
    rule = core.pattern.rule(n, causal, torch.device("cpu"))
    zero, positions = torch.zeros((), dtype=torch.long), torch.arange(n)
    rows, columns = positions[:, None], positions[None, :]
    with LargestOutput() as probe:
        rule(zero, zero, rows, columns)
    assert probe.ops <= POINTWISE_OPS, f"not pointwise: {sorted(probe.ops - POINTWISE_OPS)}"
    kind = options.get("pattern", name)
    expected = reference_allowed(kind, {o: x for o, x in options.items() if o != "pattern"}, n, causal)
    assert torch.equal(dense_mask(core.mask_mod(n, causal, torch.device("cpu")), n), expected)


def test_flex_equals_a_reference_written_from_the_definition():
    """Causal local attention, w = 8: query i sees keys j with i - 4 <= j <= i, minus padded keys; written out
    here with loops and an explicit softmax, sharing no code with the library."""
    n, half = 40, 4
    q, k, v = inputs(4, n, seed=1)
    mask = padding(n)
    allowed = torch.zeros(4, 1, n, n, dtype=torch.bool)
    for b in range(4):
        for i in range(n):
            for j in range(n):
                allowed[b, 0, i, j] = i - half <= j <= i and bool(mask[b, j])
    scores = (q @ k.transpose(-1, -2)) / DIM_HEAD**0.5
    scores = torch.where(allowed, scores, float("-inf"))
    weights = torch.exp(scores - scores.amax(dim=-1, keepdim=True).nan_to_num(neginf=0.0))
    total = weights.sum(dim=-1, keepdim=True)
    expected = (weights / torch.where(total > 0, total, 1.0)) @ v
    with torch.no_grad():
        out = make("local", {"window": 8}, impl="flex")(q, k, v, mask=mask, causal=True)
    torch.testing.assert_close(out, expected, **TIGHT)
    empty = ~allowed.any(dim=-1)  # (B, 1, N): rows with no allowed key
    assert empty[2, 0, :10].all() and empty[3].all()
    assert torch.equal(out.masked_select(empty[..., None]), torch.zeros(int(empty.sum()) * HEADS * DIM_HEAD).double())


def test_auto_runs_blocked_on_cpu():
    core = make("sparse", {"pattern": "blockwise", "block_size": 8})
    assert core.impl == "auto"
    q, k, v = inputs(1, 32, dtype=torch.float32)
    assert core.resolved_impl(q) == "blocked"
    out = core(q, k, v, causal=True)
    assert core._layouts and not core._block_masks
    torch.testing.assert_close(
        out, make("sparse", {"pattern": "blockwise", "block_size": 8}, impl="blocked")(q, k, v, causal=True)
    )


def test_training_with_flex_on_cpu_is_a_clear_error():
    core = make("local", {"window": 8}, impl="flex")
    q, k, v = (t.requires_grad_(True) for t in inputs(2, 32))
    with pytest.raises(ValueError, match="impl='blocked'"):
        core(q, k, v, causal=True)
    with torch.no_grad():  # the forward alone runs
        assert core(q, k, v, causal=True).shape == q.shape


def test_flex_refuses_head_dims_below_16():
    with pytest.raises(ValueError, match="dim_head >= 16.*got 8"):
        make("local", {"window": 8}, dim_head=8, impl="flex")
    core = make("local", {"window": 8}, dim_head=8)  # auto: falls back to blocked wherever it runs
    q, k, v = inputs(1, 32, dim_head=8)
    assert core.resolved_impl(q) == "blocked"


# --- patterns run as parts ------------------------------------------------------------------------------------

#: patterns that run as parts: BigBird at tiles of its block (64), strided and fixed as two calls; lengths that are
#: multiples of neither the tile nor the stride
SPLIT = [
    ("bigbird", {"block_size": 64, "random_blocks": 2}, (200, 337)),
    ("sparse", {"pattern": "strided", "stride": 5}, (37, 64)),
    ("sparse", {"pattern": "fixed", "stride": 8, "summary_columns": 3}, (45, 64)),
]
CPU = torch.device("cpu")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("name", "options", "lengths"), SPLIT, ids=[s[1].get("pattern", s[0]) for s in SPLIT])
def test_parts_equal_dense_and_blocked(name, options, lengths, causal):
    cores = {impl: make(name, options, impl=impl) for impl in ("flex", "dense", "blocked")}
    for n in lengths:
        q, k, v = inputs(4, n)
        calls = cores["flex"]._block_masks if n == lengths[0] else None
        for mask in (None, padding(n)):
            with torch.no_grad():
                out = {impl: core(q, k, v, mask=mask, causal=causal) for impl, core in cores.items()}
            for impl in ("dense", "blocked"):
                torch.testing.assert_close(
                    out["flex"], out[impl], **TIGHT, msg=f"{impl}, n={n}, padded={mask is not None}"
                )
            if mask is not None:
                assert torch.equal(out["flex"][3], torch.zeros_like(out["flex"][3]))
            if mask is not None and causal:
                assert torch.equal(out["flex"][2, :, :10], torch.zeros_like(out["flex"][2, :, :10]))
        if calls is not None:
            (planned,) = calls.values()
            expected = {"bigbird": [(64, 64)]}.get(name, [(128, 128)] * 2)
            assert [c.block_mask.BLOCK_SIZE for c in planned] == expected


@pytest.mark.parametrize("causal", [False, True])
def test_parts_merge_a_learned_sink_once(causal):
    """Strided with ``sink_logit``: the sink enters the merged log-sum-exp once (one per part would count it twice)."""
    cores = {
        impl: PatternAttention(
            Geometry(dim_head=DIM_HEAD, heads=HEADS), pattern=StridedPattern(stride=5), impl=impl, sink_logit=True
        )  # fmt: skip
        for impl in ("flex", "dense", "blocked")
    }
    for core in cores.values():
        core.double()
        core.sinks.data = torch.tensor([0.7, -1.3], dtype=torch.float64)
    q, k, v = inputs(4, 37, seed=3)
    mask = padding(37)
    with torch.no_grad():
        out = {impl: core(q, k, v, mask=mask, causal=causal) for impl, core in cores.items()}
    torch.testing.assert_close(out["flex"], out["dense"], **TIGHT)
    torch.testing.assert_close(out["flex"], out["blocked"], **TIGHT)
    assert torch.equal(out["flex"][3], torch.zeros_like(out["flex"][3])), "no key: zeros, whatever the sink"


PATTERNS = [BigBirdPattern(block_size=64, random_blocks=2), StridedPattern(stride=5), FixedPattern(8, 3)]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("pattern", PATTERNS, ids=lambda p: type(p).__name__)
def test_parts_are_pointwise_disjoint_and_cover_the_pattern(pattern, causal):
    n = 203
    covered = torch.zeros(n, n, dtype=torch.long)
    zero = torch.zeros((), dtype=torch.long)
    for part in pattern.flex_parts(n, causal, CPU):
        nk = n if part.keys is None else len(part.keys)
        rows, columns = torch.arange(n)[:, None], torch.arange(nk)[None, :]
        with LargestOutput() as probe:
            allowed = part.mask_mod(zero, zero, rows, columns)
        allowed = allowed.expand(n, nk)
        extra = probe.ops - POINTWISE_OPS - {"new_ones"}  # new_ones: and_masks' scalar True, where causal starts
        assert not extra, f"not pointwise: {sorted(extra)}"
        queries = torch.arange(n) if part.queries is None else part.queries
        keys = torch.arange(nk) if part.keys is None else part.keys
        covered.index_put_(
            (queries[:, None].expand(n, nk), keys[None, :].expand(n, nk)), allowed.long(), accumulate=True
        )
    assert covered.max() <= 1, "a (query, key) pair in two parts"
    assert torch.equal(covered.bool(), dense_mask(pattern.mask_mod(n, causal, CPU), n))


def test_tile_density_counted_by_hand():
    """n = 10 at tiles of 4: a 3 x 3 grid, the last row and column half padding (padding counts as masked).
    Blockwise b = 4: tiles (0, 0) and (1, 1) full, (2, 2) partial (2 x 2 real pairs of 16). Window |i - j| <= 2:
    the diagonal and its two neighbours, all partial, (0, 2) and (2, 0) empty."""
    blockwise = flex_module.build_block_mask(generate_blockwise(4), 10, CPU, block_size=4)
    assert flex_module.tile_density(blockwise) == flex_module.TileDensity(partial=1 / 9, full=2 / 9)
    window = flex_module.build_block_mask(generate_sliding_window(4), 10, CPU, block_size=(4, 4))
    assert flex_module.tile_density(window) == flex_module.TileDensity(partial=7 / 9, full=0.0)
    assert flex_module._tile_counts(generate_sliding_window(4), 10, 10, (4, 4), CPU) == (7, 0)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("pattern", PATTERNS, ids=lambda p: type(p).__name__)
def test_the_chunked_count_equals_the_block_masks(pattern, causal):
    """:func:`pattern_tile_density` counts tiles from the mask functions without building the block masks: it must
    give the tiles of the block masks the flex path runs."""
    n = 300
    calls = flex_module.plan_flex_calls(pattern.flex_parts(n, causal, CPU), n, CPU)
    dense = (-(-n // 128) * 128) ** 2
    partial = full = 0.0
    for call in calls:
        density, (rows, columns) = flex_module.tile_density(call.block_mask), call.block_mask.BLOCK_SIZE
        grid = -(-n // rows) * rows * -(-call.block_mask.seq_lengths[1] // columns) * columns
        partial, full = partial + density.partial * grid / dense, full + density.full * grid / dense
    counted = flex_module.pattern_tile_density(pattern, n, causal)
    assert counted.partial == pytest.approx(partial, abs=1e-12) and counted.full == pytest.approx(full, abs=1e-12)


def test_bigbird_at_tiles_of_its_block_is_as_dense_as_its_pairs():
    """n a multiple of b = 64: every tile is one (query block, key block) pair, all allowed or none, so the tile
    density is exactly the fraction of allowed pairs (keys per query / n); at 128 x 128 tiles it is above it."""
    pattern, n = BigBirdPattern(block_size=64), 64 * 48
    pairs = float(dense_mask(pattern.mask_mod(n, False, CPU), n).double().mean())
    density = flex_module.pattern_tile_density(pattern, n, causal=False)
    assert density.density == pytest.approx(pairs, abs=1e-12) and density.partial == 0.0
    natural = flex_module._tile_counts(pattern.mask_mod(n, False, CPU), n, n, (128, 128), CPU)
    assert sum(natural) / (n // 128) ** 2 > 1.5 * pairs


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("pattern", [StridedPattern(stride=64), FixedPattern(stride=64, summary_columns=4)],
                         ids=["strided", "fixed"])  # fmt: skip
def test_the_split_is_sparser_than_position_order(pattern, causal):
    """In position order the strided columns and fixed's summary columns touch every tile of a row (below the
    diagonal when causal); the split's tiles cover a small fraction."""
    n = 4096
    natural = flex_module._tile_counts(pattern.mask_mod(n, causal, CPU), n, n, (128, 128), CPU)
    natural_density = sum(natural) / (n // 128) ** 2
    split = flex_module.pattern_tile_density(pattern, n, causal).density
    assert natural_density > (0.5 if causal else 0.99)
    assert split < 0.2 * natural_density


# --- CUDA: the compiled kernel ------------------------------------------------------------------------------

CUDA_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 2e-2, torch.float16: 5e-3}
CUDA_CONFIGS = [
    ("local", {"window": 256}, True),
    ("bigbird", {"block_size": 128, "random_blocks": 3}, False),  # the default tile (64: the parts' test below)
]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def relative_error(x: Tensor, ref: Tensor) -> float:
    return float((x.double() - ref).norm() / ref.norm())


def cuda_inputs(n: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """q, k, v, an output gradient (2, 4, n, 64) in float64 on CUDA, and a mask: row 1 padded 100 on the right and
    300 on the left, wider than a window or a block, so its first causal queries see no key."""
    torch.manual_seed(0)
    q, k, v, grad = (torch.randn(2, 4, n, 64, device="cuda", dtype=torch.float64) for _ in range(4))
    mask = pad_mask(torch.tensor([n, n - 100]), n).cuda()
    mask[1, :300] = False
    return q, k, v, grad, mask


def assert_flex_matches_float64(cores: dict[str, az.AttentionCore], inputs: tuple[Tensor, ...], causal: bool,
                                dtype: torch.dtype, label: str) -> None:  # fmt: skip
    """``cores["flex"]`` in ``dtype`` against ``cores["dense"]`` in float64, forward and backward on
    :func:`cuda_inputs`: out, dq, dk, dv finite and within ``CUDA_TOLERANCE[dtype]``; causal, the queries that see
    no key exactly 0."""
    *qkv, grad, mask = inputs
    runs = {}
    for impl, run_dtype in (("flex", dtype), ("dense", torch.float64)):
        leaves = [t.to(run_dtype).requires_grad_(True) for t in qkv]
        out = cores[impl](*leaves, mask=mask, causal=causal)
        out.backward(grad.to(run_dtype))
        runs[impl] = [out.detach()] + [t.grad for t in leaves]
    for what, x, ref in zip(("out", "dq", "dk", "dv"), runs["flex"], runs["dense"], strict=True):
        assert x.dtype == dtype and torch.isfinite(x).all(), what
        error = relative_error(x, ref)
        print(f"{label} {dtype} causal={causal} {what}: relative error {error:.2e}")
        assert error <= CUDA_TOLERANCE[dtype], f"{what}: relative error {error:.2e}"
    if causal:
        assert torch.equal(runs["flex"][0][1, :, :300], torch.zeros_like(runs["flex"][0][1, :, :300]))


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("n", [1024, 2048])
@pytest.mark.parametrize("dtype", list(CUDA_TOLERANCE), ids=str)
@pytest.mark.parametrize(("name", "options", "causal"), CUDA_CONFIGS, ids=[c[0] for c in CUDA_CONFIGS])
def test_flex_matches_float64_dense_on_cuda(name, options, causal, dtype, n):
    cores = {impl: az.create_attention(name, dim_head=64, heads=4, impl=impl, **options) for impl in ("flex", "dense")}
    assert_flex_matches_float64(cores, cuda_inputs(n), causal, dtype, f"{name} n={n}")


@pytest.mark.cuda
@needs_cuda
def test_auto_runs_flex_on_cuda():
    q, k, v = (torch.randn(1, 4, 256, 64, device="cuda") for _ in range(3))
    core = az.create_attention("local", dim_head=64, heads=4, window=64)
    assert core.resolved_impl(q) == "flex"
    out = core(q, k, v, causal=True)
    assert core._block_masks and not core._layouts
    expected = az.create_attention("local", dim_head=64, heads=4, window=64, impl="dense")(q, k, v, causal=True)
    assert relative_error(out, expected.double()) <= CUDA_TOLERANCE[torch.float32]
    assert core.resolved_impl(q.double()) == "blocked"  # a dtype the compiled kernel does not take


#: the parts on CUDA: BigBird at tiles of 64 (the autotuned compile), strided and fixed as two calls (default tiles)
CUDA_SPLIT = [
    ("bigbird", {"block_size": 64, "random_blocks": 3}),
    ("sparse", {"pattern": "strided", "stride": 128}),
    ("sparse", {"pattern": "fixed", "stride": 128, "summary_columns": 8}),
]


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("name", "options"), CUDA_SPLIT, ids=[c[1].get("pattern", c[0]) for c in CUDA_SPLIT])
def test_parts_match_float64_dense_on_cuda(name, options, causal):
    n = 1000  # a multiple of neither the tile nor the stride
    cores = {impl: az.create_attention(name, dim_head=64, heads=4, impl=impl, **options) for impl in ("flex", "dense")}
    assert_flex_matches_float64(cores, cuda_inputs(n), causal, torch.bfloat16, f"{name} {options}")
    (calls,) = cores["flex"]._block_masks.values()
    assert len(calls) == (1 if name == "bigbird" else 2)
