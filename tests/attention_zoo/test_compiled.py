"""The compiled paths of Nystromformer and Performer (``impl="compiled"``, :mod:`attention_zoo.compiled`).

On the CPU the compiled function equals the eager path (the reference) in float32: the output and the gradients
of q, k, v and Nystromformer's convolution, with a padding mask and without, at a length that is a multiple of
the landmark count and one that is not (a sequence shorter than the landmark count leaves landmarks empty);
Performer non-causal and causal, both kernels, its compiled chunks over a length that is not a multiple of them,
and causal cross-attention with the ends aligned. These comparisons compile through Dynamo with
``fullgraph=True`` (a graph break fails them) and AOTAutograd with the ``aot_eager`` backend: the joint graph
Inductor would receive, without the C++ build of its kernels, which takes tens of seconds per graph on a small
CPU. One Performer case runs the production path through Inductor, forward and backward, and checks that later
calls with new tensors and redrawn random features compile nothing more; a second length compiles once more
(symbolic sizes), later lengths nothing. Inside a model compiled whole (one graph
required), a compiled core is traced into the caller's graph. ``auto`` runs eager on the CPU without compiling, and
on CUDA compiles from :data:`~attention_zoo.compiled.AUTO_MIN_LENGTH` positions on; an unknown ``impl`` is refused
in one line.

On CUDA (``@pytest.mark.cuda``, skipped elsewhere): both cores through Inductor against the eager path in float32,
forward and backward, with padding (and causal for Performer) at a length no chunk divides, in one graph each;
``auto`` compiles there from its minimum length on.
"""

from __future__ import annotations

from functools import cache, partial
from types import SimpleNamespace

import pytest
import torch
from torch import Tensor
from torch._dynamo.utils import counters

import attention_zoo as az
from attention_zoo import compiled
from attention_zoo.core import Geometry
from attention_zoo.masks import pad_mask

pytestmark = pytest.mark.usefixtures("one_thread")

HEADS, DIM_HEAD = 2, 8
NYSTROM = {"num_landmarks": 4, "conv_kernel_size": 3}
PERFORMER = {"nb_features": 16}


@cache
def traced(fn, static, dynamic: bool | None = False):
    """What :func:`attention_zoo.compiled._compiled` builds, with one graph required and Inductor left out; static
    shapes unless ``dynamic`` is None (production's setting; tracing with symbolic sizes is slower)."""
    return torch.compile(
        partial(fn, **dict(static)), backend="aot_eager", fullgraph=True, dynamic=dynamic, **compiled.ISOLATION
    )


@pytest.fixture
def aot_eager(monkeypatch):
    monkeypatch.setattr(compiled, "_compiled", traced)


def pair(name: str, options: dict, **extra) -> tuple[az.AttentionCore, az.AttentionCore]:
    """The same core (same parameters) built eager and compiled."""
    eager = az.create_attention(name, dim_head=DIM_HEAD, heads=HEADS, **options, **extra, impl="eager")
    fused = az.create_attention(name, dim_head=DIM_HEAD, heads=HEADS, **options, **extra, impl="compiled")
    fused.load_state_dict(eager.state_dict())
    return eager, fused


def inputs(n: int, nk: int | None = None, seed: int = 0) -> list[Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(2, HEADS, size, DIM_HEAD, generator=generator) for size in (n, nk or n, nk or n)]


def run(core: az.AttentionCore, tensors: list[Tensor], mask: Tensor | None, causal: bool) -> list[Tensor]:
    """The output, then the gradients of q, k, v and of every parameter, for a fixed output gradient."""
    q, k, v = (t.clone().requires_grad_() for t in tensors)
    out = core(q, k, v, mask=mask, causal=causal)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(1)))
    grads = [q.grad, k.grad, v.grad, *(p.grad for p in core.parameters())]
    core.zero_grad(set_to_none=True)
    return [out.detach(), *grads]


def assert_same(got: list[Tensor], expected: list[Tensor], bound: float = 1e-5) -> None:
    """Each tensor of :func:`run` within ``bound`` of the reference's, in relative (Frobenius) error."""
    assert len(got) == len(expected)
    for i, (a, b) in enumerate(zip(got, expected, strict=True)):
        error = ((a - b).norm() / b.norm()).item()
        assert error < bound, f"{['output', 'q', 'k', 'v'][i] if i < 4 else 'parameter'}: relative error {error:.2e}"


def compare(name: str, options: dict, n: int, lengths: tuple[int, int] | None, causal: bool, nk: int | None = None):
    eager, fused = pair(name, options)
    tensors = inputs(n, nk)
    mask = None if lengths is None else pad_mask(torch.tensor(lengths), nk or n)
    assert_same(run(fused, tensors, mask, causal), run(eager, tensors, mask, causal))


@pytest.mark.usefixtures("aot_eager")
@pytest.mark.parametrize(
    ("options", "n", "lengths"),
    [(NYSTROM, 16, None), (NYSTROM, 13, (13, 3)), ({"num_landmarks": 4, "pinv": "exact"}, 13, (9, 13))],
    ids=["multiple", "padded-empty-landmarks", "exact-pinv"],
)
def test_compiled_nystrom_matches_eager(options, n, lengths):
    compare("nystrom", options, n, lengths, causal=False)


@pytest.mark.usefixtures("aot_eager")
@pytest.mark.parametrize(
    ("kernel", "causal", "n", "lengths"),
    [
        ("softmax", False, 16, None),
        ("softmax", False, 13, (13, 6)),
        ("softmax", True, 16, None),
        ("softmax", True, 13, (13, 6)),
        ("relu", False, 13, (13, 6)),
        ("relu", True, 13, (13, 6)),
    ],
)
def test_compiled_performer_matches_eager(kernel, causal, n, lengths):
    compare("performer", {**PERFORMER, "kernel": kernel}, n, lengths, causal)


@pytest.mark.usefixtures("aot_eager")
def test_compiled_performer_causal_cross_attention_aligns_the_ends():
    compare("performer", PERFORMER, 9, (13, 7), causal=True, nk=13)


def compilations() -> tuple[int, ...]:
    """Graphs Dynamo made, graph breaks, and what AOTAutograd and Inductor compiled (or took from their caches)."""
    graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    return graphs, breaks, sum(counters["aot_autograd"].values()), sum(counters["inductor"].values())


def test_compiled_performer_through_inductor_compiles_once_per_shape():
    n, mask = 13, pad_mask(torch.tensor([13, 6]), 13)
    eager, fused = pair("performer", PERFORMER)
    before = compilations()
    assert_same(run(fused, inputs(n), mask, False), run(eager, inputs(n), mask, False))
    first = compilations()
    assert first[:2] == (before[0] + 1, before[1]), "one graph, no graph break"
    for seed in (1, 2):  # new tensors and, in training, new random features at every pass
        run(fused, inputs(n, seed=seed), mask, False)
    assert fused.draw() == 2
    assert compilations() == first


def test_after_a_second_length_new_lengths_compile_nothing(monkeypatch):
    monkeypatch.setattr(compiled, "_compiled", partial(traced, dynamic=None))
    fused, before = pair("nystrom", NYSTROM)[1], counters["stats"]["unique_graphs"]
    for n in (16, 24):  # the first compiles static (unless an earlier call made the sizes symbolic), the second not
        fused(*inputs(n))
    after = counters["stats"]["unique_graphs"]
    for n in (32, 40, 16):
        fused(*inputs(n))
    assert after - before <= 2 and counters["stats"]["unique_graphs"] == after


def test_inside_a_model_compiled_whole_the_core_joins_its_graph():
    eager, fused = pair("nystrom", NYSTROM)
    tensors, mask = inputs(13), pad_mask(torch.tensor([13, 3]), 13)
    whole = torch.compile(lambda q, k, v: fused(q, k, v, mask=mask), backend="aot_eager", fullgraph=True)
    assert_same([whole(*tensors)], [eager(*tensors, mask=mask)])


def test_auto_compiles_on_cuda_from_its_length_on(monkeypatch):
    monkeypatch.setattr(compiled, "compilable", lambda: True)
    on_cuda = lambda n: SimpleNamespace(is_cuda=True, shape=(2, HEADS, n, DIM_HEAD))  # what resolved reads
    assert compiled.resolved("auto", on_cuda(compiled.AUTO_MIN_LENGTH)) == "compiled"
    assert compiled.resolved("auto", on_cuda(compiled.AUTO_MIN_LENGTH - 1)) == "eager"
    assert compiled.resolved("eager", on_cuda(compiled.AUTO_MIN_LENGTH)) == "eager"
    monkeypatch.setattr(compiled, "compilable", lambda: False)
    assert compiled.resolved("auto", on_cuda(compiled.AUTO_MIN_LENGTH)) == "eager"


@pytest.mark.parametrize(("name", "options"), [("nystrom", NYSTROM), ("performer", PERFORMER)])
def test_auto_runs_eager_on_the_cpu(name, options):
    tensors, mask = inputs(13), pad_mask(torch.tensor([13, 6]), 13)
    auto = az.create_attention(name, dim_head=DIM_HEAD, heads=HEADS, **options)
    eager = az.create_attention(name, dim_head=DIM_HEAD, heads=HEADS, **options, impl="eager")
    eager.load_state_dict(auto.state_dict())
    assert compiled.resolved(auto.impl, tensors[0]) == compiled.resolved("auto", torch.zeros(1, 1, 4096, 1)) == "eager"
    frames = counters["frames"]["total"]
    assert torch.equal(auto(*tensors, mask=mask), eager(*tensors, mask=mask))
    assert counters["frames"]["total"] == frames, "nothing compiled"


@pytest.mark.parametrize(("name", "options"), [("nystrom", NYSTROM), ("performer", PERFORMER)])
def test_an_unknown_impl_is_refused_in_one_line(name, options):
    build = [  # through the registry (which checks the Literal) and the class itself
        partial(az.create_attention, name, dim_head=DIM_HEAD, heads=HEADS),
        partial(az.get_attention_class(name), Geometry(dim_head=DIM_HEAD, heads=HEADS)),
    ]
    for make in build:
        with pytest.raises(ValueError, match=r"impl") as error:
            make(**options, impl="fast")
        message = str(error.value)
        assert "\n" not in message and all(word in message for word in ("'fast'", "'auto'", "'eager'", "'compiled'"))


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize(
    ("name", "options", "causal"),
    [
        ("nystrom", {"num_landmarks": 64, "conv_kernel_size": 33}, False),
        ("performer", {"nb_features": 256}, False),
        ("performer", {"nb_features": 256}, True),
    ],
)
def test_compiled_matches_eager_on_cuda(name, options, causal):
    # relative error of float32 against float32: TF32 matmuls, where enabled, round to 10 mantissa bits
    n, generator = 1000, torch.Generator(device="cuda").manual_seed(0)
    eager, fused = (core.cuda() for core in pair(name, options))
    tensors = [torch.randn(2, 4, n, 64, device="cuda", generator=generator) for _ in range(3)]
    mask = pad_mask(torch.tensor([n, n - 123]), n).cuda()
    breaks = sum(counters["graph_break"].values())
    got, expected = [], []
    for core, results in ((fused, got), (eager, expected)):
        q, k, v = (t.clone().requires_grad_() for t in tensors)
        out = core(q, k, v, mask=mask, causal=causal)
        out.backward(torch.ones_like(out))
        results += [out.detach(), q.grad, k.grad, v.grad, *(p.grad for p in core.parameters())]
    assert_same(got, expected, bound=1e-3)
    assert sum(counters["graph_break"].values()) == breaks
    assert compiled.resolved("auto", torch.zeros(1, 1, compiled.AUTO_MIN_LENGTH, 1, device="cuda")) == "compiled"
