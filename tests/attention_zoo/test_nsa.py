"""NSA (``nsa``): the fast path against the float64 loop of ``attention_zoo.nsa.reference`` (outputs, gradients of
q, k, v and every parameter, the selected block sets), each branch on its own, the degeneracies the module
docstring states, decoding step by step, and what the core refuses."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import Tensor

import attention_zoo as az
from attention_zoo.masks import pad_mask
from attention_zoo.nsa.attention import NativeSparseAttention
from attention_zoo.nsa.reference import nsa_reference
from tests.attention_zoo.allocations import LargestOutput

TIGHT = dict(rtol=0.0, atol=1e-10)  # float64, exact up to summation order
HEADS, DIM_HEAD = 2, 8
CONFIGS = NativeSparseAttention.example_configs
BRANCHES = ("cmp", "slc", "win")


def make(seed: int = 0, **options) -> NativeSparseAttention:
    """A float64 core with every parameter drawn at random and large enough to matter (at initialisation the gates
    are all 1/2 and phi is close to the block mean)."""
    core = az.create_attention("nsa", dim_head=DIM_HEAD, heads=HEADS, **options).double()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in core.parameters():
            parameter.copy_(0.5 * torch.randn(parameter.shape, generator=generator, dtype=torch.float64))
    return core


def inputs(b: int, n: int, seed: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return tuple(
        torch.randn(b, HEADS, n, DIM_HEAD, generator=generator, dtype=torch.float64).requires_grad_() for _ in range(3)
    )


def holes(n: int) -> Tensor:
    """Row 0 all real; row 1 right-padded; row 2 left-padded with a hole inside."""
    mask = torch.ones(3, n, dtype=torch.bool)
    mask[1, n - 5 :] = False
    mask[2, :3] = False
    mask[2, n // 2 : n // 2 + 2] = False
    return mask


def only(core: NativeSparseAttention, branch: str) -> NativeSparseAttention:
    """``core`` with gate 1 on ``branch`` and 0 on the others (sigmoid(+-1e4) is exactly 1 and 0 in float64)."""
    with torch.no_grad():
        core.gate_weight.zero_()
        core.gate_bias.copy_(torch.tensor([1e4 if b == branch else -1e4 for b in BRANCHES]))
    return core


def causal_full(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    n = q.shape[-2]
    scores = (q @ k.mT * DIM_HEAD**-0.5).masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    return scores.softmax(dim=-1) @ v


def fast_selection(core: NativeSparseAttention, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None):
    keys, _, block_real = core.compressed(k if mask is None else k * mask[:, None, :, None], v, mask)
    selected = core.select_blocks(q, keys, block_real, offset=0)
    return [[{int(j) for j in row if j >= 0} for row in sequence] for sequence in selected]


@pytest.mark.parametrize("config", CONFIGS, ids=str)
@pytest.mark.parametrize("padded", [False, True], ids=["no-mask", "mask"])
def test_outputs_and_gradients_match_the_reference(config, padded):
    """n = 37 is a multiple of no block; gradients of q, k, v and of phi's and the gates' parameters."""
    n = 37
    core = make(**config)
    q, k, v = inputs(3, n)
    mask = holes(n) if padded else None
    weights = torch.randn(3, HEADS, n, DIM_HEAD, dtype=torch.float64)
    fast = core(q, k, v, mask=mask, causal=True)
    tensors = [q, k, v, *core.parameters()]
    fast_grads = torch.autograd.grad((fast * weights).sum(), tensors)
    reference, _ = nsa_reference(core, q, k, v, mask)
    reference_grads = torch.autograd.grad((reference * weights).sum(), tensors)
    torch.testing.assert_close(fast, reference, **TIGHT)
    names = ["q", "k", "v", *(name for name, _ in core.named_parameters())]
    for name, got, want in zip(names, fast_grads, reference_grads, strict=True):
        assert want.abs().max() > 0, f"{name}: the reference gives it no gradient, so the test would prove nothing"
        torch.testing.assert_close(got, want, **TIGHT, msg=lambda m, name=name: f"gradient of {name}: {m}")


@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_selection_equals_the_reference_and_engages(config):
    """The block sets of every (sequence, position) are the reference's, and the top-n really chooses: some query
    takes a block besides the forced ones (initial, own, the one before), and not every query takes the same."""
    n = 48
    core = make(**config)
    q, k, v = inputs(3, n, seed=1)
    mask = holes(n)
    _, reference = nsa_reference(core, q.detach(), k.detach(), v.detach(), mask)
    assert fast_selection(core, q.detach(), k.detach(), v.detach(), mask) == reference
    size, count = core.select_block, core.select_count
    chosen = [s - {0, t // size, t // size - 1} for sequence in reference for t, s in enumerate(sequence)]
    assert any(chosen) and len({frozenset(s) for s in chosen if s}) > 1
    assert max(len(s) for sequence in reference for s in sequence) == count


@pytest.mark.parametrize("branch", BRANCHES)
def test_each_branch_alone_matches_the_reference(branch):
    """With the other two gates at 0, each branch matches the reference, is not causal full attention, and the
    compressed one is zero exactly for the queries before the first complete compression block (t < l - 1)."""
    n = 40
    core = only(make(**CONFIGS[0]), branch)
    q, k, v = inputs(2, n, seed=2)
    fast = core(q, k, v, causal=True)
    reference, _ = nsa_reference(core, q, k, v)
    torch.testing.assert_close(fast, reference, **TIGHT)
    assert (fast - causal_full(q, k, v)).abs().max() > 1e-3
    if branch == "cmp":
        first = core.compress_block - 1
        assert fast[:, :, :first].abs().max() == 0 and fast[:, :, first:].abs().amin(dim=-1).min() > 0


def test_a_compression_block_with_padding_is_left_out():
    """A padded key inside a compression block drops that block: padded content (zeroed by the forward) cannot
    reach a real output through phi, and real outputs do not depend on what padding holds."""
    n = 24
    core = only(make(**CONFIGS[0]), "cmp")
    q, k, v = inputs(1, n, seed=3)
    mask = torch.ones(1, n, dtype=torch.bool)
    mask[0, 9] = False
    out = core(q, k, v, mask=mask, causal=True)
    noisy = [t.detach().clone() for t in (k, v)]
    for t in noisy:
        t[:, :, 9] = 1e3
    again = core(q, *noisy, mask=mask, causal=True)
    torch.testing.assert_close(out, again, **TIGHT)
    keys, _, block_real = core.compressed(k, v, mask)
    expected = [not (i * 2 <= 9 < i * 2 + 4) for i in range(keys.shape[-2])]
    assert block_real[0].tolist() == expected


def test_short_sequences_degenerate_to_causal_full_attention():
    """At n <= w the window branch is causal full attention; at ceil(n / l') <= n_sel every query selects every
    block it sees, so the selected branch is too (module docstring)."""
    n = 20
    options = dict(compress_block=4, compress_stride=2, select_block=4, select_count=5, window=32)
    q, k, v = inputs(2, n, seed=4)
    full = causal_full(q, k, v)
    for branch in ("slc", "win"):
        torch.testing.assert_close(only(make(**options), branch)(q, k, v, causal=True), full, **TIGHT)


@pytest.mark.parametrize("config", CONFIGS, ids=str)
@pytest.mark.parametrize("chunk", [1, 3])
def test_decoding_matches_the_causal_forward(config, chunk):
    """Step by step (chunks of 1 and 3 positions, padding included) equals the forward over the whole sequence."""
    n = 29
    core = make(**config)
    q, k, v = (t.detach() for t in inputs(3, n, seed=5))
    mask = holes(n)
    forward = core(q, k, v, mask=mask, causal=True)
    state = core.start_decoding()
    parts = [slice(s, s + chunk) for s in range(0, n, chunk)]
    steps = [core.decode(q[:, :, p], k[:, :, p], v[:, :, p], state, mask=mask[:, p]) for p in parts]
    real = mask[:, None, :, None]
    torch.testing.assert_close(torch.cat(steps, dim=2) * real, forward * real, **TIGHT)
    assert state.compressed_keys.shape[-2] == (n - core.compress_block) // core.compress_stride + 1


def test_decoding_a_long_prompt_in_one_step():
    """A step longer than the decoding chunk (a prompt) equals the forward too."""
    n = 300
    core = make(compress_block=8, compress_stride=4, select_block=16, select_count=4, window=24)
    q, k, v = (t.detach() for t in inputs(1, n, seed=6))
    state = core.start_decoding()
    first = core.decode(q[:, :, :280], k[:, :, :280], v[:, :, :280], state)
    rest = core.decode(q[:, :, 280:], k[:, :, 280:], v[:, :, 280:], state)
    torch.testing.assert_close(torch.cat([first, rest], dim=2), core(q, k, v, causal=True), **TIGHT)


def test_bidirectional_calls_are_refused():
    core = make(**CONFIGS[0])
    q, k, v = inputs(1, 8)
    with pytest.raises(ValueError, match="causal only"):
        core(q, k, v, causal=False)


def test_the_defaults_are_the_papers():
    """Sec. 4.1: l = 32, d = 16, l' = 64, n = 16 (initial and 2 local blocks included), w = 512."""
    defaults = {name: p.default for name, p in inspect.signature(NativeSparseAttention.__init__).parameters.items()}
    expected = dict(compress_block=32, compress_stride=16, select_block=64, select_count=16, window=512)
    assert {name: defaults[name] for name in expected} == expected


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(select_count=2), "select_count must be an int >= 3"),
        (dict(compress_block=32, compress_stride=12), "compress_stride=12 must divide"),
        (dict(compress_stride=16, select_block=40), "must divide"),
        (dict(window=0), "window must be an int >= 1"),
    ],
)
def test_bad_options_are_refused_in_one_line(options, message):
    with pytest.raises(ValueError, match=message):
        az.create_attention("nsa", dim_head=DIM_HEAD, heads=HEADS, **options)


def test_no_dense_score_matrix():
    """Forward and backward at n = 512 allocate nothing near n x n (the compressed scores are n x n / d)."""
    n = 512
    core = make(compress_block=16, compress_stride=16, select_block=32, select_count=4, window=32).float()
    q, k, v = (t.detach().float().requires_grad_() for t in inputs(1, n, seed=7))
    with LargestOutput() as probe:
        core(q, k, v, mask=pad_mask(torch.tensor([n - 9]), n), causal=True).sum().backward()
    assert probe.elements < n * n / 4
