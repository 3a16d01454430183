"""LSH attention (Reformer): the chunked implementation and the decoding cache against dense float64
references built from the paper's definitions and the authors' trax code (scores, key sets, self rule),
plus causality, prefix consistency, non-finite input, padding, seeding, gradients and memory."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import attention_zoo as az
import attention_zoo.lsh.chunked as lsh_kernel
from attention_zoo.masks import pad_mask

EXACT = dict(rtol=0.0, atol=1e-9)  # float64 "unchanged"
TIGHT = dict(rtol=1e-10, atol=1e-10)  # float64 reference vs chunked implementation
CONFIGS = [
    {"n_hashes": 3, "bucket_size": 4},
    {"n_hashes": 2, "n_buckets": 4, "chunk_size": 6},
    {"n_hashes": 4, "n_buckets": 2, "chunk_size": 5},  # few buckets: many pairs recur across rounds
]


def make(max_seq_len: int | None = 32, **options) -> az.AttentionCore:
    return az.create_attention("lsh", dim_head=8, heads=2, max_seq_len=max_seq_len, **options).double()


def data(b: int, n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(b, 2, n, 8, generator=generator, dtype=torch.float64) for _ in range(2))


def trax_scores(q: torch.Tensor) -> torch.Tensor:
    """The logits of trax ``attend`` with shared QK (trax/layers/research/efficient_attention.py): keys are
    ``length_normalized`` (x / sqrt(mean(x^2)); its epsilon 1e-6, a guard for zero vectors, left out here),
    then divided by sqrt(d); ``dots = q k^T`` with q as it comes."""
    keys = q / q.pow(2).mean(-1, keepdim=True).sqrt() / math.sqrt(q.shape[-1])
    return q @ keys.transpose(-1, -2)


def attention_over(allowed, q, v, real):
    """Softmax of the trax logits over each query's allowed keys; a query with none attends to itself alone
    (eq. 16, m_ii = 1e5 -> inf: softmax over {i}, v_i, or NaN when its own score is not finite); padded -> 0."""
    scores = trax_scores(q)
    probs = scores.masked_fill(~allowed, -math.inf).softmax(-1)
    self_score = scores.diagonal(dim1=-2, dim2=-1)[..., None]
    out = torch.where(allowed.any(-1, keepdim=True), probs @ v, v * (self_score - self_score).exp())
    return torch.where(real[:, None, :, None], out, 0.0)


def key_sets(core, q, real, causal: bool, literal_causal: bool = False, count: bool = False) -> torch.Tensor:
    """U_r A_i^(r) as a dense ``(B, H, N, N)`` bool, straight from the definitions (not from the module's
    interval encoding): same bucket, and chunk window (11) or, causal, 0 < s_i - s_j <= m. ``literal_causal``:
    the paper's (11) restricted to j < i instead; ``count``: how many rounds hold each pair."""
    n = q.shape[2]
    m, n_buckets = core.chunk_and_buckets(n, causal)
    padded = -(-n // m) * m
    buckets = core.buckets(F.pad(q, (0, 0, 0, padded - n)), F.pad(real, (0, padded - n), value=False), n_buckets)
    copies = torch.zeros(*q.shape[:2], n, n, dtype=torch.long)
    for r in range(core.n_hashes):
        place = (buckets[:, :, r] * padded + torch.arange(padded)).argsort(-1).argsort(-1)[..., :n]
        same = buckets[:, :, r, :n, None] == buckets[:, :, r, None, :n]
        s_i, s_j = place[..., :, None], place[..., None, :]
        chunk_window = (s_j // m >= s_i // m - 1) & (s_j // m <= s_i // m)
        if literal_causal:
            window = chunk_window & (s_j < s_i)
        elif causal:
            window = (s_i - s_j >= 1) & (s_i - s_j <= m)
        else:
            window = chunk_window
        copies += same & window
    copies = copies * (~torch.eye(n, dtype=torch.bool) & real[:, None, None, :])
    return copies if count else copies > 0


def dense_reference(core, q, v, real, causal):
    return attention_over(key_sets(core, q, real, causal), q, v, real)


def full_shared_qk_reference(q, v, real, causal):
    """Full attention with shared QK, trax's keys and the self-mask (self only when nothing else is left)."""
    n = q.shape[2]
    allowed = real[:, None, None, :] & ~torch.eye(n, dtype=torch.bool)
    if causal:
        allowed &= torch.ones(n, n, dtype=torch.bool).tril()
    return attention_over(allowed, q, v, real)


def decode_in_steps(core, q, v, mask, step: int) -> torch.Tensor:
    state, outs = core.start_decoding(), []
    for start in range(0, q.shape[2], step):
        part = slice(start, start + step)
        outs.append(core.decode(q[:, :, part], q[:, :, part], v[:, :, part], state, mask=mask[:, part]))
    return torch.cat(outs, dim=2)


def test_the_score_is_q_dot_unit_key_with_no_further_scale():
    """By hand: one bucket, one chunk; q_0 = 3 e_1 sees k_1 = e_1 and k_2 = -e_1, so its weights are
    softmax(3, -3) = (sigmoid(6), sigmoid(-6)) in trax; the old extra 1/sqrt(8) gave sigmoid(6 / sqrt(8)) = 0.89."""
    q = torch.zeros(1, 2, 3, 8, dtype=torch.float64)
    q[..., 0] = torch.tensor([3.0, 0.5, -2.0], dtype=torch.float64)
    v = torch.randn(1, 2, 3, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    out = make(n_buckets=1, chunk_size=3)(q, q, v)
    sigmoid = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    expected_0 = sigmoid(6.0) * v[:, :, 1] + sigmoid(-6.0) * v[:, :, 2]  # q_0 . (k_1 - k_2) = 6
    expected_1 = sigmoid(1.0) * v[:, :, 0] + sigmoid(-1.0) * v[:, :, 2]  # q_1 . (k_0 - k_2) = 1
    torch.testing.assert_close(out[:, :, 0], expected_0, **TIGHT)
    torch.testing.assert_close(out[:, :, 1], expected_1, **TIGHT)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n_hashes", [1, 3])
def test_one_bucket_one_chunk_is_full_shared_qk_attention_with_self_mask(causal, n_hashes):
    q, v = data(3, 21)
    real = pad_mask(torch.tensor([21, 14, 1]), 21)  # the last sequence: one token, which sees only itself
    core = make(n_hashes=n_hashes, n_buckets=1, chunk_size=21)
    out = core(q, q, v, mask=real, causal=causal)
    torch.testing.assert_close(out, full_shared_qk_reference(q, v, real, causal), **TIGHT)


def test_one_bucket_causal_chunks_are_a_sliding_window():
    """One bucket, causal, chunk m < n: each query sees exactly its m predecessors (never itself)."""
    q, v = data(2, 30)
    real = torch.ones(2, 30, dtype=torch.bool)
    out = make(n_hashes=2, n_buckets=1, chunk_size=4)(q, q, v, causal=True)
    band = torch.ones(30, 30, dtype=torch.bool).tril(-1) & ~torch.ones(30, 30, dtype=torch.bool).tril(-5)
    torch.testing.assert_close(out, attention_over(band.expand(2, 2, 30, 30), q, v, real), **TIGHT)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("options", CONFIGS, ids=str)
def test_matches_dense_union_of_hashed_chunk_sets(options, causal):
    """Sorting, chunking, look-one-back, cross-round de-duplication and the self rule, all at once."""
    q, v = data(2, 29, seed=1)
    real = pad_mask(torch.tensor([29, 23]), 29)
    core = make(**options)
    torch.testing.assert_close(
        core(q, q, v, mask=real, causal=causal), dense_reference(core, q, v, real, causal), **TIGHT
    )


def test_rounds_share_pairs_so_deduplication_is_exercised():
    q, _ = data(2, 29, seed=1)
    real = pad_mask(torch.tensor([29, 23]), 29)
    core = make(**CONFIGS[2])
    for causal in (False, True):
        copies = key_sets(core, q, real, causal, count=True)
        assert (copies > 1).sum() > 50  # pairs summed in several rounds, each counted once in the union


def test_hash_is_argmax_of_signed_random_rotations():
    q, _ = data(2, 17)
    core = make(n_hashes=3, n_buckets=6)
    rotated = torch.einsum("bhnd,hrdk->bhrnk", q, core.rotations(6, q.device, q.dtype))
    expected = torch.cat([rotated, -rotated], dim=-1).argmax(-1)
    real = pad_mask(torch.tensor([17, 9]), 17)
    buckets = core.buckets(q, real, 6)
    assert torch.equal(buckets[0], expected[0])
    assert torch.equal(buckets[1, ..., :9], expected[1, ..., :9])
    assert (buckets[1, ..., 9:] == 6).all()  # padded tokens: the sentinel bucket after every real one


def test_bucket_count_and_chunk_follow_the_documented_rule():
    """Non-causal: from the sequence length L = N (the paper's rule); causal: from L = max_seq_len, so that
    a prefix sees the buckets of the whole sequence. n_buckets = max(2, 2 floor(L' / (2 bucket_size)))."""
    core = make(max_seq_len=64, bucket_size=4)
    assert core.chunk_and_buckets(17, causal=False) == (4, 4)  # L' = 20
    assert core.chunk_and_buckets(40, causal=False) == (4, 10)
    assert core.chunk_and_buckets(17, causal=True) == core.chunk_and_buckets(40, causal=True) == (4, 16)
    # n_buckets alone: m = min(L, 2 ceil(L / n_buckets))
    assert make(max_seq_len=64, n_buckets=4).chunk_and_buckets(10, causal=False) == (6, 4)
    assert make(max_seq_len=64, n_buckets=4).chunk_and_buckets(10, causal=True) == (32, 4)


@pytest.mark.parametrize("options", [{"bucket_size": 4}, {"n_buckets": 4}], ids=str)
def test_causal_prefix_keeps_its_buckets_and_chunks(options):
    """A causal prefix gives the outputs of the whole sequence at its positions (not just no leak)."""
    q, v = data(2, 60, seed=12)
    core = make(max_seq_len=64, n_hashes=2, **options)
    out = core(q, q, v, causal=True)
    for cut in (5, 23, 41):
        torch.testing.assert_close(core(q[:, :, :cut], q[:, :, :cut], v[:, :, :cut], causal=True), out[:, :, :cut])


def test_causal_without_max_seq_len_needs_n_buckets_and_chunk_size():
    q, v = data(1, 12)
    for options in ({"bucket_size": 4}, {"n_buckets": 4}):
        core = make(max_seq_len=None, **options)
        core(q, q, v)  # non-causal: the paper's rule per length
        with pytest.raises(ValueError, match="build it with max_seq_len, or give n_buckets and chunk_size"):
            core(q, q, v, causal=True)
        with pytest.raises(ValueError, match="build it with max_seq_len"):
            core.start_decoding()
    core = make(max_seq_len=None, n_buckets=4, chunk_size=3)
    real = torch.ones(1, 12, dtype=torch.bool)
    torch.testing.assert_close(core(q, q, v, causal=True), dense_reference(core, q, v, real, True), **TIGHT)


@pytest.mark.parametrize("options", CONFIGS, ids=str)
def test_causal_output_never_depends_on_later_tokens(options):
    q, v = data(2, 100, seed=2)
    core = make(max_seq_len=100, **options)
    out = core(q, q, v, causal=True)
    generator = torch.Generator().manual_seed(3)
    for cut in (1, 7, 33, 50, 64, 99):
        q2, v2 = q.clone(), v.clone()
        q2[:, :, cut:] = 10 * torch.randn(q2[:, :, cut:].shape, generator=generator, dtype=torch.float64)
        v2[:, :, cut:] = torch.randn(v2[:, :, cut:].shape, generator=generator, dtype=torch.float64)
        torch.testing.assert_close(core(q2, q2, v2, causal=True)[:, :, :cut], out[:, :, :cut], **EXACT)


def test_the_papers_causal_chunks_would_leak_the_future():
    """Why the causal key set is not (11) n {j < i}: there, later tokens move chunk boundaries."""
    core = make(max_seq_len=48, n_hashes=1, n_buckets=4, chunk_size=4)
    q, _ = data(1, 48, seed=4)
    real = torch.ones(1, 48, dtype=torch.bool)
    cut, leaks = 24, 0
    for seed in range(5):
        q2 = q.clone()
        q2[:, :, cut:] = torch.randn(q2[:, :, cut:].shape, generator=torch.Generator().manual_seed(seed), dtype=q.dtype)
        literal = [key_sets(core, x, real, True, literal_causal=True)[..., :cut, :] for x in (q, q2)]
        ours = [key_sets(core, x, real, True)[..., :cut, :] for x in (q, q2)]
        leaks += int(not torch.equal(*literal))
        assert torch.equal(*ours)
    assert leaks > 0


@pytest.mark.parametrize("step", [1, 4])
@pytest.mark.parametrize("options", CONFIGS, ids=str)
def test_decoding_matches_the_dense_causal_reference(options, step):
    """The decoding cache against the definitions (not against the forward), with padding and with pairs
    that recur across rounds (counted once)."""
    q, v = data(3, 29, seed=13)
    mask = torch.ones(3, 29, dtype=torch.bool)
    mask[0, :3], mask[1, 20:], mask[2, 8:13] = False, False, False
    core = make(**options)
    torch.testing.assert_close(
        decode_in_steps(core, q, v, mask, step), dense_reference(core, q, v, mask, True), **TIGHT
    )


def test_decoding_state_is_a_fixed_ring_per_round_and_bucket():
    """Memory per sequence does not grow with its length: n_hashes (n_buckets + 1) chunk_size slots per head."""
    core = make(max_seq_len=64, n_hashes=2, bucket_size=4)
    m, n_buckets = core.chunk_and_buckets(64, causal=True)
    q, v = data(2, 64, seed=14)
    state, sizes = core.start_decoding(), set()
    for t in range(64):
        core.decode(q[:, :, t : t + 1], q[:, :, t : t + 1], v[:, :, t : t + 1], state)
        sizes.add(tuple(x.numel() for x in (state.positions, state.keys, state.values, state.written)))
    slots = 2 * 2 * 2 * (n_buckets + 1) * m  # batch x heads x rounds x slots
    assert sizes == {(slots, slots * 8, slots * 8, 2 * 2 * 2 * (n_buckets + 1))}
    assert (state.positions >= 0).sum() < 2 * 2 * 2 * 64  # old tokens left the rings


@pytest.mark.parametrize("causal", [False, True])
def test_a_nan_query_gives_nan_wherever_it_is_seen(causal):
    """Issue 15: q[0, 0, 3, 0] = NaN once hid itself (its row returned v_3, finite). Now o_3 is NaN, as is
    every output whose key set holds token 3; every other output equals the reference."""
    q, v = data(2, 32, seed=15)
    q[0, 0, 3, 0] = math.nan
    real = torch.ones(2, 32, dtype=torch.bool)
    core = make(n_hashes=2, bucket_size=4)
    out = core(q, q, v, causal=causal)
    sees_3 = key_sets(core, q, real, causal)[0, 0, :, 3]
    assert out[0, 0, 3].isnan().all() and sees_3.any()
    assert torch.equal(out[0, 0].isnan().any(-1), sees_3 | (torch.arange(32) == 3))
    assert torch.isfinite(out[0, 1]).all() and torch.isfinite(out[1]).all()
    torch.testing.assert_close(out, dense_reference(core, q, v, real, causal), equal_nan=True, **TIGHT)
    if causal:
        torch.testing.assert_close(decode_in_steps(core, q, v, real, 3), out, equal_nan=True, **TIGHT)


def test_a_nan_query_alone_with_itself_is_nan():
    q, v = data(1, 6, seed=16)
    q[0, 1, 0, 2] = math.nan  # token 0, causal: no earlier token, so it attends to itself alone
    core = make(n_buckets=1, chunk_size=6)
    out = core(q, q, v, causal=True)
    assert out[0, 1, 0].isnan().all() and torch.isfinite(out[0, 0]).all()
    torch.testing.assert_close(decode_in_steps(core, q, v, torch.ones(1, 6, dtype=torch.bool), 1), out, equal_nan=True)


def test_integer_inputs_are_refused():
    q, v = data(1, 8)
    with pytest.raises(ValueError, match=r"must be floating point .*got torch.int64"):
        make(n_hashes=2, bucket_size=4)(q.long(), q.long(), v.long())


@pytest.mark.parametrize("causal", [False, True])
def test_padding_anywhere_changes_nothing_and_padded_outputs_are_zero(causal):
    q, v = data(2, 26, seed=5)
    real = torch.ones(2, 26, dtype=torch.bool)
    real[0, 3:7] = False  # a hole in the middle
    real[1, :5] = False  # left padding
    core = make(n_hashes=2, bucket_size=4)
    out = core(q, q, v, mask=real, causal=causal)
    noise = torch.randn(q.shape, generator=torch.Generator().manual_seed(6), dtype=q.dtype) * 10
    hidden = ~real[:, None, :, None]
    out2 = core(
        torch.where(hidden, noise, q),
        torch.where(hidden, noise, q),
        torch.where(hidden, -noise, v),
        mask=real,
        causal=causal,
    )
    torch.testing.assert_close(out2, out, **EXACT)
    assert (out.masked_select(hidden) == 0).all()


def test_seed_fixes_the_hash_and_a_new_seed_changes_it():
    q, v = data(2, 32, seed=7)
    real = torch.ones(2, 32, dtype=torch.bool)
    a, b, c = (make(n_hashes=2, bucket_size=4, seed=s) for s in (5, 5, 6))
    assert torch.equal(a(q, q, v), b(q, q, v))
    assert torch.equal(a.buckets(q, real, 8), b.buckets(q, real, 8))
    assert not torch.equal(a.buckets(q, real, 8), c.buckets(q, real, 8))
    assert not torch.allclose(a(q, q, v), c(q, q, v))


def test_rotations_do_not_depend_on_batch_or_dtype():
    q, _ = data(3, 20, seed=8)
    core = make(n_hashes=2, bucket_size=4)
    real = torch.ones(3, 20, dtype=torch.bool)
    alone = core.buckets(q[1:2], real[1:2], 4)
    assert torch.equal(core.buckets(q, real, 4)[1:2], alone)
    assert torch.equal(core.rotations(4, q.device, torch.float32), core.rotations(4, q.device, torch.float64).float())


@pytest.mark.parametrize("causal", [False, True])
def test_custom_backward_matches_finite_differences(causal, monkeypatch):
    q, v = data(2, 11, seed=9)
    q.requires_grad_(True)
    v.requires_grad_(True)
    real = pad_mask(torch.tensor([11, 8]), 11)
    core = make(max_seq_len=12, n_hashes=3, bucket_size=2)
    assert torch.autograd.gradcheck(lambda q, v: core(q, q, v, mask=real, causal=causal), (q, v), fast_mode=True)
    monkeypatch.setattr(lsh_kernel, "BLOCK_PAIRS", 8)  # one chunk of one row per block
    assert torch.autograd.gradcheck(lambda q, v: core(q, q, v, mask=real, causal=causal), (q, v), fast_mode=True)


@pytest.mark.parametrize("causal", [False, True])
def test_block_size_does_not_change_the_result(causal, monkeypatch):
    q, v = data(3, 40, seed=10)
    real = pad_mask(torch.tensor([40, 31, 3]), 40)
    core = make(max_seq_len=40, n_hashes=3, bucket_size=4)
    out = core(q, q, v, mask=real, causal=causal)
    for pairs in (32, 96, 2**12):  # one chunk, a few chunks of one row, whole rows
        monkeypatch.setattr(lsh_kernel, "BLOCK_PAIRS", pairs)
        torch.testing.assert_close(core(q, q, v, mask=real, causal=causal), out, **EXACT)


def test_memory_kept_for_backward_is_n_chunk_hashes_not_n_squared():
    b, h, n, d, n_hashes, m = 1, 2, 512, 8, 2, 32
    core = az.create_attention("lsh", dim_head=d, heads=h, n_hashes=n_hashes, bucket_size=m)
    q = torch.randn(b, h, n, d, requires_grad=True)
    v = torch.randn(b, h, n, d, requires_grad=True)
    saved: list[int] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        out = core(q, q, v)
    out.sum().backward()
    probabilities = b * h * n_hashes * n * 2 * m  # the kept P of every round's windows
    assert max(saved) == probabilities
    assert sum(saved) < 2 * probabilities < b * h * n * n


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs_give_finite_output_in_their_dtype(dtype):
    q, v = (t.to(dtype) for t in data(2, 24, seed=11))
    out = make(n_hashes=2, bucket_size=4).to(dtype)(q, q, v, mask=pad_mask(torch.tensor([24, 10]), 24), causal=True)
    assert out.dtype == dtype and torch.isfinite(out).all()


def test_invalid_options_raise_with_the_allowed_values():
    with pytest.raises(ValueError, match="bucket_size or n_buckets"):
        make(bucket_size=4, n_buckets=4)
    with pytest.raises(ValueError, match="1 or even"):
        make(n_buckets=3)
    with pytest.raises(ValueError, match="n_hashes"):
        make(n_hashes=0)
