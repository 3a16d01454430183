"""Decoding caches of the causal cores (``full``, ``local``, ``sparse`` and its aliases, ``linformer_causal``).

The conformance suite checks every cache against the causal forward at 29 positions. Here sequences are
long enough that the sparse caches really drop keys, the expected outputs come from the independent
float64 reference of ``tests/attention_zoo/test_sparse.py`` (the papers' connectivity sets written as loops), and the
size of every state after many steps is checked against the bound its pattern allows, written here from
the pattern's definition.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

import attention_zoo as az
from attention_zoo.full import xformers_available
from tests.attention_zoo.test_sparse import reference_allowed, reference_attention

HEADS, DIM_HEAD = 2, 4
TIGHT = dict(rtol=0.0, atol=1e-10)

PATTERNS = [
    ("local", {"window": 6}),
    ("sparse", {"pattern": "strided", "stride": 5}),
    ("sparse", {"pattern": "fixed", "stride": 6, "summary_columns": 2}),
    ("sparse", {"pattern": "blockwise", "block_size": 7}),
    ("sparse", {"pattern": "longformer", "window": 6, "global_tokens": 3}),
    ("longformer", {"window": 4, "global_tokens": 2}),
    ("bigbird", {"block_size": 3, "random_blocks": 2, "seed": 4}),
    ("bigbird", {"block_size": 4, "random_blocks": 0, "window_blocks": 3}),
    ("bigbird", {"block_size": 3, "global_tokens": 3, "random_blocks": 1, "global_placement": "start"}),
]
IDS = [f"{name}-{'-'.join(map(str, options.values()))}" for name, options in PATTERNS]


pytestmark = pytest.mark.usefixtures("one_thread")


def make(name: str, options: dict) -> az.AttentionCore:
    torch.manual_seed(0)
    return az.create_attention(name, dim_head=DIM_HEAD, heads=HEADS, **options).double().eval()


def inputs(b: int, n: int, seed: int = 0) -> list[Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(b, HEADS, n, DIM_HEAD, generator=generator, dtype=torch.float64) for _ in range(3)]


def padded_mask(n: int) -> Tensor:
    mask = torch.ones(3, n, dtype=torch.bool)
    mask[0, :5] = False  # left padding
    mask[1, n - 9 :] = False  # right padding
    mask[2, 20:26] = False  # a hole
    return mask


def decode_in_chunks(core: az.AttentionCore, q, k, v, mask, chunk: int, state=None) -> Tensor:
    state = core.start_decoding() if state is None else state
    steps = []
    for start in range(0, q.shape[-2], chunk):
        part = slice(start, start + chunk)
        steps.append(core.decode(q[:, :, part], k[:, :, part], v[:, :, part], state, mask=mask[:, part]))
    return torch.cat(steps, dim=-2)


def state_numel(state: az.core.DecodingState) -> int:
    tensors = [t for t in vars(state).values() if isinstance(t, Tensor)]
    return sum(t.numel() for t in tensors)


@pytest.mark.parametrize("chunk", [1, 4])
@pytest.mark.parametrize(("name", "options"), PATTERNS, ids=IDS)
def test_pattern_decoding_equals_the_papers_sets(name, options, chunk):
    """70 positions, padded three ways: every real output equals softmax attention over the pattern's sets
    (written from the papers in tests/attention_zoo/test_sparse.py), though the cache has dropped unreachable keys."""
    n = 70
    q, k, v = inputs(3, n)
    mask = padded_mask(n)
    kind = options.get("pattern", name)
    allowed = reference_allowed(kind, {o: x for o, x in options.items() if o != "pattern"}, n, causal=True)
    expected = reference_attention(q, k, v, allowed[None, None] & mask[:, None, None, :])
    decoded = decode_in_chunks(make(name, options), q, k, v, mask, chunk)
    for b in range(3):
        torch.testing.assert_close(decoded[b][:, mask[b]], expected[b][:, mask[b]], **TIGHT)


def kept_keys(name: str, options: dict, n: int) -> int:
    """How many keys a cache may hold after n positions, from each pattern's definition."""
    kind = options.get("pattern", name)
    if kind == "local":
        return min(n, options["window"] // 2)  # the w/2 keys before the next query
    if kind == "blockwise":
        return n % options["block_size"]  # the current block
    if kind == "fixed":  # the current block and the c summary positions of each finished block
        return n % options["stride"] + options["summary_columns"] * (n // options["stride"])
    if kind == "longformer":  # the g global tokens and the last w/2
        g = options["global_tokens"]
        return n if n < g else g + min(options["window"] // 2, n - g)
    if kind == "bigbird" and options["random_blocks"] == 0:  # the leading g/2 and the window blocks
        b = options["block_size"]
        lead = options.get("global_tokens", 2 * b) // 2
        return n if n < lead else lead + n - max(lead, (n // b - options["window_blocks"] // 2) * b)
    return n  # strided, bigbird with random blocks: a later query may reach any earlier key


def bound(name: str, options: dict) -> int | None:
    """The most keys a bounded pattern's cache ever holds (None: it grows with the length)."""
    kind = options.get("pattern", name)
    if kind == "local":
        return options["window"] // 2
    if kind == "blockwise":
        return options["block_size"] - 1
    if kind == "longformer":
        return options["global_tokens"] + options["window"] // 2
    if kind == "bigbird" and options["random_blocks"] == 0:
        b = options["block_size"]
        return options.get("global_tokens", 2 * b) // 2 + (options["window_blocks"] // 2 + 1) * b
    return None


@pytest.mark.parametrize(("name", "options"), PATTERNS, ids=IDS)
def test_pattern_cache_holds_only_reachable_keys(name, options):
    """After every step the cache holds exactly the keys its pattern can still reach; for the bounded
    patterns that is at most the stated bound, and the allocated state stops growing (the same number of
    elements after n / 2 and n steps)."""
    n = 120
    core = make(name, options)
    q, k, v = inputs(2, n)
    state = core.start_decoding()
    sizes = {}
    for position in range(n):
        one = slice(position, position + 1)
        core.decode(q[:, :, one], k[:, :, one], v[:, :, one], state)
        assert state.size == kept_keys(name, options, position + 1), f"after {position + 1} positions"
        sizes[position + 1] = state_numel(state)
    limit = bound(name, options)
    if limit is not None:
        assert max(kept_keys(name, options, m) for m in range(1, n + 1)) <= limit
        assert sizes[n] == sizes[n // 2], "a bounded cache must not grow"
    else:
        assert state.size > n // 4, "a pattern with no bound keeps a share of every position"


def test_local_cache_is_w_over_2_keys_whatever_the_length():
    core = make("local", {"window": 8})
    q, k, v = inputs(1, 100)
    state = core.start_decoding()
    for position in range(100):
        one = slice(position, position + 1)
        core.decode(q[:, :, one], k[:, :, one], v[:, :, one], state)
    assert state.size == 4
    assert state.keys.shape[2] <= 16, "capacity stays that of the first allocation"
    torch.testing.assert_close(state.keys[:, :, :4], k[:, :, -4:], rtol=0, atol=0)


def test_full_cache_grows_by_doubling():
    """Keys and values of every position, in buffers reallocated O(log n) times, never once per step."""
    core = make("full", {"backend": "math"})
    n = 100
    q, k, v = inputs(2, n)
    state = core.start_decoding()
    buffers = set()
    for position in range(n):
        one = slice(position, position + 1)
        core.decode(q[:, :, one], k[:, :, one], v[:, :, one], state)
        buffers.add(state.keys.data_ptr())
    assert state.size == n and n <= state.keys.shape[2] < 2 * n + 2
    assert len(buffers) <= 4, f"{len(buffers)} allocations over {n} steps"  # 16, 34, 70, 142 slots
    torch.testing.assert_close(state.keys[:, :, :n], k, rtol=0, atol=0)


@pytest.mark.parametrize("backend", ["math", "sdpa", "auto"])
@pytest.mark.parametrize("chunk", [1, 5])
def test_full_decoding_on_every_backend(backend, chunk):
    n = 40
    q, k, v = inputs(3, n)
    mask = padded_mask(n)
    expected = reference_attention(q, k, v, torch.ones(n, n, dtype=torch.bool).tril() & mask[:, None, None, :])
    decoded = decode_in_chunks(make("full", {"backend": backend}), q, k, v, mask, chunk)
    for b in range(3):
        torch.testing.assert_close(decoded[b][:, mask[b]], expected[b][:, mask[b]], **TIGHT)


@pytest.mark.skipif(not (torch.cuda.is_available() and xformers_available()), reason="xformers needs CUDA")
def test_full_decoding_with_xformers_on_cuda():
    n = 40
    q, k, v = (t.float().cuda() for t in inputs(3, n))
    mask = padded_mask(n).cuda()
    core = az.create_attention("full", dim_head=DIM_HEAD, heads=HEADS, backend="xformers").cuda()
    expected = core(q, k, v, mask=mask, causal=True)
    decoded = decode_in_chunks(core, q, k, v, mask, 3)
    for b in range(3):
        torch.testing.assert_close(decoded[b][:, mask[b]], expected[b][:, mask[b]], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("projection", ["linear", "mean_pool", "max_pool"])
@pytest.mark.parametrize("chunk", [1, 3])
def test_linformer_causal_caches_the_block_and_the_summaries(projection, chunk):
    """Outputs equal the causal forward over 45 positions (several finished blocks, a partial last one), and
    after n positions the state holds n mod c exact keys and floor(n / c) k_c summaries."""
    c, k_c, n = 8, 2, 45
    core = make("linformer_causal", {"block_size": c, "block_k": k_c, "projection": projection})
    q, k, v = inputs(3, n)
    mask = padded_mask(n)
    expected = core(q, k, v, mask=mask, causal=True)
    state = core.start_decoding()
    decoded = decode_in_chunks(core, q, k, v, mask, chunk, state)
    for b in range(3):
        torch.testing.assert_close(decoded[b][:, mask[b]], expected[b][:, mask[b]], **TIGHT)
    assert state.block_keys.shape[2] == n % c
    assert state.summary_keys.shape[2] >= (n // c) * k_c and state.summary_slots[:, : (n // c) * k_c].any()
    state = core.start_decoding()
    decode_in_chunks(core, q[:, :, :40], k[:, :, :40], v[:, :, :40], mask[:, :40], chunk, state)
    assert state.block_keys is None, "a finished block leaves only its summaries"


@pytest.mark.parametrize(("name", "options"), [("full", {"backend": "sdpa"}), *PATTERNS[:2], PATTERNS[6]])
def test_reordered_state_continues_the_reordered_batch_after_keys_were_dropped(name, options):
    core = make(name, options)
    q, k, v = inputs(3, 50)
    state = core.start_decoding()
    core.decode(q[:, :, :37], k[:, :, :37], v[:, :, :37], state)
    index = torch.tensor([1, 1, 0, 2])
    state.reorder(index)
    out = core.decode(q[index, :, 37:], k[index, :, 37:], v[index, :, 37:], state)
    torch.testing.assert_close(out, core(q[index], k[index], v[index], causal=True)[:, :, 37:], **TIGHT)


@pytest.mark.parametrize("leaves", ["qkv", "q"])
@pytest.mark.parametrize(
    ("name", "options"),
    [("full", {"backend": "math"}), PATTERNS[0], PATTERNS[2], ("linformer_causal", {"block_size": 8, "block_k": 2})],
)
def test_decoding_under_autograd_gives_the_forward_gradients(name, options, leaves):
    """Once a step builds a graph the caches stop writing in place (a buffer saved for a backward is never
    overwritten, even when only q needs a gradient), so a backward through many steps equals the backward
    of the causal forward, parameters included."""
    n = 30
    grads = []
    for decode in (False, True):
        core = make(name, options)
        q, k, v = inputs(2, n)
        for t, leaf in zip((q, k, v), "qkv", strict=True):
            t.requires_grad_(leaf in leaves)
        mask = torch.ones(2, n, dtype=torch.bool)
        out = decode_in_chunks(core, q, k, v, mask, 4) if decode else core(q, k, v, causal=True)
        (out * inputs(2, n, seed=9)[0]).sum().backward()
        grads.append([t.grad for t in (q, k, v) if t.grad is not None] + [p.grad for p in core.parameters()])
    assert len(grads[1]) == len(grads[0]) == len(leaves) + len(list(make(name, options).parameters()))
    for decoded, forward in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(decoded, forward, **TIGHT)


def test_half_precision_decoding_is_computed_in_float32():
    core = make("bigbird", {"block_size": 4, "random_blocks": 1}).float()
    q, k, v = (t.float() for t in inputs(2, 40))
    mask = torch.ones(2, 40, dtype=torch.bool)
    expected = core(q, k, v, causal=True)
    decoded = decode_in_chunks(core, q.bfloat16(), k.bfloat16(), v.bfloat16(), mask, 3)
    assert decoded.dtype == torch.bfloat16
    torch.testing.assert_close(decoded.float(), expected, rtol=0.0, atol=3e-2)  # bf16 inputs: 8-bit mantissa


def test_every_causal_core_of_this_file_declares_its_cache():
    for name in ("full", "local", "sparse", "longformer", "bigbird", "linformer_causal"):
        assert az.get_attention_class(name).has_decoding_cache, name
