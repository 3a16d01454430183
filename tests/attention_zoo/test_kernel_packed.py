"""The kernel family's packed form (:meth:`~attention_zoo.kernel.attention.KernelAttention.attend_segments`): on
packed rows, each document's output and gradients equal those of the core on that document alone (sums restarting
at each boundary, cosFormer's positions counted from the document's start), non-causal in one pass that never
unpacks the documents. References: the core on each document alone, unpadded. Float64, eval mode."""

from __future__ import annotations

import pytest
import torch

import attention_zoo as az
from attention_zoo import packing
from attention_zoo.packing import segments_from_lengths
from tests.attention_zoo.registry_cases import MAX_SEQ_LEN, build, case_id, qkv

KERNELS = [(name, options) for name in ("performer", "linear", "cosformer")
           for options in az.get_attention_class(name).example_configs]  # fmt: skip
EXACT = dict(rtol=0.0, atol=1e-9)
N = 24
#: a document of length 1, documents shorter and longer than a chunk, one filling the row, padding after the last
#: document, an empty row
LENGTHS = [[1, 7, 3, 9], [N], [5, 1, 12], []]


@pytest.fixture(params=KERNELS, ids=[case_id(c) for c in KERNELS])
def kernel(request):
    return request.param


def packed_inputs(core: az.AttentionCore) -> tuple[torch.Tensor, ...]:
    """q, k, v for LENGTHS with NaN at every padding position: nothing there may reach a document or its gradient."""
    q, k, v = qkv(core, len(LENGTHS), N)
    padding = ~packing.padding_mask(segments_from_lengths(LENGTHS, N), N)[:, None, :, None]
    return tuple(t.masked_fill(padding, torch.nan).requires_grad_(True) for t in (q, k, v))


def documents():
    """(row, start, length) of every document of LENGTHS."""
    for row, lengths in enumerate(LENGTHS):
        start = 0
        for length in lengths:
            yield row, start, length
            start += length


@pytest.mark.parametrize("causal", [False, True])
def test_each_packed_document_equals_the_document_alone(kernel, causal):
    core = build(*kernel)
    q, k, v = packed_inputs(core)
    with torch.no_grad():
        out = core(q, k, v, segments=segments_from_lengths(LENGTHS, N), causal=causal)
        for row, start, length in documents():
            span = (slice(row, row + 1), slice(None), slice(start, start + length))
            torch.testing.assert_close(out[span], core(q[span], k[span], v[span], causal=causal), **EXACT,
                                       msg=f"row {row}, document at {start} of length {length}")  # fmt: skip
    for row, lengths in enumerate(LENGTHS):
        tail = out[row, :, sum(lengths) :]
        assert torch.equal(tail, torch.zeros_like(tail)), f"row {row}: padding must give exactly 0"


@pytest.mark.parametrize("causal", [False, True])
def test_gradients_of_q_k_v_equal_those_of_each_document_alone(kernel, causal):
    core = build(*kernel)
    q, k, v = packed_inputs(core)
    weights = torch.randn(q.shape, dtype=q.dtype, generator=torch.Generator().manual_seed(5))
    (core(q, k, v, segments=segments_from_lengths(LENGTHS, N), causal=causal) * weights).sum().backward()
    for row, start, length in documents():
        span = (slice(row, row + 1), slice(None), slice(start, start + length))
        alone = [t[span].detach().requires_grad_(True) for t in (q, k, v)]
        (core(*alone, causal=causal) * weights[span]).sum().backward()
        for label, packed, own in zip("qkv", (q, k, v), alone, strict=True):
            torch.testing.assert_close(packed.grad[span], own.grad, **EXACT, msg=f"grad {label}, row {row} at {start}")
    for row, lengths in enumerate(LENGTHS):
        for t in (q, k, v):
            tail = t.grad[row, :, sum(lengths) :]
            assert torch.equal(tail, torch.zeros_like(tail)), f"row {row}: padding must get gradient 0"


def test_the_non_causal_form_never_unpacks_the_documents(kernel, monkeypatch):
    def unpacked(*args, **kwargs):
        raise AssertionError("the non-causal kernel form fell back to unpacking the documents")

    monkeypatch.setattr(packing, "unpacked_attention", unpacked)
    core = build(*kernel)
    q, k, v = packed_inputs(core)
    out = core(q, k, v, segments=segments_from_lengths(LENGTHS, N))
    assert out[0, :, :20].isfinite().all()


def test_packed_cross_attention_reads_its_own_key_document_and_an_empty_one_gives_zeros(kernel):
    core = build(*kernel)
    query_lengths, key_lengths = [[3, 9, 1], [12, 2]], [[10, 0, 17], [28, 1]]
    segments, key_segments = segments_from_lengths(query_lengths, 16), segments_from_lengths(key_lengths, 30)
    q, _, _ = qkv(core, 2, 16)
    _, k, v = qkv(core, 2, 30, seed=1)
    out = core(q, k, v, segments=segments, key_segments=key_segments)
    for row in range(2):
        q_start = k_start = 0
        for q_length, k_length in zip(query_lengths[row], key_lengths[row], strict=True):
            got = out[row : row + 1, :, q_start : q_start + q_length]
            if k_length == 0:
                assert torch.equal(got, torch.zeros_like(got)), "no key in its document: zeros"
            else:
                expected = core(q[row : row + 1, :, q_start : q_start + q_length],
                                k[row : row + 1, :, k_start : k_start + k_length],
                                v[row : row + 1, :, k_start : k_start + k_length])  # fmt: skip
                torch.testing.assert_close(got, expected, **EXACT)
            q_start, k_start = q_start + q_length, k_start + k_length


def test_performer_weighs_each_documents_keys_against_its_own_largest():
    # log phi(k) = w^T y - |y|^2 / 2 is about -10^4 for the first document's keys and near 0 for the second's: a
    # reference shared by the row would underflow the first document's sums to 0 (float64 underflows at -745)
    core = build("performer", {"nb_features": 16})
    q, k, v = qkv(core, 1, 20)
    k = torch.cat([100 * k[:, :, :8], k[:, :, 8:]], dim=-2)
    out = core(q, k, v, segments=segments_from_lengths([[8, 12]], 20))
    first = core(q[:, :, :8], k[:, :, :8], v[:, :, :8])
    assert first.abs().amax() > 0.1
    torch.testing.assert_close(out[:, :, :8], first, **EXACT)
    torch.testing.assert_close(out[:, :, 8:], core(q[:, :, 8:], k[:, :, 8:], v[:, :, 8:]), **EXACT)


def test_cosformer_positions_restart_so_a_query_document_past_max_seq_len_is_refused():
    core = build("cosformer", {})
    q, _, _ = qkv(core, 1, MAX_SEQ_LEN + 6)
    _, k, v = qkv(core, 1, 20, seed=1)
    # the query row is longer than M, but each document's positions stay below it
    fits = core(q, k, v, segments=segments_from_lengths([[MAX_SEQ_LEN, 6]]),
                key_segments=segments_from_lengths([[12, 8]]))  # fmt: skip
    expected = core(q[:, :, MAX_SEQ_LEN:], k[:, :, 12:], v[:, :, 12:])
    torch.testing.assert_close(fits[:, :, MAX_SEQ_LEN:], expected, **EXACT)
    with pytest.raises(ValueError, match=f"query document {MAX_SEQ_LEN + 2} exceeds max_seq_len={MAX_SEQ_LEN}"):
        core(q, k, v, segments=segments_from_lengths([[MAX_SEQ_LEN + 2, 4]]),
             key_segments=segments_from_lengths([[12, 8]]))  # fmt: skip


def second_order(core: az.AttentionCore, inputs: list[torch.Tensor], weights: torch.Tensor, **kwargs) -> list:
    """d/d(q, k, v) of <grad_(q, k, v) <out, weights>, weights>: a Hessian-vector product through the core."""
    out = core(*inputs, **kwargs)
    grads = torch.autograd.grad((out * weights).sum(), inputs, create_graph=True)
    return list(torch.autograd.grad(sum((g * weights).sum() for g in grads), inputs))


def test_second_order_gradients_of_the_packed_form_equal_those_of_each_document_alone(kernel):
    core = build(*kernel)
    lengths = [[1, 6, 5], [12]]
    q, k, v = (t.requires_grad_(True) for t in qkv(core, 2, 12))
    weights = torch.randn(q.shape, dtype=q.dtype, generator=torch.Generator().manual_seed(7))
    packed = second_order(core, [q, k, v], weights, segments=segments_from_lengths(lengths, 12))
    for row, row_lengths in enumerate(lengths):
        start = 0
        for length in row_lengths:
            span = (slice(row, row + 1), slice(None), slice(start, start + length))
            alone = second_order(core, [t[span].detach().requires_grad_(True) for t in (q, k, v)], weights[span])
            for label, grad, own in zip("qkv", packed, alone, strict=True):
                torch.testing.assert_close(grad[span], own, **EXACT, msg=f"{label}, row {row} at {start}")
            start += length


@pytest.mark.parametrize("causal", [False, True])
def test_a_packed_training_forward_counts_one_performer_pass(causal):
    core = az.create_attention("performer", dim_head=8, heads=2, nb_features=8, redraw_interval=1).double().train()
    q, k, v = (torch.randn(2, 2, 12, 8, dtype=torch.float64) for _ in range(3))
    segments = segments_from_lengths([[5, 7], [12]], 12)
    before = int(core.training_passes)
    core(q, k, v, segments=segments, causal=causal)
    assert int(core.training_passes) == before + 1
