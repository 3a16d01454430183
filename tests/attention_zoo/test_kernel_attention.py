"""The kernelized linear-attention engine, ``linear`` and ``cosformer`` against dense float64 references
written from the papers' equations (an explicit n x n kernel matrix, an explicit lower-triangular mask, an
explicit cos re-weighting matrix), and the engine's own promises: its backward, what it keeps for backward,
chunking, low precision and the decoding state."""

from __future__ import annotations

import io
import math

import pytest
import torch
import torch.nn.functional as F
from rich.console import Console
from torch import Tensor
from torch.utils.flop_counter import FlopCounterMode

import attention_zoo as az
from attention_zoo.kernel.attention import CausalProduct
from attention_zoo.masks import pad_mask
from experiments.bench import targets
from experiments.bench.cases import Case
from experiments.bench.flops import case_flops

H, D, MAX_LEN = 2, 8, 64
F64 = torch.float64
SHAPES = [(29, 29), (13, 29), (29, 13)]  # (Nq, Nk): self-attention, fewer queries, more queries


def make(name: str, **options) -> az.AttentionCore:
    return az.create_attention(name, dim_head=D, heads=H, max_seq_len=MAX_LEN, **options).double().eval()


def randn(*shape: int, seed: int, scale: float = 1.0, dtype: torch.dtype = F64) -> Tensor:
    return scale * torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64).to(dtype)


def inputs(b: int, nq: int, nk: int, seed: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    return randn(b, H, nq, D, seed=seed), randn(b, H, nk, D, seed=seed + 1), randn(b, H, nk, D, seed=seed + 2)


def visible(nq: int, nk: int, causal: bool, mask: Tensor | None) -> Tensor:
    """(B | 1, 1, Nq, Nk) bool: query i sees key j if j is real and, when causal, j <= i + Nk - Nq."""
    allowed = torch.ones(nq, nk, dtype=torch.bool)
    if causal:
        allowed = allowed.tril(nk - nq)
    allowed = allowed[None, None]
    return allowed if mask is None else allowed & mask[:, None, None, :]


def ratio(kernel: Tensor, v: Tensor) -> Tensor:
    """sum_j kernel_ij v_j / sum_j kernel_ij, zeros where a row has no weight."""
    den = kernel.sum(dim=-1, keepdim=True)
    return torch.where(den > 0, kernel @ v / torch.where(den > 0, den, 1.0), 0.0)


def linear_reference(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool) -> Tensor:
    """Katharopoulos et al. Sec. 3.2-3.3: phi(Q_i)^T phi(K_j) with phi = elu + 1, masked, normalised."""
    phi = lambda x: F.elu(x) + 1
    kernel = phi(q) @ phi(k).transpose(-1, -2)
    return ratio(kernel * visible(q.shape[-2], k.shape[-2], causal, mask), v)


def cosformer_reference(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool) -> Tensor:
    """Qin et al. Sec. 3: ReLU(Q_i) ReLU(K_j)^T cos(pi/2 (i - j) / M), M = max_seq_len, positions as documented."""
    nq, nk = q.shape[-2], k.shape[-2]
    i = torch.arange(nq, dtype=F64) + (nk - nq if causal else 0)
    j = torch.arange(nk, dtype=F64)
    reweighting = torch.cos(math.pi / 2 * (i[:, None] - j[None, :]) / MAX_LEN)
    kernel = F.relu(q) @ F.relu(k).transpose(-1, -2) * reweighting
    return ratio(kernel * visible(nq, nk, causal, mask), v)


REFERENCES = {"linear": linear_reference, "cosformer": cosformer_reference}


# --- linear and cosformer against their papers ------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(REFERENCES))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"nq{s[0]}-nk{s[1]}")
@pytest.mark.parametrize("chunk_size", [1, 5, 64])
def test_matches_the_dense_reference(name, causal, shape, chunk_size):
    nq, nk = shape
    core = make(name, chunk_size=chunk_size)
    q, k, v = inputs(3, nq, nk)
    mask = pad_mask(torch.tensor([nk, nk - 6, 1]), nk)
    for m in (None, mask):
        expected = REFERENCES[name](q, k, v, m, causal)
        out = core(q, k, v, mask=m, causal=causal)
        if m is not None and nq == nk:  # self-attention: outputs at padded query positions are unspecified
            out, expected = (t * m[:, None, :, None] for t in (out, expected))
        torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", sorted(REFERENCES))
@pytest.mark.parametrize("causal", [False, True])
def test_gradients_match_the_dense_reference(name, causal):
    """The chunked scan's backward (Katharopoulos Sec. 3.3.1) gives autograd's gradients of the dense form."""
    core = make(name, chunk_size=4)
    leaves = [t.requires_grad_(True) for t in inputs(2, 19, 19, seed=3)]
    mask = pad_mask(torch.tensor([19, 12]), 19)
    weights = randn(2, H, 19, D, seed=9)
    grads = []
    for function in (core, lambda *a, **kw: REFERENCES[name](*a, kw["mask"], kw["causal"])):
        out = function(*leaves, mask=mask, causal=causal) * mask[:, None, :, None]  # real query positions
        grads.append(torch.autograd.grad((out * weights).sum(), leaves))
    for got, expected in zip(*grads, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)


def test_cosformer_reweighting_length_is_max_seq_len_so_padding_length_does_not_matter():
    """With the authors' M = max(Nq, Nk) of the call, padding a batch further would change every output."""
    core = make("cosformer")
    q, k, v = inputs(1, 20, 20)
    alone = core(q, k, v)
    padded = [F.pad(t, (0, 0, 0, 20)) for t in (q, k, v)]
    out = core(*padded, mask=pad_mask(torch.tensor([20]), 40))
    torch.testing.assert_close(out[:, :, :20], alone, rtol=0.0, atol=1e-12)


def test_cosformer_needs_max_seq_len_and_refuses_longer_noncausal_queries():
    with pytest.raises(ValueError, match="needs max_seq_len"):
        az.create_attention("cosformer", dim_head=D, heads=H)
    core = make("cosformer")
    q, k, v = randn(1, H, MAX_LEN + 1, D, seed=0), randn(1, H, 8, D, seed=1), randn(1, H, 8, D, seed=2)
    with pytest.raises(ValueError, match="query length 65 exceeds max_seq_len=64"):
        core(q, k, v)
    assert torch.isfinite(core(q, k, v, causal=True)).all()  # causal: queries end-aligned with the keys


# --- the engine ---------------------------------------------------------------------------------------------


def dense_causal_product(fq: Tensor, fk: Tensor, values: Tensor, scale: Tensor) -> Tensor:
    """sum_{j <= i} exp(scale_j - max_{j' <= i} scale_j') (fq_i . fk_j) values_j, with an explicit mask."""
    n = fq.shape[-2]
    level = scale.cummax(dim=-1).values
    w = torch.exp(scale[..., None, :] - level[..., :, None]) * torch.ones(n, n, dtype=F64).tril()
    return (w * (fq @ fk.transpose(-1, -2))) @ values


def test_causal_product_with_scales_matches_its_definition_and_gradients():
    chunk, n = 4, 16
    fq, fk = randn(2, 3, n, 5, seed=0).exp(), randn(2, 3, n, 5, seed=1).exp()
    values, scale = randn(2, 3, n, 6, seed=2), randn(2, 3, n, seed=4, scale=3.0)
    leaves = [t.requires_grad_(True) for t in (fq, fk, values)]
    weights = randn(2, 3, n, 6, seed=3)
    for s in (None, scale):
        got = CausalProduct.apply(*leaves, s, chunk)
        expected = dense_causal_product(*leaves, torch.zeros(2, 3, n, dtype=F64) if s is None else s)
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
        for a, b in zip(
            torch.autograd.grad((got * weights).sum(), leaves),
            torch.autograd.grad((expected * weights).sum(), leaves),
            strict=True,
        ):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    small = [t.detach()[:1, :1, :8, :2].requires_grad_(True) for t in leaves]
    assert torch.autograd.gradcheck(lambda *t: CausalProduct.apply(*t, scale[:1, :1, :8], chunk), small)


@pytest.mark.parametrize("wanted", [(0, 1, 2), (1, 2), (0, 1), (0, 2), (1,), (2,)])
def test_causal_product_gradients_for_any_inputs_that_need_them(wanted):
    """Without scales the backward shares blocks and one reverse scan between grad phi(K) and grad [V 1]; each
    subset of inputs that need gradients gets the dense form's, first and second order."""
    chunk, n = 4, 14  # n not a multiple of the chunk: the caller pads, here the product sees 16
    fq, fk = randn(2, 3, 16, 5, seed=0).exp(), randn(2, 3, 16, 5, seed=1).exp()
    values = randn(2, 3, 16, 6, seed=2)
    leaves = [t.requires_grad_(i in wanted) for i, t in enumerate((fq, fk, values))]
    weights = randn(2, 3, 16, 6, seed=3)
    got = CausalProduct.apply(*leaves, None, chunk)[:, :, :n]
    expected = dense_causal_product(*leaves, torch.zeros(2, 3, 16, dtype=F64))[:, :, :n]
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    inputs_wanted = [leaves[i] for i in wanted]
    reference = torch.autograd.grad((expected * weights[:, :, :n]).sum(), inputs_wanted, create_graph=True)
    for create_graph in (False, True):  # in place and shared, or differentiable
        first = torch.autograd.grad(
            (got * weights[:, :, :n]).sum(), inputs_wanted, create_graph=create_graph, retain_graph=True
        )
        for a, b in zip(first, reference, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    probe = sum((g * randn(*g.shape, seed=10 + i)).sum() for i, g in enumerate(first))
    expected_probe = sum((g * randn(*g.shape, seed=10 + i)).sum() for i, g in enumerate(reference))
    # the product is linear in each input: a lone input's gradient does not depend on it
    assert probe.requires_grad == expected_probe.requires_grad == (len(wanted) > 1)
    if not probe.requires_grad:
        return
    second = torch.autograd.grad(probe, inputs_wanted, allow_unused=True)
    expected_second = torch.autograd.grad(expected_probe, inputs_wanted, allow_unused=True)
    for a, b in zip(second, expected_second, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", ["linear", "cosformer", "performer"])
def test_later_keys_do_not_change_earlier_outputs_even_in_rounding(name):
    """Query i's weights use only keys j <= i (Performer: the running maximum over the keys it sees), so
    huge later keys and values leave earlier outputs bit for bit unchanged, in float32, mid-chunk too."""
    core = az.create_attention(name, dim_head=D, heads=H, max_seq_len=MAX_LEN, chunk_size=16).eval()
    q, k, v = (randn(2, H, 40, D, seed=s, scale=2.0, dtype=torch.float32) for s in range(3))
    out = core(q, k, v, causal=True)
    for cut in (5, 21, 33):
        later = torch.arange(40) >= cut
        k2 = torch.where(later[:, None], 30 * randn(2, H, 40, D, seed=7, dtype=torch.float32), k)
        v2 = torch.where(later[:, None], 1e4 * randn(2, H, 40, D, seed=8, dtype=torch.float32), v)
        assert torch.equal(core(q, k2, v2, causal=True)[:, :, :cut], out[:, :, :cut])


@pytest.mark.parametrize("name", ["linear", "cosformer", "performer"])
def test_causal_outputs_do_not_depend_on_the_chunk_size(name):
    q, k, v = inputs(2, 37, 37, seed=4)
    mask = pad_mask(torch.tensor([37, 30]), 37)
    outs = [make(name, chunk_size=c)(q, k, v, mask=mask, causal=True) for c in (1, 3, 8, 37, 64)]
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], rtol=0.0, atol=1e-12)


@pytest.mark.parametrize("name", ["linear", "performer"])
def test_nothing_of_size_n_m_d_or_n_over_c_m_d_is_kept_for_backward(name):
    """Public causal linear attention keeps the cumulative outer products, (n, m, d); a vectorised chunked
    form keeps one state per chunk, (n / c, m, d). Here every tensor saved for backward is O(n (m + d))."""
    n, chunk, d = 256, 4, 32
    options = {"nb_features": 32} if name == "performer" else {}
    core = az.create_attention(name, dim_head=d, heads=1, chunk_size=chunk, **options)
    m = 32
    q, k, v = (torch.randn(1, 1, n, d, requires_grad=True) for _ in range(3))
    sizes: list[int] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.numel()) or t, lambda t: t):
        core(q, k, v, causal=True).sum().backward()
    assert max(sizes) <= n * (m + d + 1) < (n // chunk) * m * d


@pytest.mark.parametrize("name", ["linear", "cosformer", "performer"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_half_precision_accumulates_in_float32(name, dtype, causal):
    """n = 2048 values around 200: sum_j phi(K_j) V_j^T overflows fp16 (65504), and a bf16 running sum of
    2048 positive terms stops growing (8-bit mantissa). Against float64 on the same (rounded) inputs, the
    only error left must be the rounding of the output to ``dtype``."""
    n = 2048
    options = {"nb_features": 64} if name == "performer" else {}
    core = az.create_attention(name, dim_head=D, heads=1, max_seq_len=n, **options).eval()
    q, k = randn(1, 1, n, D, seed=0, dtype=dtype), randn(1, 1, n, D, seed=1, dtype=dtype)
    v = (200 + randn(1, 1, n, D, seed=2, scale=20.0)).to(dtype)
    fk = core.double().features(k.double(), torch.arange(n), is_query=False)
    fk = fk.exp() if core.log_key_features else fk
    assert not torch.isfinite((fk.half().transpose(-1, -2) @ v.half()).float()).all()  # naive fp16 overflows
    expected = core.double()(q.double(), k.double(), v.double(), causal=causal)
    out = core.to(dtype)(q, k, v, causal=causal)
    assert out.dtype == dtype and torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), expected, rtol=torch.finfo(dtype).eps, atol=0.0)


def test_autocast_does_not_lower_the_precision_inside():
    core = az.create_attention("linear", dim_head=D, heads=H, chunk_size=8)
    q, k, v = (randn(2, H, 40, D, seed=s, dtype=torch.float32) for s in range(3))
    plain = core(q, k, v, causal=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast = core(q, k, v, causal=True)
    torch.testing.assert_close(autocast, plain, rtol=0.0, atol=0.0)


@pytest.mark.parametrize("name", ["linear", "cosformer", "performer"])
def test_decoding_state_is_constant_size_and_float32_for_half_inputs(name):
    core = az.create_attention(name, dim_head=D, heads=H, max_seq_len=MAX_LEN).to(torch.bfloat16).eval()
    q, k, v = (randn(2, H, 50, D, seed=s, dtype=torch.bfloat16) for s in range(3))
    state = core.start_decoding()
    shapes = set()
    for t in range(50):
        core.decode(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], state)
        shapes.add(tuple(state.sums.shape))
    m = core.nb_features if name == "performer" else {"linear": D, "cosformer": 2 * D}[name]
    assert shapes == {(2, H, m, D + 1)} and state.sums.dtype == torch.float32


@pytest.mark.parametrize("name", sorted(REFERENCES))
def test_a_long_prefill_is_decoded_in_chunks_and_continues_exactly(name):
    """A prefill longer than ``chunk_size`` (and not a multiple of it) is scanned chunk by chunk, like the
    forward, not as one T x T block; the outputs and the state it leaves match the paper's dense causal form."""
    core = make(name, chunk_size=8)
    q, k, v = inputs(2, 50, 50)
    mask = pad_mask(torch.tensor([50, 37]), 50)
    reference = REFERENCES[name](q, k, v, mask, True)
    state = core.start_decoding()
    blocks = []  # the query rows of every product
    original = torch.Tensor.__matmul__

    def recording(a, b):
        blocks.append(a.shape[-2])
        return original(a, b)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.Tensor, "__matmul__", recording)
        prefill = core.decode(q[:, :, :43], k[:, :, :43], v[:, :, :43], state, mask=mask[:, :43])
    assert blocks and max(blocks) <= 8  # every product takes at most one chunk of query rows
    steps = [core.decode(q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], state, mask=mask[:, t : t + 1])
             for t in range(43, 50)]  # fmt: skip
    decoded = torch.cat([prefill, *steps], dim=-2)
    for b, length in enumerate((50, 37)):
        torch.testing.assert_close(decoded[b, :, :length], reference[b, :, :length], rtol=0.0, atol=1e-10)


# --- the harness: FLOP formulas and performance targets -----------------------------------------------------


@pytest.mark.parametrize("name, options", [("linear", {}), ("cosformer", {}), ("performer", {"nb_features": 24})])
@pytest.mark.parametrize("causal", [False, True])
def test_flop_formulas_count_the_matrix_products(name, options, causal):
    """``experiments.bench.flops`` against torch's FLOP counter: exact non-causal; causal, the counted work plus
    the documented 2 n c (m + d + 1) of the blocks inside the chunks."""
    n, chunk = 48, 8
    core = az.create_attention(name, dim_head=D, heads=H, max_seq_len=MAX_LEN, chunk_size=chunk, **options).eval()
    q, k, v = inputs(2, n, n)
    with FlopCounterMode(display=False) as counter:
        core.double()(q, k, v, causal=causal)
    case = Case(
        attention=name, options=options | {"chunk_size": chunk}, level="core", mode="fwd", dtype="float32",
        device="cpu", seq_len=n, batch=2, heads=H, dim_head=D, threads=1, causal=causal,
    )  # fmt: skip
    m = {"linear": D, "cosformer": 2 * D, "performer": 24}[name]
    blocks = 2 * H * 2 * n * chunk * (m + D + 1) if causal else 0
    assert counter.get_total_flops() == case_flops(case) + blocks


def test_causal_targets_compare_with_causal_full_attention():
    cases = targets.target_cases({"linear"}, threads=1)
    assert [c.causal for c in cases[:2]] == [False, True] and {c.attention for c in cases[:2]} == {"full"}
    ms = lambda c: {False: 1000.0, True: 600.0}[c.causal] if c.attention == "full" else c.seq_len / (40 - 20 * c.causal)
    rows = {c.key(): {"status": "ok", "time_ms_min": ms(c)} for c in cases}
    console = Console(file=io.StringIO(), width=200)
    console.print(targets.targets_table(rows, {"linear"}, threads=1))
    text = console.file.getvalue()
    assert f"{1000 / (4096 / 40):.2f}x" in text  # non-causal: 9.77x, below 25x
    assert "linear (causal)" in text and f"{600 / (4096 / 20):.2f}x" in text  # causal against causal SDPA: 2.93x


def test_log_domain_key_features_need_a_noncausal_form_of_their_own():
    """The shared non-causal path sums phi(K) as given; log phi(K) there would be a wrong kernel, silently."""
    from attention_zoo.core import Geometry
    from attention_zoo.kernel.attention import KernelAttention

    class LogFeatures(KernelAttention):
        log_key_features = True

        def features(self, x: Tensor, positions: Tensor, *, is_query: bool) -> Tensor:
            return x if not is_query else x.exp()

    core = LogFeatures(Geometry(dim_head=4, heads=2))
    q, k, v = (torch.randn(1, 2, 6, 4) for _ in range(3))
    assert torch.isfinite(core(q, k, v, causal=True)).all()  # the causal scan exponentiates them itself
    with pytest.raises(NotImplementedError, match="LogFeatures has log-domain key features"):
        core(q, k, v, causal=False)
