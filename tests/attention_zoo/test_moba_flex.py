"""MoBA's FlexAttention path (``impl="flex"``, and ``impl="auto"``'s choice of it on CUDA).

On the CPU torch runs FlexAttention eagerly, forward only, and the eager fallback reads only the ``mask_mod``,
not the block mask's tables: there ``impl="flex"`` must equal ``impl="dense"`` and ``impl="tiled"`` (float64 to
1e-10, float32 to its tolerance) with padding, causal and not, n not a multiple of the block size, top_k at
least the number of blocks and a block at least n; the tables are checked on their own (each tile partial
exactly when some but not all of its entries are allowed, full exactly when all are) and read by Inductor's CPU
kernel once; the gradients of the gather and the merge of the ranks are checked with the FlexAttention call
replaced by a differentiable dense one; the forward makes no host synchronisation (``.item()``, ``.tolist()``,
``bool()``, ``nonzero``). On CUDA (``@pytest.mark.cuda``, skipped elsewhere): the compiled kernel, forward and
backward, against the dense path in float64, with the tolerances of tests/attention_zoo/test_sparse_flex.py, and
no synchronisation under ``torch.cuda.set_sync_debug_mode("error")``.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import Tensor
from torch.nn.attention.flex_attention import flex_attention

import attention_zoo as az
from attention_zoo.masks import pad_mask
from attention_zoo.moba import block_mask as moba_flex
from attention_zoo.sparse import flex
from tests.attention_zoo.test_sparse_flex import (
    CUDA_TOLERANCE,
    assert_flex_matches_float64,
    cuda_inputs,
    relative_error,
)

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile"),
]

TIGHT = dict(rtol=0.0, atol=1e-10)  # float64: equal up to summation order
HEADS, DIM_HEAD = 2, 16


def make(block_size: int, top_k: int, impl: str = "flex", dtype: torch.dtype = torch.float64) -> az.AttentionCore:
    core = az.create_attention("moba", dim_head=DIM_HEAD, heads=HEADS, block_size=block_size, top_k=top_k, impl=impl)
    return core.to(dtype)


def inputs(b: int, n: int, dtype: torch.dtype = torch.float64, seed: int = 0) -> list[Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(b, HEADS, n, DIM_HEAD, generator=generator, dtype=dtype) for _ in range(3)]


def padding(n: int) -> Tensor:
    """Right padding, left padding (causal queries 0..2 see no key) and all padding."""
    mask = pad_mask(torch.tensor([n, n - 5, n, 0]), n)
    mask[2, :3] = False
    return mask


# (n, block_size, top_k): n not a multiple of the block; top_k >= the blocks; a block >= n; blocks of 128 and
# more, where a key tile of 128 lies inside a block, starts a block or straddles two (192)
CONFIGS = [(40, 4, 2), (37, 8, 1), (50, 6, 3), (21, 4, 9), (13, 16, 2), (300, 128, 2), (260, 192, 1), (300, 100, 1)]


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize(("n", "block_size", "top_k"), CONFIGS)
def test_flex_equals_tiled_and_dense(n, block_size, top_k, causal):
    q, k, v = inputs(4, n)
    for mask in (None, padding(n)):
        with torch.no_grad():
            out, tiled, dense = (
                make(block_size, top_k, impl)(q, k, v, mask=mask, causal=causal) for impl in ("flex", "tiled", "dense")
            )
        torch.testing.assert_close(out, dense, **TIGHT, msg=f"padded={mask is not None}")
        torch.testing.assert_close(out, tiled, **TIGHT, msg=f"padded={mask is not None}")
        if mask is not None:
            assert torch.equal(out[3], torch.zeros_like(out[3])), "a fully padded sequence gives zeros"
        if mask is not None and causal:
            assert torch.equal(out[2, :, :3], torch.zeros_like(out[2, :, :3])), "a query with no key gives zeros"


@pytest.mark.parametrize("causal", [False, True])
def test_float32(causal):
    q, k, v = inputs(4, 45, torch.float32, seed=2)
    with torch.no_grad():
        out, dense = (
            make(8, 2, impl, torch.float32)(q, k, v, mask=padding(45), causal=causal) for impl in ("flex", "dense")
        )
    torch.testing.assert_close(out, dense)


def captured_masks(monkeypatch, core, n: int, causal: bool, seed: int = 0):
    """The block masks and masks of the FlexAttention calls of one forward of ``core``."""
    calls = []
    run = flex.flex_call

    def spy(q, k, v, block_mask, mask, scale):
        calls.append((block_mask, q.shape[-2]))
        return run(q, k, v, block_mask, mask, scale)

    monkeypatch.setattr(flex, "flex_call", spy)
    q, k, v = inputs(2, n, seed=seed)
    with torch.no_grad():
        core(q, k, v, mask=padding(n)[1:3], causal=causal)
    return calls


def tile_table(counts: Tensor, indices: Tensor, key_tiles: int) -> Tensor:
    """(B, H, row tiles, key tiles) bool from a BlockMask's (counts, indices), written out with loops."""
    table = torch.zeros(*counts.shape, key_tiles, dtype=torch.bool)
    for position in torch.cartesian_prod(*(torch.arange(s) for s in counts.shape)):
        index = tuple(position.tolist())
        table[index][indices[index][: counts[index]].long()] = True
    return table


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("n", "block_size"), [(300, 128), (400, 64), (420, 192), (64, 512)])
def test_the_tiles_are_exactly_the_pairs(monkeypatch, n, block_size, causal):
    """The eager fallback ignores the tables, the compiled kernel trusts them: a tile is listed (partial or full)
    exactly when some (pair, key) entry in it is allowed, and full exactly when every entry is (rows past the
    pairs and keys past n count as not allowed)."""
    ((block_mask, pairs),) = captured_masks(monkeypatch, make(block_size, 2), n, causal)
    q_block, kv_block = block_mask.BLOCK_SIZE
    assert (q_block, kv_block) == (moba_flex.Q_BLOCK, moba_flex.KV_BLOCK)
    row_tiles, key_tiles = block_mask.kv_indices.shape[-2], -(-n // kv_block)
    b, h, p, j = (torch.arange(s).view(*[-1 if d == i else 1 for d in range(4)]) for i, s in
                  enumerate((2, HEADS, row_tiles * q_block, key_tiles * kv_block)))  # fmt: skip
    allowed = block_mask.mask_mod(b, h, p.clamp_max(pairs - 1), j) & (p < pairs) & (j < n)
    tiles = allowed.unflatten(2, (row_tiles, q_block)).unflatten(4, (key_tiles, kv_block))
    some, every = tiles.any(dim=(3, 5)), tiles.all(dim=(3, 5))
    partial = tile_table(block_mask.kv_num_blocks, block_mask.kv_indices, key_tiles)
    full = tile_table(block_mask.full_kv_num_blocks, block_mask.full_kv_indices, key_tiles)
    assert torch.equal(full, every)
    assert torch.equal(partial, some & ~every)
    assert full.any() or causal or n <= block_size or block_size < moba_flex.KV_BLOCK, "gated pairs fill tiles"


#: run in a fresh interpreter: Inductor's CPU FlexAttention template can emit C++ that does not compile
#: (an undeclared ``cur_kvSplitSize<N>``) when other kernels were generated earlier in the same process
COMPILED_KERNEL_CHECK = """
import torch
from torch.nn.attention.flex_attention import flex_attention
import attention_zoo as az
from attention_zoo.masks import pad_mask
from attention_zoo.sparse import flex

compiled, run = torch.compile(flex_attention), flex.flex_call

def through_the_kernel(q, k, v, block_mask, mask, scale):
    _, lse = run(q, k, v, block_mask, mask, scale)
    out = compiled(q, k, v, score_mod=flex._key_padding(mask), block_mask=block_mask, scale=scale)
    return torch.where(torch.isneginf(lse)[..., None], 0.0, out), lse

flex.flex_call = through_the_kernel
n, generator = 400, torch.Generator().manual_seed(4)
q, k, v = (torch.randn(3, 2, n, 16, generator=generator) for _ in range(3))
mask = pad_mask(torch.tensor([n, n - 5, n]), n)
mask[2, :3] = False
cores = [az.create_attention("moba", dim_head=16, heads=2, block_size=128, top_k=2, impl=i) for i in ("flex", "dense")]
with torch.no_grad():
    out, expected = (core(q, k, v, mask=mask, causal=True) for core in cores)
torch.testing.assert_close(out, expected)
print("ok")
"""


def test_the_compiled_cpu_kernel_reads_the_tables():
    """Inductor's CPU FlexAttention kernel (inference only, no log-sum-exp) visits only the listed tiles and
    skips the ``mask_mod`` on full ones: its per-pair outputs, merged with the eager log-sum-exps, give the
    dense path's output. One compilation, in a fresh interpreter (:data:`COMPILED_KERNEL_CHECK`)."""
    done = subprocess.run([sys.executable, "-c", COMPILED_KERNEL_CHECK], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def dense_flex_with_lse(q, k, v, block_mask, mask, scale):
    """A differentiable stand-in for the FlexAttention call: the same (out, lse) from the dense scores."""
    b, h, p, j = (torch.arange(s).view(*[-1 if d == i else 1 for d in range(4)]) for i, s in
                  enumerate((*q.shape[:3], k.shape[-2])))  # fmt: skip
    allowed = block_mask.mask_mod(b, h, p, j)
    if mask is not None:
        allowed = allowed & mask[:, None, None, :]
    scores = torch.where(allowed, q @ k.mT * scale, float("-inf"))
    shift = scores.detach().amax(dim=-1, keepdim=True).nan_to_num(neginf=0.0)
    weights = (scores - shift).exp()
    total = weights.sum(dim=-1, keepdim=True)
    lse = torch.where(total > 0, total.clamp_min(1e-300).log() + shift, float("-inf"))[..., 0]
    return (weights / total.clamp_min(1e-300)) @ v, lse


@pytest.mark.parametrize("causal", [False, True])
def test_the_gather_and_merge_have_the_tiled_gradients(monkeypatch, causal):
    """Gradients through the gathered pair rows, the un-sort and the merge of the ranks (its weights come from
    the pairs' log-sum-exps) equal the tiled kernel's; FlexAttention itself has no CPU backward, so its call is
    replaced by a dense one of the same block mask."""
    monkeypatch.setattr(flex, "flex_call", dense_flex_with_lse)
    monkeypatch.setattr(flex, "check_flex_inputs", lambda *tensors, **named: None)
    n, mask = 37, padding(37)
    grads = []
    for impl in ("flex", "tiled"):
        q, k, v = (t.requires_grad_(True) for t in inputs(4, n, seed=3))
        out = make(8, 2, impl)(q, k, v, mask=mask, causal=causal)
        weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
        (out * weights).sum().backward()
        grads.append((out, q.grad, k.grad, v.grad))
    for got, expected in zip(*grads, strict=True):
        torch.testing.assert_close(got, expected, **TIGHT)


SYNCS = ("item", "tolist", "__bool__", "nonzero", "__int__", "__float__")


def refuse_host_syncs(monkeypatch) -> None:
    """Every tensor-to-host read raises from here on (until the test ends)."""

    def refuse(name):
        def sync(*args, **kwargs):
            raise AssertionError(f"host synchronisation: Tensor.{name}")

        return sync

    for name in SYNCS:
        monkeypatch.setattr(torch.Tensor, name, refuse(name))
    with pytest.raises(AssertionError, match="Tensor.item"):  # the patch is live
        torch.ones(1).item()


@pytest.mark.parametrize("causal", [False, True])
def test_the_forward_makes_no_host_sync(monkeypatch, causal):
    """The whole call around the kernel (the gate, the pairs, the block mask, the merge) reads nothing back. The
    kernel is torch's: a dense stand-in here (torch's eager CPU wrapper traces it with Dynamo, which may turn a
    float argument into a tensor it reads back), the compiled one under CUDA's sync check (the ``cuda`` tests)."""
    monkeypatch.setattr(flex, "flex_call", dense_flex_with_lse)
    q, k, v = inputs(4, 37, torch.float32)
    refuse_host_syncs(monkeypatch)
    with torch.no_grad():
        make(8, 2, dtype=torch.float32)(q, k, v, mask=padding(37), causal=causal)


def test_one_compiled_graph_serves_every_call(monkeypatch):
    """Each call brings a new selection (new data, padding, causal or not), so new pair tables and a new block
    mask: they are inputs of one compiled graph, not constants that recompile it. Dynamo with a counting backend
    stands in for the CUDA kernel's compilation."""
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    counter = CompileCounter()
    monkeypatch.setattr(flex, "flex_attention", torch.compile(flex_attention, backend=counter, fullgraph=True))
    core, dense = make(8, 2, dtype=torch.float32), make(8, 2, "dense", torch.float32)
    for seed, causal in ((0, False), (1, False), (2, True)):
        q, k, v = inputs(2, 40, torch.float32, seed=seed)
        mask = pad_mask(torch.tensor([40, 40 - 5 * seed]), 40)
        with torch.no_grad():
            out = core(q, k, v, mask=mask, causal=causal)
            torch.testing.assert_close(out, dense(q, k, v, mask=mask, causal=causal))
    assert counter.frame_count == 1


def test_auto_runs_tiled_on_cpu(monkeypatch):
    core = make(8, 2, "auto", torch.float32)
    q, k, v = inputs(2, 40, torch.float32)
    assert core.resolved_impl(q) == "tiled"
    monkeypatch.setattr(flex, "flex_call", lambda *a: pytest.fail("auto ran FlexAttention on the CPU"))
    torch.testing.assert_close(core(q, k, v, causal=True), make(8, 2, "tiled", torch.float32)(q, k, v, causal=True))


def test_training_with_flex_on_cpu_is_a_clear_error():
    core = make(8, 2)
    q, k, v = (t.requires_grad_(True) for t in inputs(2, 32))
    with pytest.raises(ValueError, match="impl='flex' cannot train on cpu: .* use impl='tiled'"):
        core(q, k, v, causal=True)
    with torch.no_grad():
        assert core(q, k, v, causal=True).shape == q.shape


def test_flex_refuses_head_dims_below_16():
    with pytest.raises(ValueError, match="dim_head >= 16.*got 8; use impl='auto' or 'tiled'"):
        az.create_attention("moba", dim_head=8, heads=HEADS, block_size=4, impl="flex")
    core = az.create_attention("moba", dim_head=8, heads=HEADS, block_size=4)
    assert core.resolved_impl(torch.zeros(1, HEADS, 8, 8)) == "tiled"


# --- CUDA: the compiled kernel ------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("n", [1000])  # not a multiple of the block or the tile; one length keeps the compiles few
@pytest.mark.parametrize("dtype", list(CUDA_TOLERANCE), ids=str)
def test_flex_matches_float64_dense_on_cuda(dtype, n, causal):
    """Blocks of 128, top-4 (the grid's defaults); n = 1000 is not a multiple of a block or a tile. The float64
    reference is given the flex run's selection (a gate in float32 and one in float64 may part at a near-tie)."""
    cores = {impl: az.create_attention("moba", dim_head=64, heads=4, block_size=128, top_k=4, impl=impl)
             for impl in ("flex", "dense")}  # fmt: skip
    gate, selections = cores["flex"].select_blocks, []

    def recorded(*args, **kwargs) -> Tensor:
        selections.append(gate(*args, **kwargs))
        return selections[-1]

    cores["flex"].select_blocks = recorded
    cores["dense"].select_blocks = lambda *args, **kwargs: selections[0]
    assert_flex_matches_float64(cores, cuda_inputs(n), causal, dtype, f"moba n={n}")


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_no_host_sync_on_cuda(causal):
    """Forward and backward under ``set_sync_debug_mode("error")``, after a first call that compiles."""
    q, k, v = (torch.randn(2, 4, 1000, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    mask = pad_mask(torch.tensor([1000, 900]), 1000).cuda()
    core = az.create_attention("moba", dim_head=64, heads=4, block_size=128, top_k=4)
    assert core.resolved_impl(q) == "flex"
    core(q, k, v, mask=mask, causal=causal).sum().backward()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        core(q, k, v, mask=mask, causal=causal).sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


@pytest.mark.cuda
@needs_cuda
def test_auto_runs_flex_on_cuda():
    q, k, v = (torch.randn(1, 4, 512, 64, device="cuda") for _ in range(3))
    core = az.create_attention("moba", dim_head=64, heads=4, block_size=128, top_k=2)
    assert core.resolved_impl(q) == "flex" and core.resolved_impl(q.double()) == "tiled"
    expected = az.create_attention("moba", dim_head=64, heads=4, block_size=128, top_k=2, impl="dense")
    out = core(q, k, v, causal=True)
    assert relative_error(out, expected(q.double(), k.double(), v.double(), causal=True)) <= 1e-3
