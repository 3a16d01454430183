"""The conformance suite for packed rows: over every registered mechanism and example config, a packed call
(``segments``) gives at every position of a document what the core gives on that document alone, and padding
after the last document gives 0. Float64, eval mode (Performer's features and other draws fixed)."""

from __future__ import annotations

import pytest
import torch

import attention_zoo as az
from attention_zoo.core import AttentionCore, Geometry
from attention_zoo.packing import (
    document_ids,
    positions_in_documents,
    segments_from_cu_seqlens,
    segments_from_lengths,
    segments_from_position_ids,
)
from tests.attention_zoo.registry_cases import (
    DIM_HEAD,
    HEADS,
    build,
    case_id,
    cases,
    plain_causal,
    qkv,
    skip_unless_takes,
)

CASES = cases()
EXACT = dict(rtol=0.0, atol=1e-9)
N = 40
#: per row: length-1 documents, documents shorter than every block, window and landmark count of the example
#: configs, a document that fills the row, padding after the last document, and an empty row
LENGTHS = [[1, 7, 3, 20], [N], [5, 5, 1, 12], [2, 33, 1], []]


@pytest.fixture(params=CASES, ids=[case_id(c) for c in CASES])
def case(request):
    return request.param


def alone(core: AttentionCore, q, k, v, row: int, start: int, length: int, causal: bool):
    piece = lambda t: t[row : row + 1, :, start : start + length]  # noqa: E731
    return core(piece(q), piece(k), piece(v), causal=causal)


@pytest.mark.parametrize("causal", [False, True])
def test_every_document_of_a_packed_row_equals_the_document_alone(case, causal):
    name, options = case
    skip_unless_takes(name, causal)
    core = build(name, options)
    assert core.supports_segments, f"{name} refuses segments: {core.segments_refusal}"
    q, k, v = qkv(core, len(LENGTHS), N)
    segments = segments_from_lengths(LENGTHS, N)
    out = core(q, k, v, segments=segments, causal=causal)
    for row, lengths in enumerate(LENGTHS):
        start = 0
        for length in lengths:
            expected = alone(core, q, k, v, row, start, length, causal)
            torch.testing.assert_close(out[row : row + 1, :, start : start + length], expected, **EXACT,
                                       msg=f"row {row}, document at {start} of length {length}")  # fmt: skip
            start += length
        assert torch.equal(out[row, :, start:], torch.zeros_like(out[row, :, start:])), "padding must give 0"


def test_a_mask_that_agrees_with_the_segments_changes_nothing(case):
    name, options = case
    core = build(name, options)
    q, k, v = qkv(core, len(LENGTHS), N)
    segments = segments_from_lengths(LENGTHS, N)
    mask = torch.arange(N)[None, :] < segments[:, -1:]
    causal = plain_causal(name)
    torch.testing.assert_close(core(q, k, v, segments=segments, mask=mask, causal=causal),
                               core(q, k, v, segments=segments, causal=causal), **EXACT)  # fmt: skip


def test_gradients_of_a_packed_document_equal_those_of_the_document_alone(case):
    name, options = case
    core, causal = build(name, options), plain_causal(name)
    lengths = [[9, 1, 14], [24]]
    segments = segments_from_lengths(lengths, 24)
    q, k, v = (t.requires_grad_(True) for t in qkv(core, 2, 24))
    weights = torch.randn(q.shape, dtype=q.dtype, generator=torch.Generator().manual_seed(3))
    (core(q, k, v, segments=segments, causal=causal) * weights).sum().backward()
    packed = [t.grad.clone() for t in (q, v)]
    for row, row_lengths in enumerate(lengths):
        start = 0
        for length in row_lengths:
            span = (slice(row, row + 1), slice(None), slice(start, start + length))
            pq, pk, pv = (t[span].detach().requires_grad_(True) for t in (q, k, v))
            pk = pq if core.needs_shared_qk else pk
            (core(pq, pk, pv, causal=causal) * weights[span]).sum().backward()
            for grad, own in zip(packed, (pq, pv), strict=True):
                torch.testing.assert_close(grad[span], own.grad, **EXACT)
            start += length


def test_packed_cross_attention_reads_the_key_document_of_the_same_index(case):
    name, options = case
    core = build(name, options)
    if not core.supports_cross_attention:
        pytest.skip("self-attention only")
    query_lengths, key_lengths = [[3, 9, 1], [12]], [[10, 2, 17], [30]]
    segments, key_segments = segments_from_lengths(query_lengths, 16), segments_from_lengths(key_lengths, 30)
    q, _, _ = qkv(core, 2, 16)
    _, k, v = qkv(core, 2, 30, seed=1)
    out = core(q, k, v, segments=segments, key_segments=key_segments)
    for row in range(2):
        q_start = k_start = 0
        for q_length, k_length in zip(query_lengths[row], key_lengths[row], strict=True):
            expected = core(q[row : row + 1, :, q_start : q_start + q_length],
                            k[row : row + 1, :, k_start : k_start + k_length],
                            v[row : row + 1, :, k_start : k_start + k_length])  # fmt: skip
            torch.testing.assert_close(out[row : row + 1, :, q_start : q_start + q_length], expected, **EXACT)
            q_start, k_start = q_start + q_length, k_start + k_length


def test_every_registered_core_takes_packed_rows():
    # the issue allows at most two refusals; today none refuses
    assert az.list_attentions(segments=True) == az.list_attentions()
    assert az.list_attentions(segments=False) == []


@pytest.mark.parametrize(
    ("segments", "message"),
    [
        ([[0, 5, 3, 9]], r"row 0: boundary 3 at index 2 is below the previous one 5"),
        ([[0, 5, 41]], r"row 0 ends at 41, past the row's 40 positions"),
        ([[2, 5, 9]], r"row 0 starts at 2; the first document starts at 0"),
    ],
)
def test_bad_boundaries_are_refused_with_the_row_and_value(segments, message):
    core = build("full", {})
    q, k, v = qkv(core, 1, N)
    with pytest.raises(ValueError, match=message):
        core(q, k, v, segments=torch.tensor(segments))


def test_segments_of_the_wrong_dtype_shape_or_device_are_refused():
    core = build("full", {})
    q, k, v = qkv(core, 2, N)
    with pytest.raises(ValueError, match="int64 .B, S . 1. = .2, S . 1."):
        core(q, k, v, segments=torch.tensor([[0, 5], [0, 7]], dtype=torch.int32))
    with pytest.raises(ValueError, match="int64"):
        core(q, k, v, segments=torch.tensor([[0, 5]]))
    with pytest.raises(ValueError, match="segments are on meta, the inputs on cpu"):
        core(q, k, v, segments=torch.zeros(2, 2, dtype=torch.long, device="meta"))
    with pytest.raises(ValueError, match="key_segments needs segments"):
        core(q, k, v, key_segments=torch.tensor([[0, 5], [0, 7]]))


def test_a_mask_that_disagrees_with_the_segments_is_refused():
    core = build("full", {})
    q, k, v = qkv(core, 2, N)
    segments = segments_from_lengths([[5, 7], [40]], N)
    mask = torch.arange(N)[None, :] < segments[:, -1:]
    inside = mask.clone()
    inside[1, 10] = False
    with pytest.raises(ValueError, match="row 1 at position 10: inside a document but masked out"):
        core(q, k, v, segments=segments, mask=inside)
    after = mask.clone()
    after[0, 20] = True
    with pytest.raises(ValueError, match="row 0 at position 20: after the last document but marked real"):
        core(q, k, v, segments=segments, mask=after)


def test_boundaries_are_read_back_once_per_tensor_and_again_after_a_write(monkeypatch):
    """A model passes one boundary tensor to every layer's core; reading it back to the host (a synchronisation on
    an accelerator) happens once, and again for a new mask, another tensor or after an in-place write."""
    core = build("full", {})
    q, k, v = qkv(core, 2, N)
    segments = segments_from_lengths([[5, 7], [40]], N)
    reads = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(t.shape) or tolist(t))
    first = core(q, k, v, segments=segments)
    for _ in range(3):  # the other layers
        torch.testing.assert_close(core(q, k, v, segments=segments), first, **EXACT)
    assert reads.count(segments.shape) == 1
    mask = torch.arange(N)[None, :] < segments[:, -1:]
    core(q, k, v, segments=segments, mask=mask)
    assert reads.count(segments.shape) == 2  # checked against the mask
    core(q, k, v, segments=segments.clone())
    assert reads.count(segments.shape) == 3  # another tensor of the same values: identity, not values
    segments[1, -1] = 41  # past the row: caught, though the tensor was valid before
    with pytest.raises(ValueError, match="row 1 ends at 41, past the row's 40 positions"):
        core(q, k, v, segments=segments)
    assert reads.count(segments.shape) == 4
    with torch.inference_mode():  # no version counter: checked every call
        frozen = segments_from_lengths([[5, 7], [40]], N)
        core(q, k, v, segments=frozen)
        core(q, k, v, segments=frozen)
    assert reads.count(frozen.shape) == 6


def test_cross_attention_needs_the_keys_boundaries_with_as_many_documents():
    core = build("full", {})
    q, _, _ = qkv(core, 1, 16)
    _, k, v = qkv(core, 1, 30)
    with pytest.raises(ValueError, match="needs key_segments"):
        core(q, k, v, segments=torch.tensor([[0, 16]]))
    with pytest.raises(ValueError, match="same number of documents"):
        core(q, k, v, segments=torch.tensor([[0, 16]]), key_segments=torch.tensor([[0, 10, 30]]))


def test_a_core_that_does_not_declare_segments_refuses_them_in_one_line():
    class Plain(AttentionCore, approximation="none"):
        def attend(self, q, k, v, *, mask, causal):
            return v

    core = Plain(Geometry(DIM_HEAD, HEADS))
    q, k, v = qkv(core, 1, 8)
    with pytest.raises(ValueError, match="Plain does not take packed rows .segments.: it does not declare"):
        core(q, k, v, segments=torch.tensor([[0, 8]]))


def test_the_boundary_helpers_agree_with_each_other():
    segments = segments_from_lengths([[3, 0, 2], [4]], 6)
    assert segments.tolist() == [[0, 3, 3, 5], [0, 4, 4, 4]]
    assert document_ids(segments, 6).tolist() == [[0, 0, 0, 2, 2, -1], [0, 0, 0, 0, -1, -1]]
    assert positions_in_documents(segments, 6).tolist() == [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 0]]
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 0]])
    mask = torch.tensor([[True] * 5 + [False], [True] * 4 + [False] * 2])
    assert segments_from_position_ids(position_ids, mask).tolist() == [[0, 3, 5], [0, 4, 4]]
    assert segments_from_cu_seqlens(torch.tensor([0, 3, 5, 9], dtype=torch.int32)).tolist() == [[0, 3, 5, 9]]
    with pytest.raises(ValueError, match="position 2 at index 1 neither restarts at 0 nor follows"):
        segments_from_position_ids(torch.tensor([[0, 2, 3]]))
    with pytest.raises(ValueError, match="row 0 holds 7 positions, more than n=6"):
        segments_from_lengths([[3, 4]], 6)


def test_decoding_is_not_packed():
    core = build("full", {})
    state = core.start_decoding()
    q, k, v = qkv(core, 1, 4)
    with pytest.raises(TypeError, match="segments"):
        core.decode(q, k, v, state, segments=torch.tensor([[0, 4]]))
