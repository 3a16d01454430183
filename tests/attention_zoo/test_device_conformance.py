"""The conformance suite's numerical core on any device and in low precision.

Every registered mechanism, with each of its ``example_configs`` (``tests.attention_zoo.registry_cases.cases()``),
runs on the device named by the environment variable ``ZOO_TEST_DEVICE`` (``cpu``, the default, or ``cuda``) in float32,
bfloat16 and float16, at two lengths, non-causal and (where the core supports it) causal, and is compared with a
float64 reference run **on the same device**:

- ``test_forward``: the output is finite, of the input's shape and dtype, and within a relative error
  ``||out - ref|| / ||ref||`` (computed in float64) of :data:`FORWARD_TOLERANCE`;
- ``test_forward_with_padding_mask``: the same with a key padding mask (``(B, N)`` bool, True = real token; one
  batch element padded), compared at the real query positions, where the core supports masks;
- ``test_backward``: the gradients of q, k, v (q, v for a shared-QK core) and of every parameter, for one fixed
  random output gradient (zero at padded query positions), with the padding mask where the core supports it,
  within :data:`BACKWARD_TOLERANCE`;
- ``test_packed_forward_and_backward``: packed rows (``segments``) against the float64 reference on each document
  alone, output and gradients.

The reference is the low-precision core and inputs themselves, cast back to float64 (``copy.deepcopy(core)
.double()`` and ``q.double()``): both runs see bit-identical parameters, buffers and inputs, so the measured
error is that of the arithmetic, not of rounding the inputs to the low-precision format. No core draws random
numbers per call from the global generator: Performer's features, LSH's rotations and BigBird's random blocks come
from private ``torch.Generator`` s seeded by the core's options, drawn in float64 on the CPU and then cast to the
input's dtype and device, and Linformer's ``random`` projection is a buffer drawn once at build time (copied with
the core). So the reference draws exactly what the low-precision run draws, on any device. Discrete choices made
from computed values (LSH's bucket argmax, MoBA's top-k block routing) can still flip where the low-precision
scores nearly tie; that is a real property of running such a core in low precision, and shows up here as error.

Sizes are the conformance suite's (``HEADS = 2``, ``DIM_HEAD = 8``, ``max_seq_len = 64``), batch 2, n = 32 and 64,
every example config in every dtype (about 25 s on 2 CPU cores, one thread). With a head dim of 8 the sparse core's
``impl="auto"`` takes its blocked path on CUDA too (FlexAttention's compiled kernel needs ``dim_head >= 16``).

Every test prints its measured relative error, so
``python3 -m pytest -q tests/attention_zoo/test_device_conformance.py -rA`` lists them all (the PASSES section),
and a failure's message carries it too. On the GPU machine::

    ZOO_TEST_DEVICE=cuda python3 -m pytest -q tests/attention_zoo/test_device_conformance.py

A case skips, naming the torch error, only where torch itself lacks a CPU kernel for bfloat16 or float16 (a
``... not implemented for 'BFloat16'`` error); nothing is skipped silently and nothing is marked xfail.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from torch import Tensor

import attention_zoo as az
from attention_zoo.masks import pad_mask
from tests.attention_zoo.registry_cases import as_function, build, case_id, cases, qkv, skip_unless_takes

_DEVICE_NAME = os.environ.get("ZOO_TEST_DEVICE", "cpu")
if _DEVICE_NAME not in ("cpu", "cuda"):
    raise pytest.UsageError(f"ZOO_TEST_DEVICE must be 'cpu' or 'cuda', got {_DEVICE_NAME!r}")
if _DEVICE_NAME == "cuda" and not torch.cuda.is_available():
    pytest.skip("ZOO_TEST_DEVICE=cuda but torch.cuda.is_available() is False", allow_module_level=True)
DEVICE = torch.device(_DEVICE_NAME)

CASES = cases()
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
LENGTHS = (32, 64)
BATCH = 2

#: forward relative error bounds. float32 (unit roundoff 2^-24 ~ 6e-8): 1e-4 leaves room for sums over a few
#: dozen keys and the approximations' own iterations (Nystrom's pseudo-inverse) on the CPU; on CUDA 2e-3, since
#: convolutions (Nystrom's, Linformer's conv projection) may run in TF32 (10 mantissa bits, ~1e-3 roundoff).
#: bfloat16 has 8 mantissa bits (unit roundoff 2^-8 ~ 3.9e-3) and float16 11 (2^-11 ~ 4.9e-4); the errors of the
#: score products, softmax normalizers and value sums accumulate to a few times that.
FORWARD_TOLERANCE = {
    torch.float32: 1e-4 if DEVICE.type == "cpu" else 2e-3,
    torch.bfloat16: 3e-2,
    torch.float16: 5e-3,
}
#: gradient bounds: backward multiplies the forward's errors by the softmax Jacobian and sums again over positions
BACKWARD_TOLERANCE = {
    torch.float32: 10 * FORWARD_TOLERANCE[torch.float32],
    torch.bfloat16: 5e-2,
    torch.float16: 1e-2,
}

pytestmark = pytest.mark.usefixtures("one_thread")


def supports(name: str, capability: str) -> bool:
    return getattr(az.get_attention_class(name), capability)


@pytest.fixture(params=CASES, ids=[case_id(c) for c in CASES])
def case(request):
    return request.param


def relative_error(out: Tensor, ref: Tensor) -> float:
    """``||out - ref|| / ||ref||`` in float64 (0 when both are 0, inf when only ``ref`` is)."""
    diff = (out.double() - ref).norm().item()
    scale = ref.norm().item()
    if scale == 0.0:
        return 0.0 if diff == 0.0 else float("inf")
    return diff / scale


def cores(name: str, options: dict, dtype: torch.dtype) -> tuple[az.AttentionCore, az.AttentionCore]:
    """The core in ``dtype`` on the device, and its float64 reference: the same core cast back, so both hold the
    very same parameters and buffers."""
    core = build(name, options).to(DEVICE, dtype)
    return core, copy.deepcopy(core).double()


def inputs(core: az.AttentionCore, n: int, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    return tuple(t.to(DEVICE, dtype) for t in qkv(core, BATCH, n))


def padding(n: int) -> Tensor:
    """(B, N) bool, True = real token: the second batch element has its last quarter padded."""
    return pad_mask(torch.tensor([n, n - n // 4]), n).to(DEVICE)


def skip_for_missing_low_precision_kernel(error: Exception, dtype: torch.dtype) -> None:
    """Skip, naming the torch error, where torch has no CPU kernel for ``dtype``; otherwise return (the caller
    re-raises)."""
    if DEVICE.type == "cpu" and dtype != torch.float32 and "not implemented for" in str(error):
        pytest.skip(f"torch {torch.__version__} has no CPU {dtype} kernel: {str(error).splitlines()[0]}")


def report(label: str, errors: dict[str, float], tolerance: float) -> str:
    worst = max(errors, key=errors.get)
    text = f"{label}: max relative error {errors[worst]:.3e} ({worst}; tolerance {tolerance:.0e})"
    if len(errors) > 1:
        text += " [" + ", ".join(f"{key} {value:.2e}" for key, value in errors.items()) + "]"
    print(text)
    return text


def check_forward(case, dtype: torch.dtype, n: int, causal: bool, *, masked: bool) -> None:
    name, options = case
    skip_unless_takes(name, causal)
    if masked and not supports(name, "supports_mask"):
        pytest.skip(f"{name} does not support a padding mask")
    core, reference = cores(name, options, dtype)
    q, k, v = inputs(core, n, dtype)
    mask = padding(n) if masked else None
    try:
        with torch.no_grad():
            out = core(q, k, v, mask=mask, causal=causal)
    except (RuntimeError, NotImplementedError) as error:
        skip_for_missing_low_precision_kernel(error, dtype)
        raise
    with torch.no_grad():
        ref = reference(q.double(), k.double(), v.double(), mask=mask, causal=causal)
    assert out.shape == q.shape and out.dtype == dtype and out.device.type == DEVICE.type
    if masked:  # the contract covers the real query positions only
        real = mask[:, None, :, None].expand_as(ref)
        out, ref = out[real], ref[real]
    label = f"{case_id(case)} {str(dtype).removeprefix('torch.')} n={n} causal={causal} masked={masked} forward"
    tolerance = FORWARD_TOLERANCE[dtype]
    text = report(label, {"out": relative_error(out, ref)}, tolerance)
    bad = (~torch.isfinite(out)).sum().item()
    assert bad == 0, f"{label}: {bad} non-finite outputs of {out.numel()}; {text}"
    assert relative_error(out, ref) <= tolerance, text


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("n", LENGTHS, ids=[f"n={n}" for n in LENGTHS])
@pytest.mark.parametrize("dtype", DTYPES, ids=[str(d).removeprefix("torch.") for d in DTYPES])
def test_forward(case, dtype, n, causal):
    check_forward(case, dtype, n, causal, masked=False)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("n", LENGTHS, ids=[f"n={n}" for n in LENGTHS])
@pytest.mark.parametrize("dtype", DTYPES, ids=[str(d).removeprefix("torch.") for d in DTYPES])
def test_forward_with_padding_mask(case, dtype, n, causal):
    check_forward(case, dtype, n, causal, masked=True)


def gradients(
    core: az.AttentionCore, q: Tensor, k: Tensor, v: Tensor, grad_out: Tensor, *, mask: Tensor | None, causal: bool
) -> dict[str, Tensor]:
    core.zero_grad(set_to_none=True)
    attention, leaves = as_function(core, q, k, v, mask=mask, causal=causal)
    attention(*leaves).backward(grad_out)
    names = ("q", "v") if core.needs_shared_qk else ("q", "k", "v")
    grads = {f"d{name}": leaf.grad for name, leaf in zip(names, leaves, strict=True)}
    grads.update({f"d[{pname}]": p.grad for pname, p in core.named_parameters()})
    return grads


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("n", LENGTHS, ids=[f"n={n}" for n in LENGTHS])
@pytest.mark.parametrize("dtype", DTYPES, ids=[str(d).removeprefix("torch.") for d in DTYPES])
def test_backward(case, dtype, n, causal):
    name, options = case
    skip_unless_takes(name, causal)
    core, reference = cores(name, options, dtype)
    q, k, v = inputs(core, n, dtype)
    mask = padding(n) if supports(name, "supports_mask") else None
    generator = torch.Generator().manual_seed(2)
    grad_out = torch.randn(q.shape, generator=generator, dtype=torch.float64).to(DEVICE, dtype)
    if mask is not None:
        grad_out = grad_out * mask[:, None, :, None]  # padded query positions' outputs are outside the contract
    try:
        grads = gradients(core, q, k, v, grad_out, mask=mask, causal=causal)
    except (RuntimeError, NotImplementedError) as error:
        skip_for_missing_low_precision_kernel(error, dtype)
        raise
    ref = gradients(reference, q.double(), k.double(), v.double(), grad_out.double(), mask=mask, causal=causal)
    label = f"{case_id(case)} {str(dtype).removeprefix('torch.')} n={n} causal={causal} masked={mask is not None}"
    label += " backward"
    missing = sorted(key for key, g in grads.items() if g is None)
    assert not missing, f"{label}: no gradient for {', '.join(missing)}"
    tolerance = BACKWARD_TOLERANCE[dtype]
    errors = {key: relative_error(g, ref[key]) for key, g in grads.items()}
    text = report(label, errors, tolerance)
    bad = sorted(key for key, g in grads.items() if not torch.isfinite(g).all())
    assert not bad, f"{label}: non-finite gradient for {', '.join(bad)}; {text}"
    for key, g in grads.items():
        assert g.dtype == dtype, f"{label}: gradient {key} is {g.dtype}"
    assert max(errors.values()) <= tolerance, text


#: per row: documents of length 1, shorter than a block or window, filling the row, and padding after the last
PACKED_LENGTHS = ((1, 7, 3, 20), (9, 23), (5, 5, 1, 12))


def alone_reference(reference: az.AttentionCore, q: Tensor, k: Tensor, v: Tensor, causal: bool) -> Tensor:
    """The float64 reference core applied to each document of :data:`PACKED_LENGTHS` alone, stitched back into the
    packed layout (padding 0): what the packed contract (attention_zoo.packing) says a packed call gives."""
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    for row, lengths in enumerate(PACKED_LENGTHS):
        start = 0
        for length in lengths:
            span = (slice(row, row + 1), slice(None), slice(start, start + length))
            out[span] = reference(q[span].double(), k[span].double(), v[span].double(), causal=causal)
            start += length
    return out


def packed_inputs(core: az.AttentionCore, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    from attention_zoo.packing import segments_from_lengths

    n = 32
    q, k, v = (t.to(DEVICE, dtype) for t in qkv(core, len(PACKED_LENGTHS), n))
    return q, k, v, segments_from_lengths(PACKED_LENGTHS, n, device=DEVICE)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=[str(d).removeprefix("torch.") for d in DTYPES])
def test_packed_forward_and_backward(case, dtype, causal):
    """Packed rows (``segments``) on the device in ``dtype`` against the float64 reference on each document alone:
    forward and the gradients of q, k, v, within the tolerances above."""
    name, options = case
    skip_unless_takes(name, causal)
    core, reference = cores(name, options, dtype)
    q, k, v, segments = packed_inputs(core, dtype)
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64).to(DEVICE, dtype)
    leaves = tuple(t.detach().requires_grad_(True) for t in ((q, v) if core.needs_shared_qk else (q, k, v)))
    lq, lk, lv = (leaves[0], leaves[0], leaves[1]) if core.needs_shared_qk else leaves
    try:
        out = core(lq, lk, lv, segments=segments, causal=causal)
        out.backward(grad_out)
    except (RuntimeError, NotImplementedError) as error:
        skip_for_missing_low_precision_kernel(error, dtype)
        raise
    ref_leaves = tuple(t.detach().double().requires_grad_(True) for t in leaves)
    rq, rk, rv = (ref_leaves[0], ref_leaves[0], ref_leaves[1]) if core.needs_shared_qk else ref_leaves
    ref = alone_reference(reference, rq, rk, rv, causal)
    ref.backward(grad_out.double())
    label = f"{case_id(case)} {str(dtype).removeprefix('torch.')} causal={causal} packed"
    names = ("q", "v") if core.needs_shared_qk else ("q", "k", "v")
    errors = {"out": relative_error(out.detach(), ref.detach())}
    errors |= {f"d{n}": relative_error(a.grad, b.grad) for n, a, b in zip(names, leaves, ref_leaves, strict=True)}
    tolerance = BACKWARD_TOLERANCE[dtype]
    text = report(label, errors, tolerance)
    assert errors["out"] <= FORWARD_TOLERANCE[dtype], text
    assert max(errors.values()) <= tolerance, text
