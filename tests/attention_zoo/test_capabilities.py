"""Capabilities declared in a core's class statement: set as class attributes, typos and wrong kinds refused."""

import pytest

import attention_zoo as az
from attention_zoo.core import APPROXIMATIONS, CAPABILITIES, AttentionCore


def test_class_statement_sets_capabilities_and_subclasses_inherit_them():
    class Banded(AttentionCore, approximation="fixed sparsity", supports_causal=False, has_decoding_cache=True):
        pass

    class Narrower(Banded, supports_mask=False):
        pass

    assert (Banded.approximation, Banded.supports_causal, Banded.has_decoding_cache) == ("fixed sparsity", False, True)
    assert Banded.supports_mask is True  # not declared: AttentionCore's default
    assert (Narrower.supports_causal, Narrower.supports_mask) == (False, False)
    assert AttentionCore.supports_causal is True and AttentionCore.has_decoding_cache is False  # base untouched


def test_a_misspelt_capability_is_refused_naming_it_and_the_known_ones():
    known = r"known: approximation, .*supports_causal"
    with pytest.raises(TypeError, match=rf"Typo: unknown capability 'supports_casual'; {known}"):

        class Typo(AttentionCore, approximation="none", supports_casual=False):
            pass


@pytest.mark.parametrize(
    ("capability", "value", "allowed"),
    [("supports_causal", "no", "True or False"), ("has_decoding_cache", 1, "True or False"),
     ("approximation", "lowrank", "'none', 'fixed sparsity'")],
)  # fmt: skip
def test_a_capability_of_the_wrong_kind_is_refused(capability, value, allowed):
    with pytest.raises(TypeError, match=rf"Wrong: {capability} must be (one of )?{allowed}.*got {value!r}"):
        type("Wrong", (AttentionCore,), {}, **{capability: value})


def test_every_registered_core_has_every_capability_with_a_value_of_its_kind():
    assert set(CAPABILITIES) <= set(vars(AttentionCore)) | {"approximation"}
    for name in az.list_attentions():
        cls = az.get_attention_class(name)
        assert cls.approximation in APPROXIMATIONS, name
        assert all(isinstance(getattr(cls, c), bool) for c in CAPABILITIES if c != "approximation"), name
