"""Packed rows of the sparse family through FlexAttention (``impl="flex"``): one call over the packed rows with the
pattern at positions within each document, AND the document mask.

On the CPU torch runs FlexAttention's forward only (its eager fallback), so every test here is a forward in
float32 under ``torch.no_grad()``, eval mode. For local, longformer, strided, fixed and blockwise, causal and not,
each document of the packed call equals that document run alone through the same configuration's ``"dense"``
reference (the (n, n) mask of the pattern, masked softmax), to 1e-5; the rows hold a document of length 1,
documents shorter than the window or block, a document that fills the row, padding after the last document and
a row of padding only, and padding gives exactly 0. Those calls run with
:func:`attention_zoo.packing.unpacked_attention` replaced by one that fails, so a silent fallback to unpacking
fails them. The packed block mask, built one row
at a time, must equal the one torch builds over the whole batch at once (on CUDA the compiled kernel reads its
tables; the CPU's eager fallback evaluates only the mask function). BigBird's rule depends on the document's
length, so it keeps the per-length path, and still equals each document alone. The backward (CUDA only) is
not tested here.
"""

from __future__ import annotations

from functools import cache

import pytest
import torch
from torch import Tensor
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import attention_zoo as az
from attention_zoo import packing
from attention_zoo.packing import segments_from_lengths
from attention_zoo.sparse import flex

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile"),
]

CLOSE = dict(rtol=0.0, atol=1e-5)
HEADS, DIM_HEAD, N = 2, 16, 48
#: per row: length 1, documents shorter than every window and block below (5, 3), a document that fills the row,
#: padding after the last document (rows 0 and 2), and a row of padding only
LENGTHS = [[1, 5, 30, 7], [N], [3, 1, 20], []]
CONFIGS = [
    ("local", {"window": 8}),
    ("longformer", {"window": 8, "global_tokens": 2}),
    ("sparse", {"pattern": "strided", "stride": 6}),
    ("sparse", {"pattern": "fixed", "stride": 8, "summary_columns": 2}),
    ("sparse", {"pattern": "blockwise", "block_size": 8}),
]
IDS = [f"{name}-{'-'.join(map(str, options.values()))}" for name, options in CONFIGS]


@cache
def flex_refusal() -> str | None:
    """Why FlexAttention's forward cannot run on this CPU build (None: it runs)."""
    try:
        x = torch.zeros(1, 1, 8, DIM_HEAD)
        flex_attention(x, x, x, block_mask=create_block_mask(lambda b, h, i, j: j <= i, None, None, 8, 8, "cpu"))
    except Exception as error:  # noqa: BLE001 - any failure means this build cannot run it
        return f"FlexAttention does not run on this CPU build: {type(error).__name__}: {error}"
    return None


@pytest.fixture(autouse=True)
def needs_flex():
    if flex_refusal() is not None:
        pytest.skip(flex_refusal())


def make(name: str, options: dict, impl: str) -> az.AttentionCore:
    return az.create_attention(name, dim_head=DIM_HEAD, heads=HEADS, impl=impl, **options).eval()


def inputs(b: int, n: int) -> list[Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(b, HEADS, n, DIM_HEAD, generator=generator) for _ in range(3)]


def check_each_document_alone(out: Tensor, reference: az.AttentionCore, q, k, v, lengths, causal: bool) -> None:
    """Every document of ``out`` equals ``reference`` on that document alone; everything after the last is 0."""
    for row, sizes in enumerate(lengths):
        start = 0
        for size in sizes:
            q_doc, k_doc, v_doc, out_doc = (t[row : row + 1, :, start : start + size] for t in (q, k, v, out))
            expected = reference(q_doc, k_doc, v_doc, causal=causal)
            torch.testing.assert_close(out_doc, expected, **CLOSE, msg=f"row {row}, document at {start} of {size}")
            start += size
        assert torch.equal(out[row, :, start:], torch.zeros_like(out[row, :, start:])), f"row {row}: padding gives 0"


def no_unpacking(*args, **kwargs):
    raise AssertionError("the packed flex path fell back to unpacking the documents")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("name", "options"), CONFIGS, ids=IDS)
def test_one_flex_call_over_the_packed_rows_equals_each_document_alone(name, options, causal, monkeypatch):
    core, dense = make(name, options, "flex"), make(name, options, "dense")
    q, k, v = inputs(len(LENGTHS), N)
    monkeypatch.setattr(packing, "unpacked_attention", no_unpacking)
    with torch.no_grad():
        out = core(q, k, v, segments=segments_from_lengths(LENGTHS, N), causal=causal)
    monkeypatch.undo()  # the dense reference, alone, needs nothing unpacked; undone so nothing else sees the stub
    with torch.no_grad():
        check_each_document_alone(out, dense, q, k, v, LENGTHS, causal)
    assert not core._block_masks, "the packed block mask depends on the segments: it is not cached by shape"


def test_the_packed_block_mask_built_row_by_row_equals_one_built_over_the_batch():
    n, lengths = 300, [[1, 130, 69], [300], [60, 3], []]  # three query tiles of 128, documents across tiles
    segments = segments_from_lengths(lengths, n)
    rule = make("local", {"window": 8}, "flex").mask_mod(n, True)
    packed = flex.build_document_block_mask(rule, segments, segments, n, n, torch.device("cpu"))
    docs, at = packing.document_ids(segments, n), packing.positions_in_documents(segments, n)

    def causal_window_within_documents(b, h, i, j):  # the same rule, written out: |i - j| <= 4, j <= i
        offset = at[b, i] - at[b, j]
        return (docs[b, i] == docs[b, j]) & (docs[b, i] >= 0) & (offset >= 0) & (offset <= 4)

    whole = create_block_mask(causal_window_within_documents, len(lengths), None, n, n, device="cpu")
    assert torch.equal(packed.to_dense(), whole.to_dense())
    for name in ("kv_num_blocks", "full_kv_num_blocks", "q_num_blocks", "full_q_num_blocks"):
        assert torch.equal(getattr(packed, name), getattr(whole, name)), name
    # an independent check of what the tiles cover: row 3 (padding only) has no tile, row 1 (one document, the
    # causal window) touches the diagonal tiles and their left neighbours only
    assert packed.kv_num_blocks[3].sum() + packed.full_kv_num_blocks[3].sum() == 0
    assert packed.to_dense()[1, 0].tolist() == [[1, 0, 0], [1, 1, 0], [0, 1, 1]]


def test_bigbird_keeps_the_per_length_path_and_equals_each_document_alone(monkeypatch):
    options = {"block_size": 4, "random_blocks": 1}  # 5 blocks of 20: the middle blocks have random blocks to draw
    lengths, n = [[1, 5, 20], [20, 5], [32]], 32  # four distinct lengths, padding after rows 0 and 1
    core, dense = make("bigbird", options, "flex"), make("bigbird", options, "dense")
    grouped = []

    def spy(*args, group_by_length: bool = False, **kwargs):
        grouped.append(group_by_length)
        return unpacked(*args, group_by_length=group_by_length, **kwargs)

    unpacked = packing.unpacked_attention
    monkeypatch.setattr(packing, "unpacked_attention", spy)
    q, k, v = inputs(len(lengths), n)
    with torch.no_grad():
        out = core(q, k, v, segments=segments_from_lengths(lengths, n))
        assert grouped == [True]
        check_each_document_alone(out, dense, q, k, v, lengths, causal=False)


def test_training_through_packed_flex_on_the_cpu_is_refused():
    core = make("local", {"window": 8}, "flex")
    q, k, v = (t.requires_grad_() for t in inputs(1, 16))
    with pytest.raises(ValueError, match="impl='blocked'"):
        core(q, k, v, segments=segments_from_lengths([[9, 7]], 16))
