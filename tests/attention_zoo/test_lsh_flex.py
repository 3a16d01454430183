"""LSH attention's FlexAttention path (``impl="flex"``, and ``impl="auto"``'s choice of it) against its chunked path.

On the CPU, FlexAttention runs as torch's eager fallback, forward only. There the flex path must equal the chunked
path (float64 to 1e-10, float32 to 1e-5) for several (n, bucket size, rounds, chunk length), causal and not, with
padding (right, left, a hole, a fully padded sequence) and n not a multiple of the chunk. The fallback ignores the
block mask, so the tiles are tested on their own: they hold every pair of the chunk band, and the rule the kernel
evaluates gives exactly U_r A_i^(r) of the definitions (tests/attention_zoo/test_lsh.py's ``key_sets``), each
pair in one round only. Torch has no FlexAttention backward on the CPU: with a dense differentiable stand-in for
the kernel, the gradients of everything around it (sort, un-sort, combination of the rounds, self rule) equal
the chunked path's. Inputs built to force a pair into several rounds, and a token with no key (the self rule), a
NaN query, the CPU training refusal, ``auto`` = chunked on the CPU, and one compiled graph for every call (no
recompilation per batch).

On CUDA (``@pytest.mark.cuda``, skipped elsewhere): the compiled kernel forward and backward against the chunked
path on the same inputs, float32 and bfloat16 (relative errors as tests/attention_zoo/test_sparse_flex.py), and
no host synchronisation once warm.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torch import Tensor
from torch.nn.attention.flex_attention import create_mask, flex_attention

import attention_zoo as az
import attention_zoo.lsh.flex as lsh_flex
import attention_zoo.sparse.flex as sparse_flex
from attention_zoo.lsh.attention import sorted_windows
from attention_zoo.masks import pad_mask
from tests.attention_zoo.allocations import LargestOutput
from tests.attention_zoo.test_lsh import dense_reference, key_sets
from tests.attention_zoo.test_sparse_flex import POINTWISE_OPS

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile"),
]

HEADS, DIM_HEAD, MAX_LEN = 2, 16, 320
TOLERANCE = {torch.float64: dict(rtol=0.0, atol=1e-10), torch.float32: dict(rtol=1e-5, atol=1e-5)}
CASES = [  # (options, n): n never a multiple of the chunk length
    ({"n_hashes": 4, "bucket_size": 4}, 29),
    ({"n_hashes": 1, "n_buckets": 4, "chunk_size": 6}, 40),
    ({"n_hashes": 4, "n_buckets": 2, "chunk_size": 5}, 37),  # few buckets: pairs recur across rounds
    ({"n_hashes": 2, "bucket_size": 16}, 300),  # several 128-wide tiles
]
IDS = [f"{'-'.join(f'{k}{v}' for k, v in options.items())}-n{n}" for options, n in CASES]


def make(impl: str = "flex", dim_head: int = DIM_HEAD, **options) -> az.AttentionCore:
    return az.create_attention("lsh", dim_head=dim_head, heads=HEADS, max_seq_len=MAX_LEN, impl=impl, **options)


def inputs(b: int, n: int, dtype=torch.float64, seed: int = 0) -> list[Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(b, HEADS, n, DIM_HEAD, generator=generator, dtype=dtype) for _ in range(2)]


def padding(n: int) -> Tensor:
    """Full, right padding, left padding with a hole, and a fully padded sequence."""
    mask = pad_mask(torch.tensor([n, n - 7, n, 0]), n)
    mask[2, :5], mask[2, 10:13] = False, False
    return mask


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("options", "n"), CASES, ids=IDS)
def test_flex_equals_chunked(options, n, causal, dtype):
    flex, chunked = make("flex", **options).to(dtype), make("chunked", **options).to(dtype)
    q, v = inputs(4, n, dtype)
    for mask in (None, padding(n)):
        with torch.no_grad():
            out = flex(q, q, v, mask=mask, causal=causal)
            expected = chunked(q, q, v, mask=mask, causal=causal)
        assert out.dtype == dtype
        torch.testing.assert_close(out, expected, **TOLERANCE[dtype], msg=f"padded={mask is not None}")
        if mask is not None:
            assert (out.masked_select(~mask[:, None, :, None]) == 0).all(), "padded outputs are zero"


def sorted_tables(core, q: Tensor, real: Tensor, causal: bool):
    """The chunk length, the sort and the kernel's rule, as :meth:`LSHAttention.attend` makes them (n already a
    multiple of the chunk length)."""
    m, n_buckets = core.chunk_and_buckets(q.shape[2], causal)
    assert q.shape[2] % m == 0
    order, place, lo, hi = sorted_windows(core.buckets(q, real, n_buckets), n_buckets, m, causal)
    return m, place, lsh_flex.lsh_mask_mod(*lsh_flex.round_tables(order, place, lo, hi))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("options", [options for options, _ in CASES[:3]], ids=str)
def test_the_rule_is_the_union_of_key_sets_each_pair_once(options, causal):
    """The rule over each round's sorted places, mapped back to tokens: summed over the rounds it is 1 exactly on
    U_r A_i^(r) of the definitions and 0 elsewhere (a pair of several rounds counts in one), for real queries."""
    n = 60  # a multiple of every chunk length here
    core = make(**options).double()
    q, _ = inputs(2, n, seed=3)
    real = pad_mask(torch.tensor([n, n - 9]), n)
    _, place, rule = sorted_tables(core, q, real, causal)
    rounds = core.n_hashes
    allowed = create_mask(rule, 2, HEADS * rounds, n, n, device="cpu").view(2, HEADS, rounds, n, n)
    rows = place[..., :, None].expand(-1, -1, -1, -1, n)
    cols = place[..., None, :].expand(-1, -1, -1, n, -1)
    by_token = allowed.gather(-2, rows).gather(-1, cols).sum(2)  # [b, h, i, j]: rounds that attend j from i
    by_token = by_token * real[:, None, :, None] * real[:, None, None, :]
    assert torch.equal(by_token, key_sets(core, q, real, causal).long())
    if options.get("n_buckets") == 2:  # the test sees pairs of several rounds
        assert (key_sets(core, q, real, causal, count=True) > 1).sum() > 50


@pytest.mark.parametrize("m", [4, 16, 48, 64, 100, 128, 256])
@pytest.mark.parametrize("chunks", [1, 3, 17])
def test_the_tiles_hold_the_chunk_band(m, chunks):
    """Every pair of places in chunks c - 1 and c of query chunk c lies in a tile of the block mask; when m divides
    the tile, a query tile reads exactly two key tiles (the first one)."""
    n = m * chunks
    band = lsh_flex.band_block_mask(n, m, torch.device("cpu"))
    tiles = band.to_dense()[0, 0].bool()
    places = torch.arange(n)
    query_chunk, key_chunk = places[:, None] // m, places[None, :] // m
    needed = (key_chunk == query_chunk) | (key_chunk == query_chunk - 1)
    covered = tiles[places[:, None] // lsh_flex.TILE, places[None, :] // lsh_flex.TILE]
    assert not (needed & ~covered).any()
    if lsh_flex.TILE % m == 0 and n > lsh_flex.TILE:
        counts = band.kv_num_blocks[0, 0]
        assert counts[0] == 1 and (counts[1:] == 2).all()
    assert band.seq_lengths == (n, n)
    assert lsh_flex.band_block_mask(n, m, torch.device("cpu")) is band  # cached


def test_the_rule_is_pointwise():
    """The compiled kernel evaluates the rule elementwise: lookups and comparisons only (a table's slot is a
    constant index, which torch's indexing takes as views: select, unsqueeze)."""
    core = make(n_hashes=4, n_buckets=2, chunk_size=5)
    q, _ = inputs(1, 20)
    _, _, rule = sorted_tables(core, q, torch.ones(1, 20, dtype=torch.bool), False)
    zero, positions = torch.zeros(1, 1, dtype=torch.long), torch.arange(20)
    with LargestOutput() as probe:
        rule(zero, zero, positions[:, None], positions[None, :])
    allowed = POINTWISE_OPS | {"select", "unsqueeze"}
    assert probe.ops <= allowed, f"not pointwise: {sorted(probe.ops - allowed)}"


def test_pairs_in_several_rounds_count_once(monkeypatch):
    """Few buckets, four rounds: many pairs meet in several rounds. The output is softmax attention over the union
    with each key once (the definitions' reference); the rule without its earlier-round test counts them again."""
    options, n = CASES[2]
    core = make(**options).double()
    q, v = inputs(2, n, seed=1)
    real = pad_mask(torch.tensor([n, n - 6]), n)
    assert (key_sets(core, q, real, False, count=True) > 1).sum() > 50
    with torch.no_grad():
        out = core(q, q, v, mask=real)
    torch.testing.assert_close(out, dense_reference(core, q, v, real, False), **TOLERANCE[torch.float64])
    tables = lsh_flex.round_tables

    def current_round_only(*args: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        lows, highs, key_places = tables(*args)
        return lows[:1], highs[:1], key_places[:0]

    monkeypatch.setattr(lsh_flex, "round_tables", current_round_only)
    with torch.no_grad():
        recounted = core(q, q, v, mask=real)
    assert not torch.allclose(recounted, out, rtol=0.0, atol=1e-6)


@pytest.mark.parametrize("causal", [False, True])
def test_a_token_with_no_key_attends_to_itself(causal):
    """Tokens 0..n-2 point one way and token n - 1 the other, so n - 1 shares no bucket with any token in any
    round (h(-x) = h(x) + n_buckets / 2 mod n_buckets): alone non-causally; causally token 0 has no earlier token.
    Either gives o_i = v_i exactly (the self rule), as the chunked path."""
    n = 24
    q = torch.zeros(1, HEADS, n, DIM_HEAD, dtype=torch.float64)
    q[..., 0] = 1.0
    q[..., 1] = torch.linspace(0.1, 0.3, n, dtype=torch.float64)
    q[:, :, -1] = -q[:, :, -1]
    _, v = inputs(1, n, seed=2)
    options = {"n_hashes": 4, "n_buckets": 4, "chunk_size": 8}
    flex, chunked = make(**options).double(), make("chunked", **options).double()
    with torch.no_grad():
        out = flex(q, q, v, causal=causal)
    alone = 0 if causal else n - 1
    real = torch.ones(1, n, dtype=torch.bool)
    assert not key_sets(flex, q, real, causal)[:, :, alone].any()
    assert torch.equal(out[:, :, alone], v[:, :, alone])
    torch.testing.assert_close(out, chunked(q, q, v, causal=causal), **TOLERANCE[torch.float64])


@pytest.mark.parametrize("causal", [False, True])
def test_a_nan_query_gives_nan_where_the_chunked_path_does(causal):
    q, v = inputs(2, 32, seed=15)
    q[0, 0, 3, 0] = math.nan
    flex, chunked = make(n_hashes=2, bucket_size=4), make("chunked", n_hashes=2, bucket_size=4)
    with torch.no_grad():
        out = flex(q, q, v, causal=causal)
    assert out[0, 0, 3].isnan().all() and torch.isfinite(out[1]).all()
    torch.testing.assert_close(out, chunked(q, q, v, causal=causal), equal_nan=True, **TOLERANCE[torch.float64])


def test_packed_rows_run_each_document_through_flex():
    """Packed rows keep their path (each document on its own, documents of one length together), with the flex
    kernel inside."""
    q, v = inputs(2, 30, seed=6)
    segments = torch.tensor([[0, 10, 25, 30], [0, 12, 24, 24]])
    flex, chunked = make(n_hashes=2, bucket_size=4).double(), make("chunked", n_hashes=2, bucket_size=4).double()
    with torch.no_grad():
        out = flex(q, q, v, segments=segments)
    torch.testing.assert_close(out, chunked(q, q, v, segments=segments), **TOLERANCE[torch.float64])


def dense_flex_attention(q: Tensor, k: Tensor, v: Tensor, *, block_mask, scale: float, **lse_request):
    """FlexAttention's contract (out, and the log-sum-exp per row: -inf with output 0 where no key is allowed) in
    differentiable dense torch, with the rule of ``block_mask``: a stand-in for the kernel torch cannot
    differentiate on the CPU."""
    b, h, n, _ = q.shape
    allowed = create_mask(block_mask.mask_mod, b, h, n, n, device=q.device)
    scores = (q @ k.mT * scale).masked_fill(~allowed, -math.inf)
    top = scores.detach().amax(dim=-1, keepdim=True)
    exp = (scores - torch.where(torch.isinf(top), 0.0, top)).exp()
    total = exp.sum(dim=-1, keepdim=True)
    empty = total == 0
    out = exp @ v / torch.where(empty, 1.0, total)
    lse = torch.where(empty, -math.inf, torch.where(empty, 1.0, total).log() + torch.where(torch.isinf(top), 0, top))
    lse = lse.squeeze(-1)
    return out, (lse if "return_lse" in lse_request else SimpleNamespace(lse=lse))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("options", "n"), CASES[:3], ids=IDS[:3])
def test_gradients_around_the_kernel_equal_the_chunked_paths(options, n, causal, monkeypatch):
    """The sort into rounds, the un-sort, the combination of the rounds by their log-sum-exps and the self rule,
    differentiated: with a dense stand-in for the kernel, the gradients of q (also the keys) and v equal the
    chunked path's custom backward (float64, with padding)."""
    monkeypatch.setattr(sparse_flex, "flex_attention", dense_flex_attention)
    monkeypatch.setattr(sparse_flex, "check_flex_inputs", lambda *tensors, **named: None)  # training on the CPU
    q, v = inputs(4, n, seed=4)
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(5), dtype=q.dtype)
    mask = padding(n)
    runs = []
    for impl in ("flex", "chunked"):
        leaves = [t.clone().requires_grad_(True) for t in (q, v)]
        out = make(impl, **options).double()(leaves[0], leaves[0], leaves[1], mask=mask, causal=causal)
        out.backward(grad)
        runs.append([out.detach()] + [t.grad for t in leaves])
    for what, x, ref in zip(("out", "dq", "dv"), *runs, strict=True):
        torch.testing.assert_close(x, ref, **TOLERANCE[torch.float64], msg=what)


def test_one_compiled_graph_serves_every_call(monkeypatch):
    """Each call brings new tables (new data, padding, causal or not): they are inputs of one compiled graph, not
    constants that recompile it. Dynamo with a counting backend stands in for the CUDA kernel's compilation."""
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    counter = CompileCounter()
    monkeypatch.setattr(sparse_flex, "flex_attention", torch.compile(flex_attention, backend=counter, fullgraph=True))
    core, chunked = make(n_hashes=3, bucket_size=4), make("chunked", n_hashes=3, bucket_size=4)
    for seed, causal in ((0, False), (1, False), (2, True)):
        q, v = inputs(2, 30, dtype=torch.float32, seed=seed)
        mask = pad_mask(torch.tensor([30, 30 - 5 * seed]), 30)
        with torch.no_grad():
            out = core(q, q, v, mask=mask, causal=causal)
            torch.testing.assert_close(out, chunked(q, q, v, mask=mask, causal=causal), **TOLERANCE[torch.float32])
    assert counter.frame_count == 1


def test_training_with_flex_on_cpu_is_a_clear_error():
    core = make(n_hashes=2, bucket_size=4)
    q, v = (t.requires_grad_(True) for t in inputs(2, 16))
    with pytest.raises(ValueError, match="impl='flex' cannot train on cpu.*impl='chunked'"):
        core(q, q, v)
    with torch.no_grad():  # the forward alone runs
        assert core(q, q, v).shape == q.shape


def test_auto_runs_chunked_on_cpu():
    core = make("auto", n_hashes=2, bucket_size=4)
    q, v = (t.requires_grad_(True) for t in inputs(2, 16, dtype=torch.float32))
    assert core.resolved_impl(q) == "chunked"
    out = core(q, q, v)  # trains: the chunked path
    out.sum().backward()
    assert torch.equal(out, make("chunked", n_hashes=2, bucket_size=4)(q, q, v))


def test_invalid_impl_and_small_head_dims_are_refused():
    with pytest.raises(ValueError, match=r"impl='blocked' is not a valid 'auto' \| 'chunked' \| 'flex'"):
        make("blocked")
    with pytest.raises(ValueError, match="dim_head >= 16.*got 8"):
        make(dim_head=8)
    q = torch.randn(1, HEADS, 16, 8)
    assert make("auto", dim_head=8).resolved_impl(q) == "chunked"


# --- CUDA: the compiled kernel ------------------------------------------------------------------------------

CUDA_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 2e-2}
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def cuda_core(impl: str) -> az.AttentionCore:
    return az.create_attention("lsh", dim_head=64, heads=4, max_seq_len=2048, n_hashes=4, bucket_size=64, impl=impl)


def relative_error(x: Tensor, ref: Tensor) -> float:
    return float((x.double() - ref.double()).norm() / ref.double().norm())


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", list(CUDA_TOLERANCE), ids=str)
def test_flex_matches_chunked_on_cuda(dtype, causal):
    """Forward and gradients (shared QK: q is also the keys) of the compiled kernel against the chunked path on
    the same inputs (the same hash, which both compute in float32), n = 2000 with padding."""
    torch.manual_seed(0)
    n = 2000
    q, v, grad = (torch.randn(2, 4, n, 64, device="cuda", dtype=dtype) for _ in range(3))
    mask = pad_mask(torch.tensor([n, n - 300]), n).cuda()
    mask[1, :100] = False
    runs = {}
    for impl in ("flex", "chunked"):
        leaves = [t.clone().requires_grad_(True) for t in (q, v)]
        out = cuda_core(impl)(leaves[0], leaves[0], leaves[1], mask=mask, causal=causal)
        out.backward(grad)
        runs[impl] = [out.detach()] + [t.grad for t in leaves]
    for what, x, ref in zip(("out", "dq", "dv"), runs["flex"], runs["chunked"], strict=True):
        assert x.dtype == dtype and torch.isfinite(x).all(), what
        error = relative_error(x, ref)
        print(f"lsh flex causal={causal} {dtype} {what}: relative error {error:.2e}")
        assert error <= CUDA_TOLERANCE[dtype], f"{what}: relative error {error:.2e}"


@pytest.mark.cuda
@needs_cuda
def test_flex_has_no_host_sync_on_cuda():
    """Once compiled (the block mask and the rotations cached), forward and backward never wait for the device."""
    q, v, grad = (torch.randn(2, 4, 1024, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    mask = pad_mask(torch.tensor([1024, 900]), 1024).cuda()
    q.requires_grad_(True)
    core = cuda_core("auto")
    assert core.resolved_impl(q) == "flex"
    core(q, q, v, mask=mask).backward(grad)  # warm: compile, cache
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        core(q, q, v, mask=mask).backward(grad)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert core.resolved_impl(q.double()) == "chunked"  # a dtype the compiled kernel does not take
