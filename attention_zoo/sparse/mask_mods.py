"""Sparse attention patterns as mask functions, in FlexAttention's ``mask_mod`` convention.

A pattern is a pointwise function ``mask_mod(b, h, q_idx, kv_idx) -> bool tensor`` (True = query ``q_idx``
may attend key ``kv_idx``; it depends on neither ``b`` nor ``h``) made by a factory ``generate_<pattern>(...)``:
one definition gives the dense mask of the reference (:func:`dense_mask`), the element mask inside the blocked
path's tiles and FlexAttention's block mask. Positions are 0-based; causal is the pattern AND :func:`causal_mask`.
In Child et al.'s notation (eqs. (2)-(4)) query i attends S_i = {j : mask_mod(i, j)}:

- sliding window, ``window`` = w (even): |i - j| <= w/2, i.e. w/2 keys on each side plus the token itself,
  w + 1 keys in all (Longformer's convention, Beltagy et al. 2020, arXiv:2004.05150, §3.1: "w/2 tokens on
  each side"; w = 256 is the "Longformer-257" of the Nystromformer comparison).
- strided, ``stride`` = l (Child et al. 2019, arXiv:1904.10509, §4.3): A^(1) = {j : |i - j| <= l}
  union A^(2) = {j : (i - j) mod l = 0}; causal gives the paper's A^(1) = {max(0, i - l), ..., i}.
- fixed, ``stride`` = l, ``summary_columns`` = c (Child et al. §4.3): A^(1) = {j : floor(j/l) = floor(i/l)}
  union A^(2) = {j : j mod l in {l - c, ..., l - 1}}, the last c positions of every block ("summary cells").
- blockwise, ``block_size`` = b (Qiu et al. 2019, BlockBERT, arXiv:1911.02972, §3): block-diagonal,
  floor(i/b) = floor(j/b) (the identity permutation only; BlockBERT also permutes some heads' blocks).
- longformer, ``window`` = w, ``global_tokens`` = g (Beltagy et al. §3.1): the sliding window union
  {j : j < g} union {all j if i < g}: the first g positions attend everywhere and are attended by all.
- bigbird, ``block_size`` = b, ``window_blocks`` = w_b, ``global_tokens`` = g, ``random_blocks`` = r
  (Zaheer et al. 2020, arXiv:2007.14062, §2 eq. (1), block form in App. D): on block indices
  I = floor(i/b), J = floor(j/b): |I - J| <= w_b // 2, union global tokens (BigBird-ITC: positions that
  attend everywhere and are attended by all), union r random key blocks per query block
  (:func:`bigbird_random_blocks`). The global tokens (``global_placement``, :func:`bigbird_global_spans`):
  ``"ends"``, the authors' ITC, the first and last g/2 positions of the sequence padded to whole blocks
  (causal: the first g/2 only); ``"start"``, the first g positions, as in longformer.

The patterns as objects (defaults, checks, tiles, decoding rule): :mod:`attention_zoo.sparse.patterns`.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import and_masks

from attention_zoo.masks import MaskMod

#: where BigBird's global tokens sit: the authors' first and last block, or all at the start
GlobalPlacement = Literal["ends", "start"]


def causal_mask(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    """Query i sees keys j <= i (self-attention, Nq == Nk)."""
    return kv_idx <= q_idx


def with_causal(mask_mod: MaskMod, causal: bool) -> MaskMod:
    """``mask_mod``, AND :func:`causal_mask` when ``causal``."""
    return and_masks(mask_mod, causal_mask) if causal else mask_mod


def generate_sliding_window(window: int) -> MaskMod:
    """|i - j| <= window // 2 (Longformer's w: w/2 keys on each side, w + 1 in all)."""
    half = window // 2

    def sliding_window(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (q_idx - kv_idx).abs() <= half

    return sliding_window


def generate_strided(stride: int) -> MaskMod:
    """Child et al. strided: the l neighbours on each side, and every l-th position."""

    def strided(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        offset = q_idx - kv_idx
        return (offset.abs() <= stride) | (offset % stride == 0)

    return strided


def generate_strided_columns(stride: int) -> MaskMod:
    """The part of the strided pattern's A^(2) outside A^(1): (i - j) mod l = 0 and |i - j| > l. With the
    window |i - j| <= l it splits :func:`generate_strided` into two disjoint sets, each tile-friendly."""

    def strided_columns(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        offset = q_idx - kv_idx
        return (offset % stride == 0) & (offset.abs() > stride)

    return strided_columns


def generate_fixed(stride: int, summary_columns: int) -> MaskMod:
    """Child et al. fixed: the own block of length l, and the last c positions of every block."""

    def fixed(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        same_block = q_idx // stride == kv_idx // stride
        return same_block | (kv_idx % stride >= stride - summary_columns)

    return fixed


def generate_blockwise(block_size: int) -> MaskMod:
    """Qiu et al. blockwise (identity permutation): block-diagonal blocks of ``block_size``."""

    def blockwise(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return q_idx // block_size == kv_idx // block_size

    return blockwise


def generate_longformer(window: int, global_tokens: int) -> MaskMod:
    """Beltagy et al.: sliding window of ``window`` (w/2 each side) + the first ``global_tokens`` global."""
    sliding_window = generate_sliding_window(window)

    def longformer(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return sliding_window(b, h, q_idx, kv_idx) | (q_idx < global_tokens) | (kv_idx < global_tokens)

    return longformer


def bigbird_random_blocks(
    num_blocks: int,
    *,
    window_blocks: int,
    global_blocks: int,
    random_blocks: int,
    seed: int,
    causal: bool,
    trailing_global_blocks: int = 0,
) -> Tensor:
    """``(num_blocks, random_blocks)`` long: the random key blocks of each query block, -1 where fewer exist.

    Drawn uniformly without replacement among the blocks the query block does not already see: outside its
    window, not one of the first ``global_blocks`` nor the last ``trailing_global_blocks`` (blocks entirely
    global; the authors draw from the middle blocks), and, when ``causal``, only earlier blocks. Rows draw
    in order from one generator seeded with ``seed`` (torch's CPU generator reads its low 32 bits), each
    consuming one number per candidate, so the table depends on (seed, number of blocks, causal) only,
    never on the batch, dtype or device; with ``causal`` a row's candidates depend on its index alone, so a
    prefix of a longer sequence gets the same random blocks.

    The authors' code (``bigbird_block_rand_mask``, ``bigbird_block_rand_mask_with_head``) draws a
    different table per head, and has length-specific quirks that are not reproduced here: for the lengths
    of the paper (1024, 3072, 4096) random blocks come from the first 1024 positions only and the last two
    middle rows may draw window blocks (their own comment: "Missing -3"); elsewhere the second block and
    the second-to-last block never draw each other. Here one table serves every head. Recent versions of
    the Hugging Face port draw no random blocks in eval mode (every row points at block 0, a global block);
    here the seeded table is the same in training and evaluation.
    """
    table = torch.full((num_blocks, random_blocks), -1, dtype=torch.long)
    half = window_blocks // 2
    generator = torch.Generator().manual_seed(seed)
    for row in range(num_blocks):
        candidates = torch.arange(max(0, row - half) if causal else num_blocks)
        middle = (candidates >= global_blocks) & (candidates < num_blocks - trailing_global_blocks)
        candidates = candidates[((candidates - row).abs() > half) & middle]
        order = torch.rand(len(candidates), generator=generator, dtype=torch.float64).argsort()
        chosen = candidates[order[:random_blocks]]
        table[row, : len(chosen)] = chosen.sort().values
    return table


def bigbird_global_spans(
    global_tokens: int, placement: GlobalPlacement, block_size: int, seq_len: int, causal: bool
) -> tuple[int, int]:
    """(lead, trail_start): positions < lead and >= trail_start are global.

    ``"ends"``, the authors' ITC: the first g/2 and the last g/2 positions of the sequence padded to whole blocks
    (num_blocks * b). With g = 2 b (the default; ITC's "g = 2" counted in blocks) these are the first and the
    last block, as in the authors' code (google-research/bigbird, ``bigbird/core/attention.py``:
    ``full_bigbird_mask`` sets rows and columns ``[:b]`` and ``[-b:]``; ``bigbird_block_sparse_attention`` gives
    the first and last query blocks every key) and its Hugging Face port (``BigBirdBlockSparseAttention``, which
    pads the input to whole blocks, so a partial last block is global). Random blocks are drawn from the middle
    blocks only. ``"start"``: the first g positions (two leading blocks for g = 2 b), as in longformer.

    Causal BigBird keeps only what a prefix can know: with ``"ends"`` the global tokens are the first g/2
    positions alone. A trailing global block would be rows that see every earlier key at positions that depend
    on the total length, so a causal output would change when the sequence grows (the prefix property) and a
    decoder, which does not know the final length, could not compute it."""
    padded = -(-seq_len // block_size) * block_size
    if placement == "start":
        return global_tokens, padded
    return global_tokens // 2, padded if causal else padded - global_tokens // 2


def generate_bigbird(
    block_size: int,
    window_blocks: int,
    global_tokens: int,
    random_blocks: int,
    seed: int,
    global_placement: GlobalPlacement,
    *,
    seq_len: int,
    causal: bool,
    device: torch.device | str | None = None,
) -> MaskMod:
    """Zaheer et al. BigBird-ITC on blocks of ``block_size``: window blocks + global tokens + random blocks.

    The random blocks and the trailing global block of ``"ends"`` are functions of ``seq_len`` and
    ``causal`` (see :func:`bigbird_random_blocks`), so the mask function is made per sequence length, for
    positions < ``seq_len``. The ``(blocks, r)`` random table becomes a ``(blocks, blocks)`` bool matrix
    on ``device``, looked up per element: gathering the table's r entries and reducing over them inside the
    rule would not be pointwise, and moving a table to the indices' device there would be a device copy.
    """
    num_blocks = -(-seq_len // block_size)
    lead, trail_start = bigbird_global_spans(global_tokens, global_placement, block_size, seq_len, causal)
    table = bigbird_random_blocks(
        num_blocks,
        window_blocks=window_blocks,
        global_blocks=lead // block_size,
        random_blocks=random_blocks,
        seed=seed,
        causal=causal,
        trailing_global_blocks=(num_blocks * block_size - trail_start) // block_size,
    )
    chosen = None  # none drawn: no (blocks, blocks) matrix, which would grow with a decode's squared length
    if bool((table >= 0).any()):
        chosen = torch.zeros(num_blocks, num_blocks + 1, dtype=torch.bool)  # column num_blocks: the -1 entries
        chosen.scatter_(1, table.where(table >= 0, num_blocks), True)
        chosen = chosen[:, :num_blocks].to(device)
    half = window_blocks // 2

    def bigbird(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        q_block, kv_block = q_idx // block_size, kv_idx // block_size
        window = (q_block - kv_block).abs() <= half
        is_global = (q_idx < lead) | (kv_idx < lead) | (q_idx >= trail_start) | (kv_idx >= trail_start)
        allowed = window | is_global
        return allowed if chosen is None else allowed | chosen[q_block, kv_block]

    return bigbird


def dense_mask(mask_mod: MaskMod, n: int, device: torch.device | str | None = None) -> Tensor:
    """The ``(n, n)`` bool matrix of a pattern (self-attention), for references and plots."""
    positions = torch.arange(n, device=device)
    zero = torch.zeros((), dtype=torch.long, device=device)
    return mask_mod(zero, zero, positions[:, None], positions[None, :]).expand(n, n)
