"""Linformer (``linformer``) and its blockwise causal variant (``linformer_causal``) against float64
references written out by hand; the shared conformance suite covers the rest."""

from __future__ import annotations

import math

import pytest
import torch

import attention_zoo as az
from attention_zoo.masks import pad_mask

TIGHT = dict(rtol=0.0, atol=1e-12)  # float64, same arithmetic up to summation order


def random_qkv(b: int, h: int, n: int, d: int, *, nk: int | None = None, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    nk = n if nk is None else nk
    shapes = [(b, h, n, d), (b, h, nk, d), (b, h, nk, d)]
    return [torch.randn(s, generator=generator, dtype=torch.float64) for s in shapes]


def linformer(n: int = 64, heads: int = 2, dim_head: int = 8, **options) -> az.AttentionCore:
    torch.manual_seed(0)
    return az.create_attention("linformer", dim_head=dim_head, heads=heads, max_seq_len=n, **options).double()


def full_attention(q, k, v, mask=None, causal=False):
    return az.create_attention("full", dim_head=q.shape[-1], heads=q.shape[1], backend="math")(
        q, k, v, mask=mask, causal=causal
    )


def sliced_reference(q, k, v, key_matrix, value_matrix, mask=None):
    """Eq. (7) with E, F sliced to the m = Nk columns the input has, padded keys/values zeroed."""
    m, d = k.shape[-2], q.shape[-1]
    if mask is not None:
        k, v = k * mask[:, None, :, None], v * mask[:, None, :, None]
    E, F = key_matrix[..., :m], value_matrix[..., :m]
    per_head = "hrj,bhjd->bhrd" if E.ndim == 3 else "rj,bhjd->bhrd"
    projected_k, projected_v = torch.einsum(per_head, E, k), torch.einsum(per_head, F, v)
    probs = (q @ projected_k.transpose(-1, -2) / math.sqrt(d)).softmax(-1)
    return probs @ projected_v


# ---- sharing: the paper's parameter counts --------------------------------------------------------------


def added_parameters(model: type, slot: str, options: dict, depth: int) -> int:
    """Parameters a 12-head ``model`` gains from Linformer in ``slot`` (``attention`` or ``cross_attention``):
    the model with it minus the one with full."""

    def count(spec: str | az.AttentionSpec) -> int:
        sizes = dict(vocab_size=11, dim=24, depth=depth, heads=12, dim_head=2, max_seq_len=16)
        config = az.ModelConfig(**sizes, **{slot: spec})
        return sum(p.numel() for p in model(config).parameters())

    return count(az.AttentionSpec("linformer", options)) - count("full")


def projection_parameters(sharing: str, projection: str = "linear", k: int | list[int] = 4, depth: int = 12) -> int:
    """Parameters a 12-head encoder gains from Linformer."""
    options = {"k": k, "sharing": sharing, "projection": projection}
    return added_parameters(az.TransformerEncoder, "attention", options, depth)


@pytest.mark.parametrize(("sharing", "matrices"), [("none", 288), ("headwise", 24), ("kv", 12), ("layerwise", 1)])
def test_parameter_counts_follow_section_4(sharing, matrices):
    # 12 layers x 12 heads, n = 16, k = 4: each distinct E or F is k x n = 64 parameters
    assert projection_parameters(sharing) == matrices * 4 * 16
    # a learned convolution has one kernel of n / k = 4 taps per distinct matrix
    assert projection_parameters(sharing, "conv") == matrices * 4


def cross_projection_parameters(options: dict, depth: int = 12) -> int:
    """Parameters a 12-head decoder gains from Linformer cross-attention."""
    return added_parameters(az.TransformerDecoder, "cross_attention", options, depth)


@pytest.mark.parametrize(("sharing", "matrices"), [("none", 288), ("headwise", 24), ("kv", 12), ("layerwise", 1)])
def test_decoder_cross_attention_shares_across_layers_as_the_encoder_does(sharing, matrices):
    """The decoder builds its cross-attention cores with its own shared state and layer indices: layerwise is
    one E for every layer (it was one per layer), a per-layer k is one entry per layer (it was refused)."""
    assert cross_projection_parameters({"k": 4, "sharing": sharing}) == matrices * 4 * 16
    assert cross_projection_parameters({"k": [8, 4], "sharing": "headwise"}, depth=2) == 2 * (8 + 4) * 16
    decoder = az.TransformerDecoder(az.ModelConfig(
        vocab_size=11, dim=16, depth=2, heads=2, max_seq_len=16,
        attention="linformer_causal:block_size=8,block_k=2,sharing=layerwise",
        cross_attention="linformer:k=4,sharing=layerwise",
    ))  # fmt: skip
    cross = [layer.cross_attn.core.key_projection for layer in decoder.layers]
    own = [layer.self_attn.core.key_projection for layer in decoder.layers]
    assert cross[0] is cross[1] and own[0] is own[1] and cross[0] is not own[0]  # two states, no collision


def test_decoder_cross_attention_performer_draws_other_features_in_every_layer():
    config = az.ModelConfig(vocab_size=11, dim=16, depth=2, heads=2, max_seq_len=16, cross_attention="performer")
    decoder = az.TransformerDecoder(config)
    first, second = (layer.cross_attn.core.projection(torch.device("cpu"), torch.float32) for layer in decoder.layers)
    assert not torch.equal(first, second)


def test_parameter_free_projections_add_no_parameters():
    assert projection_parameters("none", "mean_pool") == projection_parameters("none", "max_pool") == 0
    assert projection_parameters("none", "random") == 0  # R is a buffer: fixed, never trained


def test_layerwise_sharing_is_one_tensor_for_every_layer_and_both_sides():
    model = az.TransformerEncoder(az.ModelConfig(
        vocab_size=11, dim=16, depth=3, heads=2, max_seq_len=16, attention="linformer:k=4,sharing=layerwise"
    ))  # fmt: skip
    cores = [layer.attn.core for layer in model.layers]
    weights = {id(c.key_projection.weight) for c in cores} | {id(c.value_projection.weight) for c in cores}
    assert len(weights) == 1
    assert model.shared_attention_state["linformer_E"] is cores[0].key_projection
    model(torch.randint(0, 11, (2, 16))).sum().backward()
    assert cores[0].key_projection.weight.grad.abs().sum() > 0


def test_kv_sharing_uses_one_matrix_for_keys_and_values():
    core = linformer(k=8, sharing="kv")
    assert core.key_projection is core.value_projection
    core = linformer(k=8, sharing="headwise")
    assert core.key_projection.weight is not core.value_projection.weight


def test_nonuniform_k_per_layer():
    assert projection_parameters("headwise", k=[8, 4], depth=2) == 2 * (8 + 4) * 16
    model = az.TransformerEncoder(az.ModelConfig(
        vocab_size=11, dim=16, depth=3, heads=2, max_seq_len=16,
        attention=az.AttentionSpec("linformer", {"k": [8, 8, 2], "sharing": "kv"}),
    ))  # fmt: skip
    assert [layer.attn.core.key_projection.weight.shape[0] for layer in model.layers] == [8, 8, 2]
    assert model(torch.randint(0, 11, (2, 13))).shape == (2, 13, 16)


def test_learned_projections_use_the_documented_init():
    core = linformer(n=64, k=16, sharing="none", projection="linear")
    bound = math.sqrt(3 / (64 + 16))  # Xavier-uniform, gain 1/sqrt(2)
    weight = core.key_projection.weight
    assert weight.shape == (2, 16, 64) and weight.abs().max() <= bound
    assert weight.std().item() == pytest.approx(bound / math.sqrt(3), rel=0.1)


def test_random_projection_is_a_fixed_reproducible_jl_matrix():
    core = linformer(n=512, k=64, projection="random", sharing="kv")
    R = core.key_projection.weight
    assert not R.requires_grad and list(core.parameters()) == [] and "key_projection.weight" in core.state_dict()
    assert R.var().item() == pytest.approx(1 / 64, rel=0.05)  # N(0, 1/k), 32768 draws
    assert torch.equal(linformer(n=512, k=64, projection="random", sharing="kv").key_projection.weight, R)


# ---- the maths -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("projection", ["mean_pool", "max_pool"])
@pytest.mark.parametrize(("n", "masked"), [(24, False), (24, True), (15, True)])
def test_identity_projection_is_full_attention(projection, n, masked):
    """k = max_seq_len makes every window one position: E = F = I, so eq. (7) is eq. (2)."""
    core = linformer(n=24, k=24, projection=projection)
    q, k, v = random_qkv(3, 2, n, 8)
    mask = pad_mask(torch.tensor([n, n - 4, 0]), n) if masked else None
    torch.testing.assert_close(core(q, k, v, mask=mask), full_attention(q, k, v, mask), **TIGHT)


@pytest.mark.parametrize("sharing", ["none", "headwise", "kv", "layerwise"])
@pytest.mark.parametrize("projection", ["linear", "random"])
def test_shorter_inputs_use_the_first_columns_of_E_and_F(sharing, projection):
    core = linformer(n=64, k=8, sharing=sharing, projection=projection)
    E, F = core.key_projection.weight, core.value_projection.weight
    q, k, v = random_qkv(2, 2, 40, 8)
    mask = pad_mask(torch.tensor([40, 31]), 40)
    torch.testing.assert_close(core(q, k, v, mask=mask), sliced_reference(q, k, v, E, F, mask), **TIGHT)
    # the same as a core built for length 40 holding the sliced matrices
    short = linformer(n=40, k=8, sharing=sharing, projection=projection)
    with torch.no_grad():
        short.key_projection.weight.copy_(E[..., :40])
        short.value_projection.weight.copy_(F[..., :40])
    torch.testing.assert_close(short(q, k, v, mask=mask), core(q, k, v, mask=mask), **TIGHT)


def test_cross_attention_projects_the_keys_only():
    core = linformer(n=64, k=8, sharing="none")
    q, k, v = random_qkv(2, 2, 24, 8, nk=40)
    reference = sliced_reference(q, k, v, core.key_projection.weight, core.value_projection.weight)
    torch.testing.assert_close(core(q, k, v), reference, **TIGHT)


def window_reference(x, real, s, kind, kernel=None):
    """Pool (B, H, m, D) over the windows [r s, (r + 1) s) restricted to real positions < m, by a loop;
    returns the pooled rows and which windows hold a real token."""
    b, h, m, d = x.shape
    windows = -(-m // s)
    out = torch.zeros(b, h, windows, d, dtype=x.dtype)
    valid = torch.zeros(b, windows, dtype=torch.bool)
    for bi in range(b):
        for r in range(windows):
            taps = [t for t in range(s) if r * s + t < m and real[bi, r * s + t]]
            if not taps:
                continue
            valid[bi, r] = True
            rows = x[bi, :, [r * s + t for t in taps]]
            if kind == "mean_pool":
                out[bi, :, r] = rows.mean(1)
            elif kind == "max_pool":
                out[bi, :, r] = rows.amax(1)
            else:
                out[bi, :, r] = torch.einsum("hsd,hs->hd", rows, kernel[:, taps])
    return out, valid


@pytest.mark.parametrize("projection", ["mean_pool", "max_pool", "conv"])
def test_windowed_projections_pool_real_positions_of_the_max_seq_len_grid(projection):
    """max_seq_len 64, k 8: windows of 8 positions; a 29-token input has 4 windows, the last partial."""
    core = linformer(n=64, k=8, projection=projection, sharing="none")
    q, k, v = random_qkv(3, 2, 29, 8)
    real = pad_mask(torch.tensor([29, 20, 0]), 29)
    real[0, 8:16] = False  # an interior window of padding only
    kernel = core.key_projection.weight if projection == "conv" else None
    keys, valid = window_reference(k, real, 8, projection, kernel)
    kernel = core.value_projection.weight if projection == "conv" else None
    values, _ = window_reference(v, real, 8, projection, kernel)
    allowed = valid | ~valid.any(-1, keepdim=True)
    scores = (q @ keys.transpose(-1, -2) / math.sqrt(8)).masked_fill(~allowed[:, None, None, :], -math.inf)
    torch.testing.assert_close(core(q, k, v, mask=real), scores.softmax(-1) @ values, **TIGHT)


@pytest.mark.parametrize("projection", ["linear", "mean_pool", "max_pool", "conv", "random"])
def test_right_padding_gives_the_outputs_of_the_unpadded_input(projection):
    """Padded positions add nothing to a projected key, and slots that only saw padding are dropped."""
    core = linformer(n=64, k=8, projection=projection)
    q, k, v = random_qkv(1, 2, 40, 8)
    padded = core(q, k, v, mask=pad_mask(torch.tensor([21]), 40))[:, :, :21]
    torch.testing.assert_close(padded, core(q[:, :, :21], k[:, :, :21], v[:, :, :21]), rtol=0, atol=1e-10)


def test_theorem_1_error_falls_as_one_over_sqrt_k():
    """P R^T R V approximates P V (eqs. 5, 16) with the module's own R ~ N(0, 1/k), n = 512, float64.

    Measured: ||P R^T R V - P V|| / ||P V|| is ~5-7 at k = 16 and ~1.2-1.5 at k = 256: the 1/sqrt(k)
    rate holds, but relative to ||P w|| the constant is ~sqrt(n) for diffuse softmax rows and zero-mean
    values. The JL lemma (12) bounds the error relative to ||u|| ||w|| instead, and that error is
    ~1/sqrt(k) with a constant ~1, which is checked too.
    """
    n, d, ks, seeds = 512, 16, (16, 64, 256), range(5)
    relative, jl_scaled = {k: [] for k in ks}, {k: [] for k in ks}
    for seed in seeds:
        q, key, v = (t[0, 0] for t in random_qkv(1, 1, n, d, seed=seed))
        P = (q @ key.T / math.sqrt(d)).softmax(-1)
        exact = P @ v
        for k in ks:
            torch.manual_seed(seed)
            R = linformer(n=n, k=k, heads=1, dim_head=d, projection="random", sharing="kv").key_projection.weight
            error = P @ R.T @ (R @ v) - exact
            relative[k].append((error.norm() / exact.norm()).item())
            per_entry = error / (P.norm(dim=1, keepdim=True) * v.norm(dim=0, keepdim=True))
            jl_scaled[k].append(per_entry.pow(2).mean().sqrt().item() * math.sqrt(k))
    mean = {k: sum(e) / len(e) for k, e in relative.items()}
    for small, large in zip(ks, ks[1:], strict=False):
        assert 1.6 < mean[small] / mean[large] < 2.5, mean  # 4x larger k: error / 2 (1/sqrt(k))
    for k in ks:
        assert 0.7 < sum(jl_scaled[k]) / len(seeds) < 1.4, jl_scaled


# ---- errors ----------------------------------------------------------------------------------------------


def test_errors_are_clear():
    q, k, v = random_qkv(1, 2, 16, 8)
    with pytest.raises(ValueError, match="linformer_causal"):
        linformer(k=8)(q, k, v, causal=True)
    with pytest.raises(ValueError, match="exceeds max_seq_len=64"):
        linformer(k=8)(*random_qkv(1, 2, 65, 8))
    with pytest.raises(ValueError, match="needs max_seq_len"):
        az.create_attention("linformer", dim_head=8, heads=2, k=8)
    # the default k is the paper's 256, capped by the length (k >= n cannot compress)
    assert az.create_attention("linformer", dim_head=8, heads=2, max_seq_len=64).k == 64
    assert az.create_attention("linformer", dim_head=8, heads=2, max_seq_len=4096).k == 256
    for bad in (0, 65):
        with pytest.raises(ValueError, match=rf"k={bad} must be in \[1, max_seq_len=64\]"):
            linformer(k=bad)
    with pytest.raises(ValueError, match=r"k must divide max_seq_len=64; got k=12 \(nearest divisors"):
        linformer(k=12, projection="mean_pool")
    with pytest.raises(ValueError, match="sharing='heads' is not a valid 'none'"):
        linformer(k=8, sharing="heads")
    with pytest.raises(ValueError, match="give one per layer"):
        linformer(k=[8, 4])  # a lone core is one layer
    with pytest.raises(ValueError, match="k must be one int"):
        az.TransformerEncoder(az.ModelConfig(
            vocab_size=11, dim=16, depth=2, heads=2, max_seq_len=16,
            attention=az.AttentionSpec("linformer", {"k": [8, 4], "sharing": "layerwise"}),
        ))  # fmt: skip
    first = az.BuildContext(layer_index=0, num_layers=2)
    second = az.BuildContext(layer_index=1, num_layers=2, shared=first.shared)
    az.create_attention("linformer", dim_head=8, heads=2, max_seq_len=64, context=first, k=8, sharing="layerwise")
    with pytest.raises(ValueError, match="every layer must use the same projection, k and length"):
        az.create_attention("linformer", dim_head=8, heads=2, max_seq_len=64, context=second, k=4, sharing="layerwise")
    with pytest.raises(ValueError, match=r"block_k=9 must be in \[1, block_size=8\]"):
        az.create_attention("linformer_causal", dim_head=8, heads=2, block_size=8, block_k=9)
    with pytest.raises(ValueError, match="block_k must divide block_size=8"):
        az.create_attention("linformer_causal", dim_head=8, heads=2, block_size=8, block_k=3, projection="max_pool")
    with pytest.raises(ValueError, match="self-attention only"):
        az.create_attention("linformer_causal", dim_head=8, heads=2, block_size=8, block_k=2)(
            *random_qkv(1, 2, 8, 8, nk=16)
        )


# ---- the causal variant ----------------------------------------------------------------------------------


def causal_linformer(**options) -> az.AttentionCore:
    torch.manual_seed(0)
    return az.create_attention("linformer_causal", dim_head=8, heads=2, **options).double()


def blockwise_reference(q, k, v, E, F, c, mask, causal):
    """Loop over queries: one softmax over the query's own block (keys j <= i if causal) and the
    summaries E K_B, F V_B of the earlier (causal) or other blocks B, padded rows zeroed, E sliced to a
    partial last block."""
    b, h, n, d = q.shape
    k, v = k * mask[:, None, :, None], v * mask[:, None, :, None]
    blocks = [range(start, min(start + c, n)) for start in range(0, n, c)]
    out = torch.zeros_like(q)
    for bi in range(b):
        for i in range(n):
            own = i // c
            local = [j for j in blocks[own] if mask[bi, j] and (not causal or j <= i)]
            keys, values = [k[bi, :, local]], [v[bi, :, local]]
            for g, block in enumerate(blocks):
                if (g < own if causal else g != own) and mask[bi, list(block)].any():
                    keys.append(torch.einsum("rj,hjd->hrd", E[:, : len(block)], k[bi, :, list(block)]))
                    values.append(torch.einsum("rj,hjd->hrd", F[:, : len(block)], v[bi, :, list(block)]))
            keys, values = torch.cat(keys, 1), torch.cat(values, 1)
            if keys.shape[1]:
                probs = (q[bi, :, i, None] @ keys.transpose(-1, -2) / math.sqrt(d)).softmax(-1)
                out[bi, :, i] = (probs @ values)[:, 0]
    return out


@pytest.mark.parametrize("causal", [True, False])
def test_causal_variant_matches_the_blockwise_reference(causal):
    core = causal_linformer(block_size=4, block_k=2)
    q, k, v = random_qkv(2, 2, 14, 8)
    mask = pad_mask(torch.tensor([14, 9]), 14)
    mask[0, 1] = False  # a hole inside a block
    E, F = core.key_projection.weight, core.value_projection.weight
    reference = blockwise_reference(q, k, v, E, F, 4, mask, causal)
    torch.testing.assert_close(core(q, k, v, mask=mask, causal=causal), reference, **TIGHT)


@pytest.mark.parametrize("projection", ["mean_pool", "max_pool"])
@pytest.mark.parametrize("causal", [True, False])
def test_causal_variant_with_identity_summaries_is_full_attention(projection, causal):
    core = causal_linformer(block_size=8, block_k=8, projection=projection)
    q, k, v = random_qkv(3, 2, 29, 8)
    mask = pad_mask(torch.tensor([29, 20, 0]), 29)
    torch.testing.assert_close(core(q, k, v, mask=mask, causal=causal), full_attention(q, k, v, mask, causal), **TIGHT)


def test_causal_variant_never_reads_ahead_at_any_position():
    """Perturbing position t leaves every output before t unchanged, for every t (a partial last block)."""
    core = causal_linformer(block_size=4, block_k=2, projection="conv", sharing="none")
    q, k, v = random_qkv(1, 2, 11, 8)
    out = core(q, k, v, causal=True)
    for t in range(11):
        changed = [x.clone() for x in (q, k, v)]
        for x in changed:
            x[:, :, t] += 5.0
        torch.testing.assert_close(core(*changed, causal=True)[:, :, :t], out[:, :, :t], **TIGHT)
        assert not torch.allclose(core(*changed, causal=True)[:, :, t:], out[:, :, t:])
