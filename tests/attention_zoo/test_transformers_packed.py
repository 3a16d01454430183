"""Packed rows through the Hugging Face integration (attention_zoo.integrations.transformers), on a tiny Llama built
offline from a config, in float64.

transformers marks packing with ``position_ids`` that restart at 0 (it then builds a block-diagonal causal mask,
without a KV cache only) or, from ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``, with
``cu_seq_lens_q`` / ``cu_seq_lens_k``. Every document of a packed row must give the logits of that document run
alone (Llama's rotary positions restart with ``position_ids``), and ``full`` those of transformers' own sdpa on the
same packed input; what cannot be read as documents is refused in one line.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from transformers import AutoModelForCausalLM, DataCollatorWithFlattening, GPT2Config, LlamaConfig  # noqa: E402

import attention_zoo as az  # noqa: E402
from attention_zoo.integrations import transformers as hf  # noqa: E402
from attention_zoo.packing import segments_from_lengths  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB, MAX_LEN = 64, 64
#: documents of each packed row: one of a single token, one that fills a row, one shorter than local's window
LENGTHS = [[5, 1, 7, 3], [16]]
N = 16


def llama() -> AutoModelForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, max_position_embeddings=MAX_LEN, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval().double()


def packed_batch(lengths: list[list[int]] = LENGTHS) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids (B, N) and position_ids restarting at 0 at each document."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (len(lengths), N), generator=generator)
    positions = torch.stack([torch.cat([torch.arange(size) for size in row]) for row in lengths])
    return ids, positions


def documents(lengths: list[list[int]] = LENGTHS) -> list[tuple[int, int, int]]:
    """(row, start, end) of every document."""
    found = []
    for row, sizes in enumerate(lengths):
        start = 0
        for size in sizes:
            found.append((row, start, start + size))
            start += size
    return found


def each_document_alone(net: AutoModelForCausalLM, ids: torch.Tensor, lengths: list[list[int]] = LENGTHS):
    """The logits of every document run on its own, laid out as the packed rows."""
    out = torch.zeros(*ids.shape, VOCAB, dtype=torch.float64)
    for row, start, end in documents(lengths):
        out[row, start:end] = net(input_ids=ids[row : row + 1, start:end]).logits[0]
    return out


def test_full_on_packed_rows_matches_sdpa_and_each_document_alone():
    net = llama()
    ids, positions = packed_batch()
    with torch.no_grad():
        sdpa = net(input_ids=ids, position_ids=positions, use_cache=False).logits
        alone = each_document_alone(net, ids)  # transformers' sdpa, one document at a time
        hf.use_attention(net, "full")
        packed = net(input_ids=ids, position_ids=positions, use_cache=False).logits
        unpacked = net(input_ids=ids, use_cache=False).logits  # the same rows read as one document each
    torch.testing.assert_close(packed, sdpa, rtol=0, atol=1e-10)
    torch.testing.assert_close(packed, alone, rtol=0, atol=1e-10)
    assert (unpacked[0, 5:] - alone[0, 5:]).abs().max() > 1e-3  # without the boundaries the documents mix


@pytest.mark.parametrize(
    ("name", "options"), [("performer", {"nb_features": 16, "chunk_size": 4}), ("local", {"window": 8}),
                          ("cosformer", {"chunk_size": 4})],
)  # fmt: skip
def test_approximate_cores_on_packed_rows_equal_each_document_alone(name, options):
    net = hf.use_attention(llama(), name, **options)  # eval(): Performer's features stay fixed
    ids, positions = packed_batch()
    with torch.no_grad():
        packed = net(input_ids=ids, position_ids=positions, use_cache=False).logits
        alone = each_document_alone(net, ids)
        unpacked = net(input_ids=ids, use_cache=False).logits  # the same rows read as one document each
    torch.testing.assert_close(packed, alone, rtol=0, atol=1e-10)
    assert (unpacked[0, 5:] - alone[0, 5:]).abs().max() > 1e-3  # without the boundaries the documents mix


def test_a_flattened_batch_with_cu_seq_lens_gives_each_document_alone():
    # DataCollatorWithFlattening's flash-attention keywords are honoured as given, as transformers' flash path does,
    # even where its KV cache (use_cache defaults to True) made the 4-D mask plain causal
    net = hf.use_attention(llama(), "full")
    ids, _ = packed_batch()
    sizes = LENGTHS[0]
    features = [{"input_ids": ids[0, start:end].tolist()} for _, start, end in documents([sizes])]
    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=True)(features)
    assert batch["cu_seq_lens_q"].tolist() == [0, 5, 6, 13, 16]
    with torch.no_grad():
        flattened = net(**batch).logits
        without_positions = net(**{k: v for k, v in batch.items() if k != "position_ids"}).logits
        alone = each_document_alone(net, ids[:1], [sizes])
    torch.testing.assert_close(flattened, alone, rtol=0, atol=1e-10)
    # rotary attention depends on relative positions only: positions that continue give the same documents, to the
    # rounding of transformers' float32 rotary angles
    torch.testing.assert_close(without_positions, alone, rtol=0, atol=1e-8)


def test_a_custom_block_diagonal_mask_is_read_as_documents_and_matches_sdpa():
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=MAX_LEN, n_embd=32, n_layer=2, n_head=4, attn_pdrop=0.0,
                        embd_pdrop=0.0, resid_pdrop=0.0)  # fmt: skip
    net = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval().double()
    ids, _ = packed_batch()
    segments = segments_from_lengths(LENGTHS, N)
    block = torch.stack([torch.block_diag(*[torch.ones(s, s) for s in row]) for row in LENGTHS]).bool()
    zoo = hf.use_attention(copy.deepcopy(net), "full")
    for causal in (True, False):  # causal documents, then bidirectional ones
        mask = block & torch.ones(N, N, dtype=torch.bool).tril() if causal else block
        with torch.no_grad():
            reference = net(input_ids=ids, attention_mask=mask[:, None]).logits
            torch.testing.assert_close(zoo(input_ids=ids, attention_mask=mask[:, None]).logits, reference, rtol=0,
                                       atol=1e-10)  # fmt: skip
        key_mask, read_causal, found = hf.read_mask(mask[:, None], N, N, default_causal=not causal)
        assert key_mask is None and read_causal == causal and torch.equal(found, segments)


def test_read_mask_takes_padding_after_the_last_document():
    lengths = [[2, 3], [4, 1, 1]]
    segments = segments_from_lengths(lengths, 8)
    ids = torch.tensor([[0, 0, 1, 1, 1, -1, -1, -1], [0, 0, 0, 0, 1, 2, -1, -1]])
    mask = (ids[:, :, None] == ids[:, None, :]) & (ids >= 0)[:, :, None]  # padding sees nothing, is seen by none
    key_mask, causal, found = hf.read_mask(mask[:, None], 8, 8, default_causal=True)
    assert key_mask is None and not causal and torch.equal(found, segments)
    inside = mask.clone()
    inside[1, 2, 1] = False  # a hole inside a document
    with pytest.raises(ValueError, match="nor packed documents") as error:
        hf.read_mask(inside[:, None], 8, 8, default_causal=True)
    assert "\n" not in str(error.value)


def test_positions_that_neither_restart_nor_continue_are_refused_in_one_line():
    net = hf.use_attention(llama(), "full")
    ids, _ = packed_batch()
    positions = torch.tensor([[0, 1, 2, 5, 6, 7, 8, 9, 0, 1, 2, 3, 4, 5, 6, 7]] * 2)  # transformers packs at the jump
    with pytest.raises(ValueError, match="position 5 at index 3 neither restarts at 0 nor follows") as error:
        net(input_ids=ids, position_ids=positions, use_cache=False)
    assert "\n" not in str(error.value) and str(error.value).startswith("attention_zoo: packed rows: position_ids row")


def test_cu_seq_lens_that_disagree_with_the_mask_or_come_with_padding_are_refused():
    net = hf.use_attention(llama(), "full")
    ids, positions = packed_batch()
    cu = torch.tensor([0, 6, 16], dtype=torch.int32)
    call = dict(input_ids=ids[:1], cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=10, max_length_k=10)
    with pytest.raises(ValueError, match="documents and cu_seq_lens_q's disagree in row 0 at position 5"):
        net(**call, position_ids=positions[:1], use_cache=False)
    with pytest.raises(ValueError, match="cu_seq_lens_q .packed rows. with a padding mask"):
        net(**call, attention_mask=torch.tensor([[1] * 15 + [0]]))


def test_a_core_without_segments_is_refused_naming_it():
    net = hf.use_attention(llama(), "local", window=4)
    for _, layer in hf.attention_layers(net):
        layer.zoo_core.supports_segments = False
    ids, positions = packed_batch()
    with pytest.raises(ValueError, match="transformers passed packed rows and local does not take them") as error:
        net(input_ids=ids, position_ids=positions, use_cache=False)
    assert "\n" not in str(error.value) and "cores that do: " + ", ".join(az.list_attentions(segments=True)) in str(
        error.value
    )


def test_restarting_positions_under_a_cache_are_not_packed_as_in_sdpa_and_say_so(caplog):
    net = llama()
    ids, positions = packed_batch()
    with torch.no_grad():
        sdpa = net(input_ids=ids, position_ids=positions).logits  # use_cache: transformers builds no packed mask
        hf.use_attention(net, "full")
        with caplog.at_level("WARNING", logger=hf.__name__):
            hf._warn_once.cache_clear()
            zoo = net(input_ids=ids, position_ids=positions).logits
    torch.testing.assert_close(zoo, sdpa, rtol=0, atol=1e-10)
    assert "position_ids restart within a row" in caplog.text and "use_cache=False" in caplog.text
