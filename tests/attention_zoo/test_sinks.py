"""Learned attention sinks (``sink_logit``) on ``full``, ``local``, ``longformer`` and ``streaming_llm``.

Every backend and implementation against the float64 reference written from the equation
(:func:`attention_zoo.sinks.naive_sink_attention`, over the connectivity sets of tests/attention_zoo/test_sparse.py):
outputs and gradients (q, k, v and the sink logits), causal and not, with padding and a row with no real key;
FlexAttention's forward; decoding step by step; packed rows against each document alone; the gate identity
o = softmax(s) V sigmoid(L - σ); and the StreamingLLM entry with its constant-memory cache.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import Tensor

import attention_zoo as az
from attention_zoo.core import Geometry
from attention_zoo.packing import segments_from_lengths
from attention_zoo.sinks import naive_sink_attention
from attention_zoo.sparse.attention import PatternAttention
from attention_zoo.sparse.patterns import FixedPattern
from tests.attention_zoo.test_sparse import reference_allowed
from tests.attention_zoo.test_sparse_packed import flex_refusal

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile"),
]

HEADS, DIM_HEAD, N = 2, 4, 37
TIGHT = dict(rtol=0.0, atol=1e-10)
#: logits that take a real share of each row (scores here are about N(0, 1)), one per head
SINKS = (1.5, -0.5)

CASES = [
    ("full", {"backend": "math"}),
    ("full", {"backend": "sdpa"}),
    ("local", {"window": 6, "impl": "blocked"}),
    ("local", {"window": 6, "impl": "dense"}),
    ("longformer", {"window": 6, "global_tokens": 2, "impl": "blocked"}),
    ("longformer", {"window": 6, "global_tokens": 2, "impl": "dense"}),
    ("longformer", {"window": 10, "global_tokens": 0, "impl": "blocked"}),
    ("streaming_llm", {"window": 6, "global_tokens": 3, "impl": "blocked"}),
]
IDS = [f"{name}-{'-'.join(map(str, options.values()))}" for name, options in CASES]


def make(name: str, options: dict, *, dim_head: int = DIM_HEAD, sinks: tuple[float, ...] = SINKS) -> az.AttentionCore:
    core = az.create_attention(name, dim_head=dim_head, heads=HEADS, sink_logit=True, **options).double()
    with torch.no_grad():
        core.sinks.copy_(torch.tensor(sinks))
    return core


def inputs(b: int, n: int, *, nk: int | None = None, dim_head: int = DIM_HEAD, seed: int = 0) -> list[Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shapes = [(b, HEADS, n, dim_head), *2 * [(b, HEADS, n if nk is None else nk, dim_head)]]
    return [torch.randn(shape, generator=generator, dtype=torch.float64) for shape in shapes]


def padding(n: int) -> Tensor:
    mask = torch.ones(4, n, dtype=torch.bool)
    mask[0, :3] = False  # left padding
    mask[1, n - 5 :] = False  # right padding
    mask[2, 11:16] = False  # a hole
    mask[3] = False  # no real key at all
    return mask


def allowed_set(name: str, options: dict, nq: int, nk: int, causal: bool) -> Tensor:
    """(Nq, Nk): the keys each query may see, from the papers' sets (causal aligned to the end for full)."""
    if name == "full":
        if not causal:
            return torch.ones(nq, nk, dtype=torch.bool)
        return torch.tensor([[j <= i + nk - nq for j in range(nk)] for i in range(nq)])
    kind = "local" if name == "local" else "longformer"
    return reference_allowed(kind, {o: x for o, x in options.items() if o != "impl"}, nq, causal)


def causal_modes(name: str) -> list[bool]:
    return [True] if name == "streaming_llm" else [False, True]


def outputs_and_gradients(attend, q: Tensor, k: Tensor, v: Tensor, sinks: Tensor, weight: Tensor) -> list[Tensor]:
    """attend(q, k, v)'s output and the gradients of sum(output * weight + output^2) to q, k, v and ``sinks`` (a leaf);
    the square keeps the sinks' gradient, -Σ_i exp(σ - L'_i) dO_i o_i, from summing to nearly 0."""
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    out = attend(*leaves)
    return [out.detach(), *torch.autograd.grad((out * weight + out.square()).sum(), [*leaves, sinks])]


def against_reference(core, name, options, q, k, v, mask, causal) -> tuple[list[Tensor], list[Tensor], Tensor]:
    """(core's output and gradients, the reference's, the allowed set (B | 1, 1, Nq, Nk))."""
    allowed = allowed_set(name, options, q.shape[2], k.shape[2], causal)[None, None]
    if mask is not None:
        allowed = allowed & mask[:, None, None, :]
    weight = torch.randn(q.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    got = outputs_and_gradients(lambda *t: core(*t, mask=mask, causal=causal), q, k, v, core.sinks, weight)
    sinks = core.sinks.detach().clone().requires_grad_(True)
    reference = lambda *t: naive_sink_attention(*t, allowed, sinks, DIM_HEAD**-0.5)  # noqa: E731
    return got, outputs_and_gradients(reference, q, k, v, sinks, weight), allowed


def assert_all_close(got: list[Tensor], expected: list[Tensor]) -> None:
    for label, a, b in zip(("output", "dq", "dk", "dv", "dsinks"), got, expected, strict=True):
        torch.testing.assert_close(a, b, **TIGHT, msg=label)


#: every case with each value of ``causal`` it takes
CAUSAL_CASES = [(name, options, causal) for name, options in CASES for causal in causal_modes(name)]
CAUSAL_IDS = [
    f"{case_id}-{'causal' if causal else 'bidirectional'}"
    for (name, _), case_id in zip(CASES, IDS, strict=True)
    for causal in causal_modes(name)
]


@pytest.mark.parametrize("masked", [False, True], ids=["unpadded", "padded"])
@pytest.mark.parametrize(("name", "options", "causal"), CAUSAL_CASES, ids=CAUSAL_IDS)
def test_outputs_and_gradients_equal_the_reference(name, options, causal, masked):
    """Padding: left, right, a hole and a row with no real key (its output and gradients are 0)."""
    core = make(name, options)
    q, k, v = inputs(4, N)
    got, expected, allowed = against_reference(core, name, options, q, k, v, padding(N) if masked else None, causal)
    assert_all_close(got, expected)
    assert expected[4].abs().min() > 1e-3, "the sinks' gradient should be far from 0 here"
    if masked:
        assert got[0][3].abs().max() == 0, "a query with no key gives 0"
    if name != "full":
        assert not allowed[0, 0].all(), "the pattern should be sparse at this length"


@pytest.mark.parametrize("masked", [False, True], ids=["unpadded", "padded"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("backend", ["math", "sdpa"])
@pytest.mark.parametrize(("nq", "nk"), [(9, 23), (23, 9)])
def test_full_cross_attention_equals_the_reference(backend, nq, nk, causal, masked):
    """Nq != Nk, causal aligned to the end: with Nq > Nk the first queries see no key and give 0."""
    core = make("full", {"backend": backend})
    q, k, v = inputs(4, nq, nk=nk)
    mask = padding(nk) if masked else None
    got, expected, _ = against_reference(core, "full", {}, q, k, v, mask, causal)
    assert_all_close(got, expected)


FLEX_CASES = [
    ("local", {"window": 6}),
    ("longformer", {"window": 6, "global_tokens": 2}),
    ("streaming_llm", {"window": 6, "global_tokens": 3}),
]


@pytest.mark.parametrize("masked", [False, True], ids=["unpadded", "padded"])
@pytest.mark.parametrize(("name", "options"), FLEX_CASES, ids=[name for name, _ in FLEX_CASES])
def test_flex_forward_equals_the_reference(name, options, masked):
    """FlexAttention's forward (the CPU runs no FlexAttention backward; its gradients go through the log-sum-exp
    it returns, on CUDA), padded rows included, and packed rows against each document alone."""
    if flex_refusal() is not None:
        pytest.skip(flex_refusal())
    core = make(name, {**options, "impl": "flex"}, dim_head=16).eval()
    q, k, v = inputs(4, N, dim_head=16)
    mask = padding(N) if masked else None
    for causal in causal_modes(name):
        allowed = allowed_set(name, options, N, N, causal)[None, None]
        allowed = allowed if mask is None else allowed & mask[:, None, None, :]
        with torch.no_grad():
            out = core(q, k, v, mask=mask, causal=causal)
        torch.testing.assert_close(out, naive_sink_attention(q, k, v, allowed, core.sinks, 16**-0.5), **TIGHT)
        lengths = [[5, 20, 9], [N], [1, 6], []]
        with torch.no_grad():
            packed = core(q, k, v, causal=causal, segments=segments_from_lengths(lengths, N))
        assert_each_document_alone(packed, core, q, k, v, lengths, causal, atol=1e-10)


def decode_in_chunks(core: az.AttentionCore, q, k, v, mask: Tensor, chunk: int) -> Tensor:
    state = core.start_decoding()
    steps = [
        core.decode(
            q[:, :, t : t + chunk], k[:, :, t : t + chunk], v[:, :, t : t + chunk], state, mask=mask[:, t : t + chunk]
        )
        for t in range(0, q.shape[2], chunk)
    ]
    return torch.cat(steps, dim=2)


DECODING_CASES = [(name, options) for name, options in CASES if options.get("impl") != "dense"]


@pytest.mark.parametrize("chunk", [1, 3])
@pytest.mark.parametrize(
    ("name", "options"), DECODING_CASES, ids=[f"{n}-{'-'.join(map(str, o.values()))}" for n, o in DECODING_CASES]
)
def test_decoding_step_by_step_equals_the_causal_forward(name, options, chunk):
    """Outputs at the real positions, and the sinks' gradient through the decoding steps (the sparse caches drop
    keys on the way) equals the forward's."""
    core = make(name, options)
    n = 40
    q, k, v = inputs(4, n)
    mask = padding(n)
    mask[3, 30:] = True  # a row that starts with padding only
    real = mask[:, None, :, None]
    forward = core(q, k, v, mask=mask, causal=True)
    (forward_grad,) = torch.autograd.grad((forward * real).square().sum(), core.sinks)
    decoded = decode_in_chunks(core, q, k, v, mask, chunk)
    (decoded_grad,) = torch.autograd.grad((decoded * real).square().sum(), core.sinks)
    for b in range(4):
        torch.testing.assert_close(decoded[b][:, mask[b]], forward[b][:, mask[b]].detach(), **TIGHT)
    torch.testing.assert_close(decoded_grad, forward_grad, **TIGHT)


def assert_each_document_alone(packed: Tensor, core, q, k, v, lengths, causal: bool, atol: float) -> None:
    for row, sizes in enumerate(lengths):
        start = 0
        for size in sizes:
            part = slice(start, start + size)
            with torch.no_grad():
                alone = core(q[row : row + 1, :, part], k[row : row + 1, :, part], v[row : row + 1, :, part],
                             causal=causal)  # fmt: skip
            torch.testing.assert_close(packed[row : row + 1, :, part], alone, rtol=0.0, atol=atol)
            start += size
        assert not packed[row, :, start:].any(), "padding after the last document gives 0"


@pytest.mark.parametrize(("name", "options", "causal"), CAUSAL_CASES, ids=CAUSAL_IDS)
def test_packed_rows_equal_each_document_alone(name, options, causal):
    """Documents of length 1, shorter than the window, longer than it, a full row and a row of padding only."""
    core = make(name, options)
    q, k, v = inputs(4, N)
    lengths = [[1, 4, 25, 7], [N], [3, 1, 20], []]
    with torch.no_grad():
        packed = core(q, k, v, causal=causal, segments=segments_from_lengths(lengths, N))
    assert_each_document_alone(packed, core, q, k, v, lengths, causal, atol=1e-10)


@pytest.mark.parametrize("causal", [False, True])
def test_the_sink_gates_the_softmax_output(causal):
    """o = softmax(s) V * sigmoid(L - σ_h) with L the log-sum-exp of the scores over the keys (the cheap exact form
    the kernels use), and the weights of a row sum to 1 - exp(σ_h - L')."""
    core, plain = (
        make("full", {"backend": "math"}),
        az.create_attention("full", dim_head=DIM_HEAD, heads=HEADS, backend="math").double(),
    )
    q, k, v = inputs(2, 11)
    scores = (q @ k.mT) * DIM_HEAD**-0.5
    if causal:
        scores = scores.masked_fill(~torch.ones(11, 11, dtype=torch.bool).tril(), -torch.inf)
    gate = torch.sigmoid(scores.logsumexp(dim=-1) - core.sinks.detach()[:, None])[..., None]
    with torch.no_grad():
        torch.testing.assert_close(core(q, k, v, causal=causal), plain(q, k, v, causal=causal) * gate, **TIGHT)
        rows = core.attention_probs(q, k, causal=causal).sum(dim=-1, keepdim=True)
    torch.testing.assert_close(rows, gate, **TIGHT)


@pytest.mark.parametrize(
    ("name", "options"),
    [("full", {}), ("local", {"window": 6}), ("longformer", {"window": 6}), ("streaming_llm", {"window": 6})],
)
def test_the_option_adds_one_logit_per_head_initialised_to_zero(name, options):
    with_sink = az.create_attention(name, dim_head=DIM_HEAD, heads=3, sink_logit=True, **options)
    assert dict(with_sink.named_parameters()).keys() == {"sinks"}
    torch.testing.assert_close(with_sink.sinks.detach(), torch.zeros(3), rtol=0, atol=0)
    without = az.create_attention(name, dim_head=DIM_HEAD, heads=3, **options)
    assert inspect.signature(type(without).__init__).parameters["sink_logit"].default is False
    assert without.sinks is None and "sinks" not in without.state_dict() and not list(without.parameters())


def test_combinations_without_a_sink_are_refused_in_one_line():
    with pytest.raises(ValueError, match="sink_logit=True runs on backend 'auto', 'math' or 'sdpa'"):
        az.create_attention("full", dim_head=DIM_HEAD, heads=HEADS, backend="xformers", sink_logit=True)
    with pytest.raises(ValueError, match="sink_logit=True needs a pattern built on a band"):
        PatternAttention(Geometry(DIM_HEAD, HEADS), pattern=FixedPattern(stride=4, summary_columns=1), sink_logit=True)


def test_streaming_llm_is_causal_longformer_with_the_papers_defaults():
    """4 sink tokens and w = 2040 (a cache of 4 + 1020 keys); registered, causal only; the same outputs as causal
    longformer with the same options."""
    options = {o.name: o.default for o in az.attention_options(az.get_attention_class("streaming_llm"))}
    assert options == {"window": 2040, "global_tokens": 4, "impl": "auto", "sink_logit": False}
    assert "streaming_llm" in az.list_attentions(causal_only=True)
    core = az.create_attention("streaming_llm", dim_head=DIM_HEAD, heads=HEADS, window=6, global_tokens=3).double()
    q, k, v = inputs(2, N)
    with pytest.raises(ValueError, match="causal only"):
        core(q, k, v, causal=False)
    longformer = az.create_attention("longformer", dim_head=DIM_HEAD, heads=HEADS, window=6, global_tokens=3).double()
    torch.testing.assert_close(core(q, k, v, causal=True), longformer(q, k, v, causal=True), rtol=0, atol=0)
    built = az.create_attention("streaming_llm", dim_head=DIM_HEAD, heads=HEADS, max_seq_len=64)
    assert (built.pattern.window, built.pattern.global_tokens) == (2040, 4), "the default is never refused as too long"


@pytest.mark.parametrize("sink_logit", [False, True])
def test_streaming_llm_cache_holds_the_sinks_and_the_window_whatever_the_length(sink_logit):
    """After every step the s sink keys and the last w/2 (s + w/2 from then on), in a buffer that stops growing."""
    s, w, n = 3, 8, 100
    core = az.create_attention("streaming_llm", dim_head=DIM_HEAD, heads=HEADS, window=w, global_tokens=s,
                               sink_logit=sink_logit).double()  # fmt: skip
    q, k, v = inputs(1, n)
    state = core.start_decoding()
    capacity = {}
    with torch.no_grad():
        for position in range(n):
            one = slice(position, position + 1)
            core.decode(q[:, :, one], k[:, :, one], v[:, :, one], state)
            assert state.size == min(position + 1, s + w // 2), f"after {position + 1} positions"
            capacity[position] = state.keys.shape[2]
    assert capacity[n - 1] == capacity[n // 2] <= 16, "the buffer is that of the first allocation"
    kept = torch.cat([k[:, :, :s], k[:, :, -(w // 2) :]], dim=2)
    torch.testing.assert_close(state.keys[:, :, : state.size], kept, rtol=0, atol=0)


def test_streaming_llm_cache_at_the_papers_defaults_is_4_plus_1020_keys():
    core = az.create_attention("streaming_llm", dim_head=DIM_HEAD, heads=1).double()
    n, chunk = 1536, 128
    generator = torch.Generator().manual_seed(0)
    k = torch.randn(1, 1, n, DIM_HEAD, generator=generator, dtype=torch.float64)
    state = core.start_decoding()
    with torch.no_grad():
        for start in range(0, n, chunk):
            part = slice(start, start + chunk)
            core.decode(k[:, :, part], k[:, :, part], k[:, :, part], state)
    assert state.size == 4 + 1020
    kept = torch.cat([k[:, :, :4], k[:, :, -1020:]], dim=2)
    torch.testing.assert_close(state.keys[:, :, : state.size], kept, rtol=0, atol=0)
