from __future__ import annotations

from typing import Literal

import pytest

import attention_zoo as az
from attention_zoo import registry
from attention_zoo.core import AttentionCore, Geometry


def test_full_is_registered():
    assert "full" in az.list_attentions()
    assert az.list_attentions() == sorted(az.list_attentions())


@pytest.mark.parametrize("flag", sorted(registry.CAPABILITY_FILTERS))
def test_each_capability_filter_keeps_exactly_the_cores_with_that_capability(flag):
    attribute = registry.CAPABILITY_FILTERS[flag]
    every = az.list_attentions()
    for value in (True, False):
        expected = [n for n in every if getattr(az.get_attention_class(n), attribute) == value]
        assert az.list_attentions(**{flag: value}) == expected
    assert sorted(az.list_attentions(**{flag: True}) + az.list_attentions(**{flag: False})) == every


def test_capability_filters_combine_and_name_known_cores():
    assert "full" in az.list_attentions(causal=True, mask=True, cross=True, decoding=True)
    assert "linformer" in az.list_attentions(causal=False, cross=True)
    assert "linformer" not in az.list_attentions(causal=True)
    recompute = az.list_attentions(causal=True, decoding=False)
    assert all(az.get_attention_class(n).supports_causal and not az.get_attention_class(n).has_decoding_cache
               for n in recompute)  # fmt: skip
    assert set(az.list_attentions(cross=True, position_free_queries=True)) < set(az.list_attentions(cross=True))
    with pytest.raises(TypeError):
        az.list_attentions(causl=True)  # a typo is an error, never an ignored filter


@pytest.mark.parametrize("value", ["yes", 1, 0, "false"])
@pytest.mark.parametrize("flag", sorted(registry.CAPABILITY_FILTERS))
def test_a_filter_that_is_not_a_bool_is_refused(flag, value):
    with pytest.raises(ValueError, match=rf"list_attentions: {flag} must be True, False or None, got {value!r}"):
        az.list_attentions(**{flag: value})


def test_unknown_name_lists_known_names_and_the_closest_one():
    with pytest.raises(ValueError, match=r"unknown attention 'fulll'; known: .*full.*; did you mean 'full'\?$"):
        az.create_attention("fulll", dim_head=8, heads=2)
    with pytest.raises(ValueError, match=r"did you mean 'linformer'\?"):
        az.AttentionSpec.parse("linformr:k=4").checked()
    with pytest.raises(ValueError) as unknown:
        az.create_attention("xyzzy", dim_head=8, heads=2)
    assert "did you mean" not in str(unknown.value)  # nothing close: no guess


def test_unknown_option_names_valid_options():
    with pytest.raises(ValueError, match=r"no option 'backnd'.*valid options: backend: .* = 'auto'"):
        az.create_attention("full", dim_head=8, heads=2, backnd="math")


def test_literal_and_type_checks():
    with pytest.raises(ValueError, match=r"backend='flash' is not a valid 'auto' \| 'math'"):
        az.create_attention("full", dim_head=8, heads=2, backend="flash")
    with pytest.raises(ValueError, match=r"dropout='0.1' is not a valid float"):
        az.create_attention("full", dim_head=8, heads=2, dropout="0.1")
    assert az.create_attention("full", dim_head=8, heads=2, dropout=0).dropout == 0


def test_duplicate_registration_is_an_error(scratch_registry):
    with pytest.raises(ValueError, match="already registered"):
        az.register_attention("full")(type("Again", (AttentionCore,), {}))


def test_options_must_be_keyword_only(scratch_registry):
    class Positional(AttentionCore):
        approximation = "none"

        def __init__(self, geometry, window, *, mode="a"):
            super().__init__(geometry)

    with pytest.raises(TypeError, match="keyword-only"):
        az.register_attention("positional_option")(Positional)


def test_geometry_is_not_an_option(scratch_registry):
    class OldStyle(AttentionCore):  # re-declares the geometry as keywords instead of taking a Geometry
        approximation = "none"

        def __init__(self, *, dim_head: int, heads: int, window: int = 4) -> None:
            super().__init__(Geometry(dim_head, heads))

    with pytest.raises(TypeError, match="'dim_head' is part of the Geometry"):
        az.register_attention("old_style")(OldStyle)
    options = az.attention_options(az.get_attention_class("full"))
    assert [s.name for s in options] == ["backend", "dropout", "sink_logit"]
    with pytest.raises(TypeError, match="must be a Geometry"):
        az.get_attention_class("full")(8)
    core = az.create_attention("full", dim_head=8, heads=2, max_seq_len=16)
    assert (core.dim_head, core.heads, core.max_seq_len, core.scale) == (8, 2, 16, 8**-0.5)


def test_required_option_and_container_types(scratch_registry):
    @az.register_attention("needs_window")
    class NeedsWindow(AttentionCore):
        approximation = "none"

        def __init__(
            self, geometry: Geometry, *, window: int, sizes: list[int] | int = 4, mode: Literal["a", "b"] = "a"
        ) -> None:
            super().__init__(geometry)

    with pytest.raises(ValueError, match="needs option"):
        az.create_attention("needs_window", dim_head=8, heads=2)
    az.create_attention("needs_window", dim_head=8, heads=2, window=3, sizes=[1, 2])
    with pytest.raises(ValueError, match="sizes"):
        az.create_attention("needs_window", dim_head=8, heads=2, window=3, sizes=[1, "2"])
    with pytest.raises(ValueError, match="window=True"):
        az.create_attention("needs_window", dim_head=8, heads=2, window=True)


def test_requires_max_seq_len(scratch_registry):
    @az.register_attention("bounded")
    class Bounded(AttentionCore):
        approximation = "none"
        requires_max_seq_len = True

    with pytest.raises(ValueError, match="needs max_seq_len"):
        az.create_attention("bounded", dim_head=8, heads=2)
    assert az.create_attention("bounded", dim_head=8, heads=2, max_seq_len=16).max_seq_len == 16


def test_input_validation_messages():
    core = az.create_attention("full", dim_head=8, heads=2)
    import torch

    q = torch.randn(1, 2, 5, 8)
    with pytest.raises(ValueError, match=r"mask must be bool \(B, Nk\)"):
        core(q, q, q, mask=torch.ones(1, 5))
    with pytest.raises(ValueError, match="built for heads=2"):
        core(q[:, :1], q[:, :1], q[:, :1])
    with pytest.raises(ValueError, match=r"must be \(B, H, N, D\)"):
        core(q[0], q[0], q[0])
