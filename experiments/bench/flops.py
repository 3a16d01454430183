"""Floating-point operations of one benchmark case, by formula (not by counting kernels).

Conventions: matrix products only, one multiply-add = 2 FLOPs (softmax, scaling, masking, norms and
activations are left out: they are O(n) per score and memory-bound anyway). Forward+backward is
counted as 3x the forward (the backward computes two products per forward product). The formulas
count the *useful* work of each mechanism as the paper defines it; a blocked or padded kernel may
execute more (a sliding window computed in blocks of w touches about 2w keys per query).

Per head (one of B*H), n = sequence length, d = head width:

- ``full``: Q K^T and P V, 2 n^2 d each: **4 n^2 d**; causal: the lower triangle, 2 n (n + 1) d.
- ``linformer`` (k): projections E K and F V, 2 k n d each (``linear`` / ``random``; ``conv`` with
  kernel = stride = n/k: 2 n d each; ``mean_pool`` / ``max_pool``: n d each), then Q (E K)^T and
  P (F V), 2 n k d each: **4 k n d + 4 n k d** for learned projections.
- ``nystrom`` (m landmarks, t pseudo-inverse iterations, optional depthwise convolution of c taps):
  Q K~^T, Q~ K^T, B~ V and the final (F~ A~^+)(B~ V) are 2 n m d each, Q~ K~^T 2 m^2 d, F~ A~^+
  2 n m^2, each iteration of (N4) 4 products of m x m matrices (2 m^3 each), the convolution 2 n d c:
  **8 n m d + 2 m^2 d + 2 n m^2 + 8 t m^3 (+ 2 n d c)**; ``pinv="exact"`` (an SVD) is not counted.

- ``local`` (``window`` w: |i - j| <= w/2) and ``longformer`` (w, and ``global_tokens`` g that attend
  and are attended everywhere): 4 d per allowed (query, key) pair, the pairs counted exactly (about
  n (w + 1) for local, plus about 2 g n for the globals); causal keeps the pairs with j <= i.
- ``lsh`` (r = ``n_hashes`` rounds, chunks of m, b buckets): hashing q R (R: d x b/2) is n d b per
  round; each query attends its chunk and the one before, 2m keys (causal: at most m earlier keys of
  its bucket): **r (n d b + 8 n m d)** (causal r (n d b + 4 n m d)); the sort is not counted.
- ``linformer_causal`` (blocks of c, k_c summaries each): per block of s positions, E K and F V 2 k_c s d
  each (learned), then each query scores its own block (causal: j <= i) and k_c summaries of every other
  block (causal: of every earlier block), 4 d per (query, key) pair.

- ``moba`` (blocks of c, ``top_k`` gated blocks): the gate scores q . (mean key) for every (query, candidate
  block), 2 d each (causal: the blocks before the query's own; otherwise every other block); attention
  4 d per (query, key) pair over the own block (causal: j <= i) and min(top_k, candidates) blocks of c
  keys. Exact when c divides n; otherwise a non-causal query that selects the partial last block reads
  fewer than c keys there, and the count is an upper bound. Mean pooling (additions) is not counted.
- kernelized linear attention (``linear``: m = d features, elu + 1; ``cosformer``: m = 2d, ReLU times cos
  and sin of the position; ``performer``: m = ``nb_features``), with the normaliser as one more value
  column (d + 1): phi(K)^T [V 1] and phi(Q) (that) are 2 n m (d + 1) each: **4 n m (d + 1)**, causal too
  (the prefix-sum form of the papers: per position one state update and one query product); performer adds
  the random projections W q and W k, 2 n m d each: **4 n m d + 4 n m (d + 1)**. The chunked causal kernel
  executes 2 n c (m + d + 1) more (the c x c blocks inside each chunk of c = ``chunk_size``).
- ``gated_deltanet`` (causal only): the recurrent form of the paper, per position S k, the two rank-1 updates of
  S and S q, 2 d^2 each: **8 n d^2** (the gates and the decay are elementwise, not counted). The chunked kernel
  executes n (8 c d + 8 d^2 + 2 d^3 / c) for chunks of c (the c x c blocks, the UT transform's triangular solve).
- ``nsa`` (causal only; compression blocks of l with stride s, ``select_count`` n blocks of l', window w): 4 d per
  (query, key) pair of its three branches, counted exactly: the compressed blocks that end at or before the query
  (about n^2 / (2 s): quadratic), the selected blocks (the own one up to the query; min(n, blocks so far) of l'),
  and min(w, i + 1) window keys. The selection scores are the compressed branch's probabilities (the paper's eq. 8),
  not counted again; the compression MLP and the gates are not counted.

- ``sparse`` (strided, fixed, blockwise, longformer patterns) and ``bigbird`` (window, global and random blocks):
  4 d per allowed (query, key) pair, the pairs counted from the pattern's own mask function over the whole
  (n, n) grid, in slabs of rows (exact for every pattern, BigBird's seeded random blocks included).

A mechanism without a formula here (or a causal case its formula does not cover) gets ``None``, shown as "n/a":
no guessing.

The ``seq2seq`` level (encoder-decoder, teacher forcing or greedy decoding) has no formula: n/a.

Around the core (``mha``, ``layer``, ``encoder`` levels), per token: the q, k, v, out projections
4 x 2 dim (H d) (3 x with shared QK), the feed-forward 2 x 2 dim (mult dim); the encoder sums its
layers (embedding look-ups are free).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import cache
from typing import Any

import torch

import attention_zoo as az
from attention_zoo.linformer.attention import default_k
from experiments.bench.cases import Case

#: options, n, d, causal -> forward FLOPs of one head at one layer, or None where not covered
HeadFlops = Callable[[dict[str, Any], int, int, bool], float | None]

FORMULAS: dict[str, HeadFlops] = {}


def formula(name: str) -> Callable[[HeadFlops], HeadFlops]:
    def register(function: HeadFlops) -> HeadFlops:
        FORMULAS[name] = function
        return function

    return register


@formula("full")
def _full(options: dict[str, Any], n: int, d: int, causal: bool) -> float:
    return 2 * n * (n + 1) * d if causal else 4 * n * n * d


@formula("linformer")
def _linformer(options: dict[str, Any], n: int, d: int, causal: bool) -> float | None:
    # k=None is resolved by the core from max_seq_len, which the bench sets to n
    k = min(default_k(n) if options["k"] is None else options["k"], n)
    per_tensor = {"linear": 2 * k * n * d, "random": 2 * k * n * d, "conv": 2 * n * d}
    projection = per_tensor.get(options["projection"], n * d)
    return None if causal else 2 * projection + 4 * n * k * d


@formula("nystrom")
def _nystrom(options: dict[str, Any], n: int, d: int, causal: bool) -> float | None:
    if causal or options["pinv"] != "iterative":
        return None
    m, t, taps = min(options["num_landmarks"], n), options["pinv_iterations"], options["conv_kernel_size"] or 0
    return 8 * n * m * d + 2 * m * m * d + 2 * n * m * m + 8 * t * m**3 + 2 * n * d * taps


def _window_pairs(n: int, half: int, globals_: int, causal: bool) -> int:
    """Allowed (i, j) pairs of |i - j| <= half, union the first ``globals_`` rows and columns."""
    pairs = 0
    for i in range(n):
        last = i if causal else n - 1
        if i < globals_:
            pairs += last + 1
            continue
        low, high = max(i - half, 0), min(i + half, last)
        window = high - low + 1
        overlap = max(0, min(high, globals_ - 1) - low + 1)
        pairs += window + min(globals_, last + 1) - overlap
    return pairs


@formula("local")
def _local(options: dict[str, Any], n: int, d: int, causal: bool) -> float:
    return 4 * d * _window_pairs(n, options["window"] // 2, 0, causal)


@formula("longformer")
def _longformer(options: dict[str, Any], n: int, d: int, causal: bool) -> float:
    return 4 * d * _window_pairs(n, options["window"] // 2, options["global_tokens"], causal)


@formula("lsh")
def _lsh(options: dict[str, Any], n: int, d: int, causal: bool) -> float:
    """Bucket and chunk sizes as ``attention_zoo.lsh.attention`` derives them from its options."""
    bucket_size = options["bucket_size"] or (64 if options["n_buckets"] is None else None)
    chunk = options["chunk_size"] or bucket_size
    if options["n_buckets"] is not None:
        buckets = options["n_buckets"]
        chunk = chunk or 2 * math.ceil(n / buckets)
    else:
        padded = math.ceil(n / chunk) * chunk
        buckets = max(2, 2 * (padded // (2 * bucket_size)))
    hashing = n * d * buckets if buckets > 1 else 0
    return options["n_hashes"] * (hashing + (4 if causal else 8) * n * chunk * d)


@formula("linformer_causal")
def _linformer_causal(options: dict[str, Any], n: int, d: int, causal: bool) -> float:
    c, k_c = options["block_size"], options["block_k"]
    sizes = [min(c, n - start) for start in range(0, n, c)]
    per_tensor = {"linear": 2 * k_c * d, "random": 2 * k_c * d, "conv": 2 * d}.get(options["projection"], d)
    projections = 2 * per_tensor * n
    if causal:
        pairs = sum(s * (s + 1) // 2 + s * g * k_c for g, s in enumerate(sizes))
    else:
        pairs = sum(s * (s + (len(sizes) - 1) * k_c) for s in sizes)
    return projections + 4 * d * pairs


@formula("moba")
def _moba(options: dict[str, Any], n: int, d: int, causal: bool) -> float:
    c, top_k = options["block_size"], options["top_k"]
    sizes = [min(c, n - start) for start in range(0, n, c)]
    scored = pairs = 0
    for block, size in enumerate(sizes):
        candidates = block if causal else len(sizes) - 1
        scored += size * candidates
        own = size * (size + 1) // 2 if causal else size * size
        pairs += own + size * min(top_k, candidates) * c
    return 2 * d * scored + 4 * d * pairs


def _kernel_products(n: int, m: int, d: int) -> float:
    return 4 * n * m * (d + 1)


@formula("linear")
def _linear(options: dict[str, Any], n: int, d: int, causal: bool) -> float:
    return _kernel_products(n, d, d)


@formula("cosformer")
def _cosformer(options: dict[str, Any], n: int, d: int, causal: bool) -> float:
    return _kernel_products(n, 2 * d, d)


@formula("performer")
def _performer(options: dict[str, Any], n: int, d: int, causal: bool) -> float:
    m = options["nb_features"]
    return 4 * n * m * d + _kernel_products(n, m, d)


@formula("gated_deltanet")
def _gated_deltanet(options: dict[str, Any], n: int, d: int, causal: bool) -> float | None:
    return 8 * n * d * d if causal else None


@formula("nsa")
def _nsa(options: dict[str, Any], n: int, d: int, causal: bool) -> float | None:
    if not causal:
        return None
    block, stride = options["compress_block"], options["compress_stride"]
    select, count, window = options["select_block"], options["select_count"], options["window"]
    pairs = 0
    for t in range(n):
        pairs += (t - block + 1) // stride + 1 if t >= block - 1 else 0  # compressed blocks ending at or before t
        pairs += (min(count, t // select + 1) - 1) * select + t % select + 1  # selected blocks, the own one causal
        pairs += min(window, t + 1)
    return 4 * d * pairs


#: query rows of the (n, n) grid a pattern's mask function is evaluated on at once
_PAIR_SLAB = 1024


@cache
def pattern_pairs(attention: str, options: tuple[tuple[str, Any], ...], n: int, causal: bool) -> int:
    """Allowed (query, key) pairs of a pattern core (``options`` as sorted items) over n positions."""
    from attention_zoo.core import Geometry

    core = az.get_attention_class(attention)(Geometry(dim_head=16, heads=1, max_seq_len=n), **dict(options))
    rule, keys, zero = core.mask_mod(n, causal), torch.arange(n), torch.zeros((), dtype=torch.long)
    return sum(
        int(rule(zero, zero, rows[:, None], keys[None, :]).expand(len(rows), n).sum())
        for rows in torch.arange(n).split(_PAIR_SLAB)
    )


@formula("sparse")
def _sparse(options: dict[str, Any], n: int, d: int, causal: bool) -> float:
    return 4 * d * pattern_pairs("sparse", tuple(sorted(options.items())), n, causal)


@formula("bigbird")
def _bigbird(options: dict[str, Any], n: int, d: int, causal: bool) -> float:
    return 4 * d * pattern_pairs("bigbird", tuple(sorted(options.items())), n, causal)


def resolved_options(attention: str, options: dict[str, Any]) -> dict[str, Any]:
    """The mechanism's defaults, overridden by ``options``."""
    specs = az.attention_options(az.get_attention_class(attention))
    return {s.name: s.default for s in specs if not s.required} | options


def core_flops(case: Case, layer_index: int = 0) -> float | None:
    """Forward FLOPs of the attention core of one layer, all heads and batch rows."""
    if case.attention not in FORMULAS or case.attention not in az.list_attentions():
        return None
    options = resolved_options(case.attention, case.options)
    if isinstance(options.get("k"), (list, tuple)):  # Linformer's nonuniform k, one per layer
        options = options | {"k": options["k"][layer_index]}
    per_head = FORMULAS[case.attention](options, case.seq_len, case.dim_head, case.causal)
    return None if per_head is None else case.batch * case.heads * per_head


def case_flops(case: Case) -> float | None:
    """FLOPs of one timed call of ``case`` (forward, or forward+backward = 3x forward); None for the
    ``seq2seq`` level and the ``decode-step`` mode (encoder-decoder and decoding work is not worked out here)."""
    if case.level == "seq2seq" or case.mode == "decode-step":
        return None
    if case.level == "core":
        forward = core_flops(case)
    else:
        layers = range(case.depth) if case.level == "encoder" else range(1)
        cores = [core_flops(case, i) for i in layers]
        if None in cores:
            return None
        shared_qk = az.get_attention_class(case.attention).needs_shared_qk
        inner = case.heads * case.dim_head
        tokens = case.batch * case.seq_len
        projections = (3 if shared_qk else 4) * 2 * tokens * case.dim * inner
        feed_forward = 0 if case.level == "mha" else 2 * 2 * tokens * case.dim * case.ff_mult * case.dim
        forward = sum(cores) + len(layers) * (projections + feed_forward)
    if forward is None:
        return None
    return 3 * forward if case.mode == "fwd+bwd" else forward
