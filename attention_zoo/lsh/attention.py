"""Reformer's LSH attention: shared-QK attention within hash buckets, chunked after sorting.

Kitaev, Kaiser, Levskaya 2020, "Reformer: The Efficient Transformer", arXiv:2001.04451
(https://arxiv.org/abs/2001.04451), Section 2 and Appendix A, in the paper's notation and equation numbers:

    k_j = q_j / ||q_j||  (shared-QK, so h(k_j) = h(q_j));  h(x) = argmax([xR; -xR]),  R: d_k x b/2 random
    (4), (6)  P_i^(r) = {j : h^(r)(q_i) = h^(r)(q_j)},  P_i = U_r P_i^(r)
    (5), (11) P~_i^(r) = {j : floor(s_i^(r) / m) - 1 <= floor(s_j^(r) / m) <= floor(s_i^(r) / m)}
    (14)      o_i = sum_r exp(z(i, P_i^(r)) - z(i, P_i)) o_i^(r)
    (15)      o_i^(r) = sum_{j in P~_i^(r)} exp(q_i . k_j - m_ij^(r) - z(i, P_i^(r))) v_j
    (16)      m_ij^(r) = inf if j not in P_i^(r); 1e5 if i = j; log N_ij otherwise; N_ij = |{r' : j in P_i^(r')}|

The score is q_i . k_j with the unit key k_j and no further scale, as in the authors' trax code
(``length_normalized``, then / sqrt(d)) and Hugging Face's port (``_len_and_dim_norm``): read as q . k / sqrt(d),
the key has length sqrt(d). s_i^(r) is i's place after sorting round r by (bucket, position); m is the chunk
length. The keys query i sums over in round r, A_i^(r), are exactly:

- non-causal: A_i^(r) = P_i^(r) n P~_i^(r) minus i: its bucket, within its chunk and one chunk back, (4) n (11).
- causal: A_i^(r) = {j in P_i^(r) : 0 < s_i - s_j <= m}, the m most recent earlier tokens of i's bucket. Not
  (11) n {j < i}: floor(s_i / m) counts the tokens hashed into lower buckets, later ones included, so a later
  token could move an earlier key in or out of i's chunk (a leak of the future). A token's rank inside its
  bucket depends only on earlier tokens, so query i's output depends only on tokens at positions <= i.
- Duplicates: eq. (13) weights each of a pair's N_ij copies 1/N_ij; here N_ij counts the rounds whose A_i^(r')
  holds j and only the first copy is kept, with weight 1: the same o_i, exactly softmax attention over
  U_r A_i^(r) with every key once. The two agree under the paper's assumption P_i^(r) in P~_i^(r); otherwise
  its literal N under-weights keys a chunk cut off.
- Self: a token attends to itself alone (o_i = v_i) exactly when U_r A_i^(r) is empty, the 1e5 -> inf limit
  of (16) with no constant that overflows half precision.
- Buckets and chunks (:meth:`LSHAttention.chunk_and_buckets`) follow the paper's rules for the sequence length
  non-causally and for ``max_seq_len`` causally, so a causal output never depends on how long the whole
  sequence is. Rotations R (:meth:`LSHAttention.rotations`) are fixed by ``seed``, not redrawn per step.
- Padding: padded tokens go to a sentinel bucket n_buckets that sorts after every real bucket, so real tokens'
  chunks and key sets do not depend on padded content; padded outputs are zero. Self-attention only
  (Nq == Nk): buckets come from q; the multi-head block passes k = q.
- Decoding (:class:`LSHDecodingState`): per sequence, head, round and bucket, a ring of the m most recent
  tokens, the only ones a later query of that bucket can see. Exact (the causal forward's o_i).

Complexity: time O(B H n_hashes N (2m d + n_buckets d / 2)) plus a sort per round; memory O(B H n_hashes N 2m):
the probabilities of each round's windows, kept for the custom backward (:mod:`attention_zoo.lsh.chunked`).
``impl="flex"`` (CUDA's default): the same key sets in one FlexAttention call (:mod:`attention_zoo.lsh.flex`).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from einops import einsum, rearrange, repeat
from torch import Tensor

from attention_zoo import packing
from attention_zoo.core import AttentionCore, DecodingState, Geometry, zero_padded
from attention_zoo.lsh import flex
from attention_zoo.lsh.chunked import LSHFunction
from attention_zoo.precision import compute_dtype
from attention_zoo.registry import register_attention
from attention_zoo.sparse import flex as sparse_flex

Impl = Literal["auto", "chunked", "flex"]


class LSHDecodingState(DecodingState):
    """Rings of the m most recent tokens per (sequence, head, round, bucket), bucket n_buckets being padding's:
    ``positions`` ``(B, H, r, (n_buckets + 1) m)`` (-1: empty slot), ``keys`` (unit) and ``values``
    ``(B, H, r, (n_buckets + 1) m, D)``, ``written`` ``(B, H, r, n_buckets + 1)`` tokens per bucket so far.
    None until the first step (it sets the batch, dtype and device). A step gathers its buckets' rings, counts
    each position once and takes one softmax: H n_hashes (n_buckets + 1) m slots per sequence however long it
    grows."""

    def __init__(self) -> None:
        super().__init__()
        self.positions: Tensor | None = None
        self.keys: Tensor | None = None
        self.values: Tensor | None = None
        self.written: Tensor | None = None


@register_attention("lsh")
class LSHAttention(
    AttentionCore, approximation="hashing",
    supports_cross_attention=False, needs_shared_qk=True, has_decoding_cache=True, supports_segments=True,
):  # fmt: skip
    example_configs = (
        {"n_hashes": 2, "bucket_size": 4},
        {"n_hashes": 3, "n_buckets": 4, "chunk_size": 6, "seed": 1},
    )
    notes = (
        "causal form: each query sees the chunk_size most recent earlier tokens of its own bucket (a subset of "
        "the paper's chunk window that later tokens cannot move), with bucket count and chunk length from "
        "max_seq_len, not the sequence length (causal without max_seq_len needs n_buckets and chunk_size); "
        "duplicates across rounds counted once; decoding cache: chunk_size tokens per round and bucket"
    )

    def __init__(
        self,
        geometry: Geometry,
        *,
        n_hashes: int = 4,
        bucket_size: int | None = None,
        n_buckets: int | None = None,
        chunk_size: int | None = None,
        seed: int = 0,
        impl: Impl = "auto",
    ) -> None:
        """``n_hashes`` rounds; ``bucket_size`` or ``n_buckets`` (1 or even), not both (default: bucket_size
        64); ``chunk_size`` m (default: bucket_size, else the paper's rule, :meth:`chunk_and_buckets`); ``seed``
        of the rotations. ``n_buckets=1`` skips hashing: with chunk_size >= N that is full shared-QK attention
        with the self-mask, the reference the tests check the chunking against. ``impl`` (same output):
        ``"chunked"`` (:mod:`attention_zoo.lsh.chunked`, trainable everywhere), ``"flex"``
        (:mod:`attention_zoo.lsh.flex`, one FlexAttention call; on the CPU forward only), ``"auto"`` (default:
        flex on CUDA where FlexAttention takes the dtype and head dim, chunked elsewhere)."""
        super().__init__(geometry)
        if impl == "flex":
            sparse_flex.check_flex_dim_head(self.dim_head, fallback="chunked")
        if bucket_size is not None and n_buckets is not None:
            raise ValueError(f"give bucket_size or n_buckets, not both (got {bucket_size} and {n_buckets})")
        if n_buckets is None and bucket_size is None:
            bucket_size = 64
        if n_hashes < 1:
            raise ValueError(f"n_hashes must be >= 1, got {n_hashes}")
        if bucket_size is not None and bucket_size < 1:
            raise ValueError(f"bucket_size must be >= 1, got {bucket_size}")
        if n_buckets is not None and (n_buckets < 1 or (n_buckets > 1 and n_buckets % 2)):
            raise ValueError(f"n_buckets must be 1 or even (argmax over [xR; -xR]), got {n_buckets}")
        if chunk_size is not None and chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        self.n_hashes, self.bucket_size, self.n_buckets_option, self.seed = n_hashes, bucket_size, n_buckets, seed
        self.chunk_size = bucket_size if chunk_size is None else chunk_size
        self.impl = impl
        self._rotations: dict[tuple[int, int, torch.device, torch.dtype], Tensor] = {}
        for option, value in (("bucket_size", bucket_size), ("n_buckets", n_buckets), ("chunk_size", chunk_size)):
            if value is not None:  # sizes a length bounds (n_buckets: at most one per position)
                self.bound_by_length(option, value, default=1 if option == "n_buckets" else 64)

    def chunk_and_buckets(self, n: int, causal: bool) -> tuple[int, int]:
        """The chunk length m and bucket count for sequences of length ``n``; causal, for ``max_seq_len``.

        n_buckets = max(2, 2 floor(L' / (2 bucket_size))) with L' the length L padded to a multiple of m, so the
        average bucket holds about bucket_size tokens; m = chunk_size, else the paper's min(L, 2 ceil(L /
        n_buckets)). Non-causal, L is the sequence length (the paper's rule); causal, L = ``max_seq_len``: the
        paper sizes buckets for the length it trains on, and a prefix, or step-by-step decoding, must see the
        same buckets and rotations. Causal attention without ``max_seq_len`` needs n_buckets and chunk_size."""
        if causal:
            if self.max_seq_len is not None:
                n = self.max_seq_len
            elif self.n_buckets_option is None or self.chunk_size is None:
                raise ValueError(
                    "lsh: causal attention needs a bucket count and chunk length that do not depend on the "
                    f"sequence length; build it with max_seq_len, or give n_buckets and chunk_size (got "
                    f"bucket_size={self.bucket_size}, n_buckets={self.n_buckets_option}, chunk_size={self.chunk_size})"
                )
        m = self.chunk_size or max(1, min(n, 2 * -(-n // self.n_buckets_option)))
        if self.n_buckets_option is not None:
            return m, self.n_buckets_option
        return m, max(2, 2 * ((-(-n // m) * m) // (2 * self.bucket_size)))

    def rotations(self, n_buckets: int, device: torch.device, dtype: torch.dtype) -> Tensor:
        """R of Sec. 2, ``(H, n_hashes, d, n_buckets / 2)``: a function of (seed, n_buckets) only, drawn in
        float64 from a CPU generator and then cast, never depending on the batch, dtype or call. The paper
        redraws them per step; fixed rotations keep evaluation reproducible (a new ``seed`` gives new ones). Kept
        per (seed, n_buckets, device, dtype): a copy to an accelerator each call would synchronise with the host."""
        key = (self.seed, n_buckets, torch.device(device), dtype)
        if key not in self._rotations:
            generator = torch.Generator().manual_seed(self.seed)
            shape = (self.heads, self.n_hashes, self.dim_head, n_buckets // 2)
            drawn = torch.randn(shape, generator=generator, dtype=torch.float64)
            self._rotations[key] = drawn.to(device=device, dtype=dtype)
        return self._rotations[key]

    def buckets(self, q: Tensor, real: Tensor, n_buckets: int) -> Tensor:
        """h^(r)(q_i) = argmax([q_i R; -q_i R]), ``(B, H, n_hashes, N)``; padded tokens get ``n_buckets``."""
        # b: batch, h: heads, r: hash rounds, n: positions, d: head dim, k: half the buckets
        if n_buckets == 1:
            ids = q.new_zeros((*q.shape[:2], self.n_hashes, q.shape[2]), dtype=torch.long)
        else:
            rotated = einsum(q, self.rotations(n_buckets, q.device, q.dtype), "b h n d, h r d k -> b h r n k")
            top, top_id = rotated.max(dim=-1)
            bottom, bottom_id = rotated.min(dim=-1)
            # argmax over [xR; -xR] without building it; a tie goes to the first half, as argmax does
            ids = torch.where(top >= -bottom, top_id, bottom_id + n_buckets // 2)
        return ids.masked_fill(~rearrange(real, "b n -> b 1 1 n"), n_buckets)

    def resolved_impl(self, q: Tensor) -> str:
        """The implementation a call with these queries runs: ``impl``, or for ``"auto"`` flex on CUDA where
        FlexAttention takes the dtype and head dim, else chunked."""
        if self.impl != "auto":
            return self.impl
        return "flex" if q.is_cuda and sparse_flex.flex_refusal(q) is None else "chunked"

    def attend(self, q: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | None, causal: bool) -> Tensor:
        # b: batch, h: heads, n: positions (padded to a multiple of m), d: head dim
        b, h, n, _ = q.shape
        dtype, impl = q.dtype, self.resolved_impl(q)
        if impl == "flex":
            sparse_flex.check_flex_inputs(q, k, v, fallback="chunked")
        m, n_buckets = self.chunk_and_buckets(n, causal)
        pad = -(-n // m) * m - n
        compute = compute_dtype(q.dtype)
        q = q if mask is None else zero_padded(q, mask)  # padded queries' rows must stay finite for backward
        q, k, v = (F.pad(t, (0, 0, 0, pad)) if pad else t for t in (q, k, v))
        real = torch.ones(b, n, dtype=torch.bool, device=q.device) if mask is None else mask
        real = F.pad(real, (0, pad), value=False)
        # the hash and the unit keys in at least float32 on either path; FlexAttention runs in the input dtype
        hashed, keys = q.to(compute), F.normalize(k.to(compute), dim=-1)
        with torch.no_grad():
            order, place, lo, hi = sorted_windows(self.buckets(hashed, real, n_buckets), n_buckets, m, causal)
        if impl == "flex":
            out = flex.flex_lsh_attention(q, keys.to(dtype), v, order, place, lo, hi, real, m)
            return out[:, :, :n].to(dtype)
        rows = "b h ... -> (b h) ..."
        inputs = (hashed, keys, v.to(compute), order, place, lo, hi)
        out = LSHFunction.apply(*(rearrange(t, rows) for t in inputs), repeat(real, "b n -> (b h) n", h=h), m)
        return rearrange(out, "(b h) n d -> b h n d", b=b)[:, :, :n].to(dtype)

    def attend_segments(self, q: Tensor, k: Tensor, v: Tensor, *, segments: Tensor, key_segments: Tensor,
                        causal: bool) -> Tensor:  # fmt: skip
        """Packed rows: hashing, sorting and chunking within each document, so no chunk spans two documents. The
        bucket count and chunk length follow each document's own length (non-causal; :meth:`chunk_and_buckets`),
        so documents of one length run together, unpadded."""
        return packing.unpacked_attention(self.attend, q, k, v, segments, key_segments, causal=causal,
                                          group_by_length=True)  # fmt: skip

    def start_decoding(self) -> LSHDecodingState:
        self.check_decodable()
        self.chunk_and_buckets(0, causal=True)  # refuses a length-dependent configuration now, not at step one
        return LSHDecodingState()

    def decode_attend(self, q: Tensor, k: Tensor, v: Tensor, state: DecodingState, *, mask: Tensor | None) -> Tensor:
        # b: batch, h: heads, t: new positions, r: rounds, s: ring slots (bucket, place in its ring), d: head dim
        assert isinstance(state, LSHDecodingState)
        (b, h, t, d), dtype = q.shape, q.dtype
        m, n_buckets = self.chunk_and_buckets(state.length + t, causal=True)
        compute = compute_dtype(dtype)
        real = torch.ones(b, t, dtype=torch.bool, device=q.device) if mask is None else mask
        q = (q if mask is None else zero_padded(q, mask)).to(compute)
        keys, v = F.normalize(k.to(compute), dim=-1), v.to(compute)
        if state.positions is None:
            slots = (b, h, self.n_hashes, (n_buckets + 1) * m)
            state.positions = torch.full(slots, -1, dtype=torch.long, device=q.device)
            state.keys, state.values = (q.new_zeros((*slots, d)) for _ in range(2))
            state.written = torch.zeros(b, h, self.n_hashes, n_buckets + 1, dtype=torch.long, device=q.device)
        buckets = self.buckets(q, real, n_buckets)
        ring = torch.arange(m, device=q.device)
        outs = []
        for step in range(t):
            bucket = buckets[..., step]  # (b, h, r)
            slots = rearrange(bucket, "b h r -> b h r 1") * m + ring
            seen = rearrange(state.positions.gather(-1, slots), "b h r j -> b h (r j)")
            # A_i^(r) per round; a position in several rounds' rings counts once (its copies are equal)
            sorted_seen, by_position = seen.sort(dim=-1)
            repeated_sorted = F.pad(sorted_seen[..., 1:] == sorted_seen[..., :-1], (1, 0), value=False)
            repeated = torch.empty_like(repeated_sorted).scatter_(-1, by_position, repeated_sorted)
            visible = (seen >= 0) & ~repeated
            index = repeat(slots, "b h r j -> b h r j d", d=d)
            k_seen, v_seen = (
                rearrange(x.gather(3, index), "b h r j d -> b h (r j) d") for x in (state.keys, state.values)
            )
            scores = einsum(q[:, :, step], k_seen, "b h d, b h s d -> b h s").masked_fill(~visible, -torch.inf)
            attended = einsum(scores.softmax(dim=-1), v_seen, "b h s, b h s d -> b h d")
            self_score = (q[:, :, step] * keys[:, :, step]).sum(-1, keepdim=True)
            alone = v[:, :, step] * (self_score - self_score).exp()  # softmax over {i}: v_i, NaN for non-finite q_i
            out = torch.where(visible.any(-1, keepdim=True), attended, alone)
            outs.append(torch.where(rearrange(real[:, step], "b -> b 1 1"), out, 0.0))
            # the ring slot of this token: its bucket's oldest (padded tokens write into the sentinel bucket)
            slot = bucket * m + state.written.gather(-1, bucket[..., None]).squeeze(-1) % m
            state.positions.scatter_(-1, slot[..., None], state.length + step)
            for ring_tensor, new in ((state.keys, keys), (state.values, v)):
                index = repeat(slot, "b h r -> b h r 1 d", d=d)
                ring_tensor.scatter_(3, index, repeat(new[:, :, step], "b h d -> b h r 1 d", r=self.n_hashes))
            state.written.scatter_add_(-1, bucket[..., None], torch.ones_like(bucket[..., None]))
        return torch.stack(outs, dim=2).to(dtype)


def sorted_windows(buckets: Tensor, n_buckets: int, m: int, causal: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per round, sort by (bucket, position) and give each token i the interval [lo_i, hi_i] of sorted places
    s_j of its key set A_i (module docstring); all ``(..., r, n)`` long: ``order`` (place -> token),
    ``place`` s_i (token -> place), ``lo``, ``hi`` (an empty interval has lo > hi)."""
    n = buckets.shape[-1]
    positions = torch.arange(n, device=buckets.device)
    order = (buckets * n + positions).argsort(dim=-1)
    place = torch.empty_like(order).scatter_(-1, order, positions.expand_as(order))
    counts = torch.zeros((*buckets.shape[:-1], n_buckets + 1), dtype=torch.long, device=buckets.device)
    counts.scatter_add_(-1, buckets, torch.ones_like(buckets))
    start = (counts.cumsum(-1) - counts).gather(-1, buckets)  # first place of each token's bucket
    if causal:
        return order, place, torch.maximum(start, place - m), place - 1
    end = start + counts.gather(-1, buckets)
    chunk = torch.div(place, m, rounding_mode="floor")
    return order, place, torch.maximum(start, (chunk - 1) * m), torch.minimum(end, (chunk + 1) * m) - 1
