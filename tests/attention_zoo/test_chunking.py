"""Device-aware chunk sizes (:mod:`attention_zoo.chunking`): the CPU keeps each site's cache-sized chunks, any
other device gets one large budget, and the larger chunks compute the same thing.

The plans are checked at the shapes of the GPU benchmarks (B = 8, H = 8, d = 64) by calling the planning
functions with a CUDA device object (no GPU needed: nothing runs on it); exactness by forcing the accelerator
budget on the CPU and comparing with the CPU chunks in float64.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

import attention_zoo as az
from attention_zoo import chunking
from attention_zoo.lsh import chunked as lsh_kernel
from attention_zoo.masks import pad_mask
from attention_zoo.moba import attention as moba
from attention_zoo.moba import tiled as moba_kernel
from attention_zoo.nystrom import attention as nystrom
from attention_zoo.sparse import band as band_attention
from attention_zoo.sparse import tiled as block_sparse

pytestmark = pytest.mark.usefixtures("one_thread")

TIGHT = dict(rtol=0.0, atol=1e-10)  # float64: only the summation order may differ
CPU, CUDA = torch.device("cpu"), torch.device("cuda")
B, H, D = 8, 8, 64  # the GPU benchmark shapes


def test_cpu_keeps_its_value_and_accelerators_get_the_large_budget():
    assert chunking.chunk_elements(CPU, 1 << 18) == 1 << 18
    assert chunking.chunk_elements(torch.device("cpu", 0), 7) == 7
    for device in (CUDA, torch.device("cuda", 1), torch.device("mps")):
        assert chunking.chunk_elements(device, 1 << 18) == chunking.ACCELERATOR_ELEMENTS == 1 << 26
    assert chunking.chunk_elements(CUDA, 1 << 30) == 1 << 30  # never below the CPU's value


# --- the plans at the GPU benchmark shapes -------------------------------------------------------------


def test_nystrom_takes_every_head_at_once_on_cuda():
    # n = 8192, m = 64: 2^19 scores per head; CPU 2^18 per block -> one head per block, 64 blocks;
    # CUDA 2^26 -> 128 heads fit, so all 64 (batch, head) pairs in one block (likewise at n = 16384: 64 fit)
    assert len(nystrom.head_blocks(B, H, 64 * 8192, CPU)) == B * H == 64
    assert nystrom.head_blocks(B, H, 64 * 8192, CUDA) == [(slice(0, 16), slice(None))]
    assert len(nystrom.head_blocks(B, H, 64 * 16384, CUDA)) == 1


def lsh_block_count(rows: int, n: int, m: int, dim: int, rounds: int, device: torch.device) -> int:
    row_groups, chunk_groups = lsh_kernel._plan(rows, n // m, m, dim, device)
    return len(row_groups) * len(chunk_groups) * rounds


def test_lsh_needs_a_few_blocks_per_round_on_cuda():
    # n = 16384, bucket m = 64: 256 chunks of 2 m^2 = 8192 pairs per row. CPU 2^19 pairs -> 64 chunks per block:
    # 4 blocks per row and round, 64 rows x 4 rounds -> 1024. CUDA 2^26 -> 8192 chunks: 32 whole rows per block,
    # 2 blocks per round -> 8
    assert lsh_block_count(B * H, 16384, 64, D, 4, CPU) == 1024
    assert lsh_block_count(B * H, 16384, 64, D, 4, CUDA) == 8


def test_lsh_blocks_on_cuda_bound_the_gathered_keys_when_d_exceeds_the_bucket():
    m, dim, n = 4, 64, 1 << 17
    row_groups, chunk_groups = lsh_kernel._plan(B * H, n // m, m, dim, CUDA)
    rows = row_groups[0].stop - row_groups[0].start if len(chunk_groups) == 1 else 1
    chunks = max(c.stop - c.start for c in chunk_groups)
    assert rows * chunks * 2 * m * dim <= chunking.ACCELERATOR_ELEMENTS  # (g, c, 2m, d) keys of one block
    # the CPU plan counts the scores only, as it always has
    assert lsh_kernel._plan(B * H, n // m, m, dim, CPU)[1][0] == slice(0, lsh_kernel.BLOCK_PAIRS // (2 * m * m))


def test_moba_gate_scores_every_query_at_once_on_cuda():
    # n = 8192, block 128: 64 blocks, 64 (batch, head) pairs -> 4096 scores per query.
    # CPU 2^18 -> 64 queries per chunk, 128 chunks; CUDA 2^26 -> 16384 >= 8192 queries, 1 chunk
    n, blocks = 8192, 8192 // 128
    assert math.ceil(n / moba._gate_step(B, H, blocks, CPU)) == 128
    assert math.ceil(n / moba._gate_step(B, H, blocks, CUDA)) == 1


def chunk_count(layout, heads: int, dim: int, device: torch.device) -> int:
    return sum(1 for _ in block_sparse._chunks(layout, heads, dim, device))


def test_moba_routed_tiles_take_a_few_chunks_per_rank_on_cuda():
    # n = 8192, block 128, top_k 4: the (b, h, i) rows flattened, 5 ranks (own block + 4 gated). Each query
    # routes to its own block and the 4 after it (mod 64), so every (b, h, block) gets 128 queries per rank:
    # tiles of 32 rows (a quarter of 128), 4 per block, 64 x 64 x 4 = 16384 tiles per rank against 128 keys.
    # Chunks hold (1 head) x t x max(32, d = 64) x 128: CPU 2^19 -> 64 tiles, 256 chunks per rank, 1280 in all;
    # CUDA 2^26 -> 8192 tiles, 2 chunks per rank, 10 in all
    n, block, top_k = 8192, 128, 4
    blocks = n // block
    own = torch.arange(n) // block
    picks = torch.stack([own] + [(own + r) % blocks for r in range(1, top_k + 1)], dim=-1)
    layout = moba.routed_layout(picks.expand(B, H, n, top_k + 1), block, blocks, offset=0, causal=False)
    assert [group.blocked.shape for group in layout] == [(16384, 32, 128)] * (top_k + 1)
    assert chunk_count(layout, 1, D, CPU) == 1280
    assert chunk_count(layout, 1, D, CUDA) == 10


def band_chunks(tiles_per_chunk: int, rows: band_attention.BandRows, *_) -> int:
    return -(-(rows.seqs * rows.tiles) // tiles_per_chunk)


def test_local_band_kernel_takes_a_few_chunks_on_cuda():
    # n = 8192, w = 256: tiles of 32 queries against 32 + 256 keys, 256 tiles per sequence x 64 (batch, head)
    # sequences = 16384 tiles; CPU 2^19 // (32 x 288) = 56 tiles per chunk -> 293 chunks; CUDA 2^26 // 9216 = 7281
    # -> 3 chunks
    core = az.create_attention("local", dim_head=D, heads=H, window=256, impl="blocked")
    rows = band_attention.BandRows(core.pattern.band(causal=False), torch.empty(B, H, 8192, D, device="meta"))
    assert band_chunks(band_attention._chunk_tiles(rows, CPU), rows) == 293
    assert band_chunks(band_attention._chunk_tiles(rows, CUDA), rows) == 3


# --- the large chunks compute the same thing -----------------------------------------------------------


@pytest.fixture
def force_accelerator_budget(monkeypatch):
    """Returns a function that makes every site plan as if on CUDA (while computing on the CPU)."""
    real = chunking.chunk_elements

    def force() -> None:
        monkeypatch.setattr(chunking, "chunk_elements", lambda device, cpu: real(CUDA, cpu))

    return force


def count_calls(monkeypatch, module, name: str, measure) -> list[int]:
    """Wraps ``module.name``; each call appends ``measure(result, *args)`` to the returned list."""
    seen: list[int] = []
    real = getattr(module, name)

    def spy(*args):
        result = real(*args)
        if name in ("_chunks", "_own_chunks"):  # generators: counted, then handed on as lists
            result = list(result)
        seen.append(measure(result, *args))
        return result

    monkeypatch.setattr(module, name, spy)
    return seen


def run(core: az.AttentionCore, q: Tensor, k: Tensor, v: Tensor, **kwargs) -> list[Tensor]:
    """Output and the gradients of q, k, v for a fixed random cotangent."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = core(*leaves, **kwargs)
    cotangent = torch.randn(out.shape, generator=torch.Generator().manual_seed(99), dtype=out.dtype)
    return [out.detach(), *torch.autograd.grad(out, leaves, cotangent)]


def inputs(b: int, n: int, d: int, seed: int = 0) -> list[Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(b, H, n, d, generator=generator, dtype=torch.float64) for _ in range(3)]


def assert_same(got: list[Tensor], want: list[Tensor]) -> None:
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, **TIGHT)


def test_nystrom_one_block_equals_the_cpu_blocks(monkeypatch, force_accelerator_budget):
    # n = 1024, m = 64: 2^16 scores per head, 4 heads per CPU block -> 4 blocks for 2 x 8 heads; forced: 1
    core = az.create_attention("nystrom", dim_head=16, heads=H, num_landmarks=64).double()
    q, k, v = inputs(2, 1024, 16)
    mask = pad_mask(torch.tensor([1024, 700]), 1024)
    blocks = count_calls(monkeypatch, nystrom, "head_blocks", lambda result, *_: len(result))
    want = run(core, q, k, v, mask=mask)
    assert blocks == [4] * 4  # B~ V and F~ (...), forward and backward
    force_accelerator_budget()
    blocks.clear()
    assert_same(run(core, q, k, v, mask=mask), want)
    assert blocks == [1] * 4


@pytest.mark.parametrize("causal", [False, True])
def test_lsh_one_block_per_round_equals_the_cpu_blocks(monkeypatch, force_accelerator_budget, causal):
    # n = 1024, bucket 64: 16 chunks per row, 64 per CPU block -> 4 rows per block, 4 blocks per round for
    # 2 x 8 rows, x 4 rounds = 16; forced: every row in one block per round, 4
    core = az.create_attention("lsh", dim_head=16, heads=H, max_seq_len=1024, n_hashes=4, bucket_size=64).double()
    q, _, v = inputs(2, 1024, 16, seed=1)
    mask = pad_mask(torch.tensor([1024, 700]), 1024)
    blocks = count_calls(monkeypatch, lsh_kernel, "_blocks", lambda result, *_: len(result))
    want = run(core, q, q, v, mask=mask, causal=causal)
    assert blocks == [16, 16]  # forward, backward
    force_accelerator_budget()
    blocks.clear()
    assert_same(run(core, q, q, v, mask=mask, causal=causal), want)
    assert blocks == [4, 4]


@pytest.mark.parametrize("causal", [False, True])
def test_moba_one_chunk_equals_the_cpu_chunks(monkeypatch, force_accelerator_budget, causal):
    # n = 4096, block 512: 8 blocks, 8 heads. Own blocks: CPU chunks of 2^19 // 512^2 = 2 of the 64 (head, block)
    # pairs, 32 chunks in forward and in backward; forced: 1. Gated pairs: on the CPU a batch holds at most
    # 2^19 // 512 = 1024 rows of one sequence, and a key block chosen by ~1,750 queries of a head is cut in two,
    # so the CPU plan has more batches than the forced one
    # (the chunks of the products kernel, which other devices run: the CPU's flash-attention path has none)
    monkeypatch.setattr(moba_kernel, "_FLASH_DEVICES", ())
    n = 4096
    core = az.create_attention("moba", dim_head=16, heads=H, block_size=512, top_k=3).double()
    q, k, v = inputs(1, n, 16, seed=2)
    own = count_calls(monkeypatch, moba_kernel, "_own_chunks", lambda result, *_: len(result))
    gated = count_calls(monkeypatch, moba_kernel, "gated_layout", lambda result, *_: len(result))
    want = run(core, q, k, v, causal=causal)
    assert own == [32, 32]  # forward, backward
    cpu_batches = gated[0]
    force_accelerator_budget()
    own.clear()
    gated.clear()
    assert_same(run(core, q, k, v, causal=causal), want)
    assert own == [1, 1] and gated[0] < cpu_batches


@pytest.mark.parametrize("causal", [False, True])
def test_blocked_local_one_chunk_equals_the_cpu_chunks(monkeypatch, force_accelerator_budget, causal):
    # n = 4096, w = 16: 512 tiles of 8 queries per sequence x 16 (batch, head) sequences = 8192 tiles, against
    # 8 + 16 keys (causal: 8 + 8); CPU chunks of 2^19 // (8 x 24) = 2730 tiles -> 4 chunks (causal: 2^19 // 128
    # = 4096 -> 2); forced: 1
    core = az.create_attention("local", dim_head=16, heads=H, window=16, impl="blocked").double()
    q, k, v = inputs(2, 4096, 16, seed=3)
    mask = pad_mask(torch.tensor([4096, 3000]), 4096)
    chunks = count_calls(monkeypatch, band_attention, "_chunk_tiles", band_chunks)
    want = run(core, q, k, v, mask=mask, causal=causal)
    assert chunks == [2 if causal else 4] * 2  # forward and backward
    force_accelerator_budget()
    chunks.clear()
    assert_same(run(core, q, k, v, mask=mask, causal=causal), want)
    assert chunks == [1] * 2
