from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

import attention_zoo as az
from experiments import cli, listing


def test_zoo_list_shows_every_mechanism_with_options(capsys):
    assert cli.main(["list", "--long"]) == 0
    text = capsys.readouterr().out
    assert "full" in text and "backend" in text
    assert "list[int]" in text  # option types are shown verbatim ("[int]" is not eaten as rich markup)
    assert {row["name"] for row in listing.rows()} == set(az.list_attentions())


def test_zoo_list_says_which_cores_support_double_backward(capsys):
    rows = {row["name"]: row for row in listing.rows()}
    for name in az.list_attentions():
        claimed = az.get_attention_class(name).supports_double_backward
        assert rows[name]["supports_double_backward"] == ("yes" if claimed else "no")
    assert cli.main(["list", "--long"]) == 0
    assert "grad²" in capsys.readouterr().out


def test_unknown_command_is_an_error_with_the_closest_command(capsys):
    assert cli.main(["lsit"]) == 2
    assert "unknown command 'lsit' (did you mean 'list'?); choose from " in capsys.readouterr().err
    assert cli.main(["comapre"]) == 2 and "(did you mean 'compare'?)" in capsys.readouterr().err
    assert cli.main(["xyzzy"]) == 2 and "did you mean" not in capsys.readouterr().err  # nothing close: no guess


def softmax_attention_float64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """Vaswani et al. 2017, eq. 1: softmax(Q K^T / sqrt(d)) V, in float64; ``causal``: key j <= query i only."""
    q, k, v = q.double(), k.double(), v.double()
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def demo_error(name: str, options: dict, n: int, heads: int, dim_head: int) -> float:
    """The demo's stated measurement redone here: its fixed input (generator seed 0: q, k, v; global seed 0
    before the core is built; k = q for shared-QK cores), one forward, relative Frobenius error against
    float64 softmax attention (causal for a causal-only core)."""
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, n, dim_head, generator=generator) for _ in range(3))
    torch.manual_seed(0)
    core = az.create_attention(name, dim_head=dim_head, heads=heads, max_seq_len=n, **options).eval()
    k = q if core.needs_shared_qk else k
    with torch.inference_mode():
        out = core(q, k, v, causal=core.causal_only).double()
    reference = softmax_attention_float64(q, k, v, core.causal_only)
    return (torch.linalg.vector_norm(out - reference) / torch.linalg.vector_norm(reference)).item()


def test_demo_prints_each_mechanisms_distance_from_softmax_attention(capsys):
    n, heads, dim_head = 64, 2, 16
    argv = ["demo", "--seq-len", str(n), "--heads", str(heads), "--dim-head", str(dim_head), "--repeats", "1"]
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    assert "skipped" not in text
    assert "causal only (" + ", ".join(az.list_attentions(causal_only=True)) + "): causal, against causal full" in text
    # data rows: "│ name │ options │ ms │ error │"
    rows = [[cell.strip() for cell in line.split("│")[1:-1]] for line in text.splitlines() if line.startswith("│")]
    expected = [
        (name, options) for name in az.list_attentions() for options in az.get_attention_class(name).example_configs
    ]
    assert [(name, options) for name, options, _, _ in rows] == [(name, str(options)) for name, options in expected]
    default_backend = az.create_attention("full", dim_head=dim_head, heads=heads).backend
    same_as_reference = []
    for (name, options), (_, _, _, printed) in zip(expected, rows, strict=True):
        error = demo_error(name, options, n, heads, dim_head)
        # printed with 3 significant digits against a float32 reference: round-off of 1e-6 at most
        assert float(printed) == pytest.approx(error, rel=5e-3, abs=1e-6), (name, options, printed, error)
        if name == "full" and not options.get("sink_logit"):  # a sink takes weight away from every key
            assert error < 1e-6
            if az.create_attention("full", dim_head=dim_head, heads=heads, **options).backend == default_backend:
                same_as_reference.append(printed)
    assert same_as_reference and set(same_as_reference) == {"0"}  # the reference's own computation: exactly 0


def test_console_script_is_installed():
    result = subprocess.run([sys.executable, "-m", "experiments.cli", "list"], capture_output=True, text=True)
    assert result.returncode == 0 and "full" in result.stdout


UNION_DUMP = """Parser key "model":
  Does not validate against any of the Union subtypes
  Subtypes: [<class 'tasks.base.ZooTask'>, <class 'NoneType'>]
  Errors:
    - Problem with given class_path 'tasks.token_prediction.TokenPrediction':
        Parser key "attention_options":
          Does not validate against any of the Union subtypes
          Subtypes: [dict[str, typing.Any], <class 'NoneType'>]
          Errors:
            - Expected a <class 'dict'>
            - Expected a <class 'NoneType'>
          Given value type: <class 'list'>
          Given value: [1, 2]
    - Expected a <class 'NoneType'>
  Given value type: <class 'jsonargparse._util.NestedArg'>
  Given value: NestedArg(key='attention_options', val=[1, 2])"""


def test_parser_errors_shrink_to_their_useful_line():
    from tasks.cli import parser_error_line

    assert parser_error_line(UNION_DUMP) == "--model.attention_options [1, 2]: expected dict[str, Any] or null"
    unknown = UNION_DUMP.replace('Parser key "attention_options":', "Option 'heds' is not accepted\n        X:")
    expected = "--model.heds: TokenPrediction has no option 'heds'; did you mean --model.heads?"
    assert parser_error_line(unknown) == expected
    assert parser_error_line("unrecognized arguments: --trainer.max_epoch 3").startswith(
        "unrecognized argument --trainer.max_epoch; did you mean --trainer.max_epochs"
    )
    assert parser_error_line("something else\n  more") == "something else"


def test_only_a_bare_verbose_is_zoos(monkeypatch):
    from tasks.cli import take_verbose

    monkeypatch.delenv("ZOO_VERBOSE", raising=False)
    assert take_verbose(["-c", "x.yaml", "--verbose"]) == (["-c", "x.yaml"], True)
    assert take_verbose(["--verbose", "--model.dim", "8"]) == (["--model.dim", "8"], True)
    assert take_verbose(["--verbose", "false"]) == (["--verbose", "false"], False)  # Lightning's (validate, test)
    monkeypatch.setenv("ZOO_VERBOSE", "1")
    assert take_verbose([]) == ([], True)
