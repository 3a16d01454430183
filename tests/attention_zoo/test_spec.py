"""``attention_zoo.spec``: the flag syntax every command reads, its value typing, the label and folder a spec is
written as, and the one check against the registry."""

from __future__ import annotations

import pytest

import attention_zoo as az
from attention_zoo.spec import AttentionSpec, option_value, parse_entries, parse_list


@pytest.mark.parametrize(
    ("text", "name", "options"),
    [
        ("x:v=1e3", "x", {"v": 1000.0}),  # a float, not the text 1e3
        ("sparse:a=yes", "sparse", {"a": "yes"}),  # YAML 1.1 would read True
        ("nystrom:num_landmarks=32:pinv=exact", "nystrom", {"num_landmarks": 32, "pinv": "exact"}),
        ("local:window=8:10", "local", {"window": "8:10"}),  # YAML 1.1 would read 490
        ("linformer:k=32,sharing=kv", "linformer", {"k": 32, "sharing": "kv"}),
        (" full ", "full", {}),
    ],
)
def test_one_entry_reads_as_typed(text, name, options):
    spec = AttentionSpec.parse(text)
    assert (spec.name, spec.options) == (name, options)
    assert [type(v) for v in spec.options.values()] == [type(v) for v in options.values()]


def test_values_are_typed_not_read_as_yaml_1_1():
    values = parse_list("sparse:a=yes,b=off,c=1e3,d=3,e=null,f=true,g=-2,h=none,i=1.5")[0].options
    assert values == {"a": "yes", "b": "off", "c": 1000.0, "d": 3, "e": None, "f": True, "g": -2, "h": "none", "i": 1.5}
    assert option_value(" 8:10 ") == "8:10" and option_value("FALSE") is False


def test_a_list_separates_entries_at_items_without_an_equals_sign():
    text = "full,linformer:k=32,sharing=kv,nystrom:num_landmarks=8:pinv=exact,local"
    assert parse_entries(text) == [
        ("full", None),
        ("linformer", {"k": 32, "sharing": "kv"}),
        ("nystrom", {"num_landmarks": 8, "pinv": "exact"}),
        ("local", None),
    ]
    assert parse_list(text)[0] == AttentionSpec("full") and parse_list(text)[3] == AttentionSpec("local", {})


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("k=3", "follows no 'name:' entry"),
        ("full,k=3", "follows no 'name:' entry"),
        ("linformer:k", "is not name:option=value"),
        ("linformer:=3", "is not name:option=value"),
        ("linformer:k=32,k=64", "option 'k' given twice for 'linformer'"),
        (" , ", "names no mechanism"),
    ],
)
def test_malformed_lists_are_refused_in_one_line(text, message):
    with pytest.raises(ValueError, match=message) as error:
        parse_list(text)
    assert "\n" not in str(error.value)


def test_parse_takes_exactly_one_entry():
    with pytest.raises(ValueError, match="names 2 mechanisms"):
        AttentionSpec.parse("full,local")


@pytest.mark.parametrize(
    "spec",
    [
        AttentionSpec("full"),
        AttentionSpec("linformer", {"k": 32, "sharing": "kv"}),
        AttentionSpec("nystrom", {"num_landmarks": 8, "pinv": "exact", "conv_kernel_size": None}),
        AttentionSpec("local", {"window": "8:10"}),
        AttentionSpec("x", {"flag": True, "off": False, "v": 1000.0, "n": -2}),
    ],
)
def test_label_reads_back_as_the_same_spec(spec):
    assert AttentionSpec.parse(spec.label) == spec
    assert parse_list(",".join([spec.label, "full"])) == [spec, AttentionSpec("full")]


def test_label_and_folder():
    spec = AttentionSpec("linformer", {"k": 32, "sharing": "kv"})
    assert spec.label == "linformer:k=32,sharing=kv"
    assert spec.folder == "linformer-k=32-sharing=kv"
    assert AttentionSpec("full").label == AttentionSpec("full").folder == "full"
    assert AttentionSpec("x", {"on": True, "p": None, "path": "a/b"}).folder == "x-on=true-p=null-path=a_b"


def test_equal_specs_have_equal_options_in_any_order():
    a, b = AttentionSpec("linformer", {"k": 32, "sharing": "kv"}), AttentionSpec.parse("linformer:sharing=kv,k=32")
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1


def test_of_takes_a_spec_the_flag_syntax_or_a_mapping():
    spec = AttentionSpec("local", {"window": 8})
    assert AttentionSpec.of(spec) is spec
    assert AttentionSpec.of("local:window=8") == spec == AttentionSpec.of({"name": "local", "options": {"window": 8}})
    with pytest.raises(ValueError, match="give a name with options"):
        AttentionSpec.of({"attention": "local"})


def test_hparams_are_what_a_task_records():
    spec = AttentionSpec.parse("linformer:k=32,sharing=kv")
    assert spec.hparams() == {"attention": "linformer", "attention_options": {"k": 32, "sharing": "kv"}}


def test_checked_names_the_bad_name_or_option_and_what_is_allowed():
    spec = AttentionSpec.parse("local:window=8")
    assert spec.checked() is spec
    with pytest.raises(ValueError, match=r"unknown attention 'flash'; known: .*full") as unknown:
        AttentionSpec("flash").checked()
    with pytest.raises(ValueError, match=r"attention 'linformer' has no option 'kk'; valid options: k: ") as option:
        AttentionSpec.parse("linformer:kk=32").checked()
    with pytest.raises(ValueError, match=r"option k='abc' is not a valid int") as typed:
        AttentionSpec.parse("linformer:k=abc").checked()
    assert all("\n" not in str(e.value) for e in (unknown, option, typed))


def test_every_registered_mechanism_checks_with_its_first_example():
    for name in az.list_attentions():
        example = az.get_attention_class(name).example_configs[0]
        assert AttentionSpec(name, example).checked().name == name
