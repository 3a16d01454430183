"""The verdict rule (experiments.stats) and its use in the compare summary. Reference values are textbook
t quantiles (t_{0.975, 2} = 4.302653, t_{0.95, 2} = 2.919986, t_{0.975, 1} = 12.706205) and hand arithmetic."""

from __future__ import annotations

import csv
import json
import math
import warnings

import pytest

from experiments.compare.summary import summarize_mechanisms, summary_table_rows
from experiments.stats import default_margin, paired_difference, summarize


def test_paired_difference_matches_the_hand_computed_t_intervals_and_p_value():
    # d = (0.1, 0.2, 0.3): mean 0.2, s = 0.1, se = 0.1 / sqrt(3); t = 3.4641, two-sided p = 0.07418 (2 dof)
    result = paired_difference({0: 1.1, 1: 2.2, 2: 3.3}, {0: 1.0, 1: 2.0, 2: 3.0}, margin=1.0, higher_is_better=True)
    se = 0.1 / math.sqrt(3)
    assert result.n == 3 and result.mean == pytest.approx(0.2)
    assert (result.low, result.high) == pytest.approx((0.2 - 4.302653 * se, 0.2 + 4.302653 * se), abs=1e-6)
    assert (result.low90, result.high90) == pytest.approx((0.2 - 2.919986 * se, 0.2 + 2.919986 * se), abs=1e-6)
    assert result.p_value == pytest.approx(0.07418, abs=1e-4)
    assert result.verdict == "on par"  # the 90% interval [0.031, 0.369] lies inside ±1


def test_pairing_by_seed_uses_only_shared_seeds_and_sees_through_seed_to_seed_spread():
    # seeds differ a lot from one another, the mechanism is 0.05 below the reference in every one of them
    reference = {0: 0.60, 1: 0.80, 2: 0.95, 3: 0.70}
    values = {0: 0.55, 1: 0.751, 2: 0.899, 7: 0.1}
    result = paired_difference(values, reference, margin=0.01, higher_is_better=True)
    assert result.n == 3  # seed 3 has no partner, seed 7 no reference
    assert result.verdict == "worse" and result.high < 0


def test_on_par_takes_precedence_over_a_detectable_difference_smaller_than_the_margin():
    result = paired_difference(
        {0: 0.903, 1: 0.9031, 2: 0.9029}, {0: 0.9, 1: 0.9, 2: 0.9}, margin=0.01, higher_is_better=True
    )
    assert result.low > 0  # a difference, detectably
    assert result.verdict == "on par"


def test_direction_follows_the_metric():
    lower = {0: 1.0, 1: 1.1, 2: 0.9}
    higher = {0: 1.5, 1: 1.62, 2: 1.38}
    assert paired_difference(higher, lower, margin=0.02, higher_is_better=False).verdict == "worse"  # a loss
    assert paired_difference(higher, lower, margin=0.02, higher_is_better=True).verdict == "better"  # an accuracy


def test_wide_intervals_are_inconclusive_not_on_par():
    # the per-mechanism intervals overlap, and the paired interval holds 0 but is far wider than the margin
    result = paired_difference({0: 0.9, 1: 0.7, 2: 0.95}, {0: 0.8, 1: 0.85, 2: 0.9}, margin=0.01, higher_is_better=True)
    assert result.low < 0 < result.high and result.verdict == "inconclusive"
    assert "holds 0" in result.reason


def test_two_seeds_have_one_degree_of_freedom():
    result = paired_difference({0: 0.5, 1: 0.7}, {0: 0.4, 1: 0.4}, margin=0.01, higher_is_better=True)
    # d = (0.1, 0.3): mean 0.2, se = 0.1; 95% half-width 12.706 * 0.1
    assert result.high - result.mean == pytest.approx(1.2706205, abs=1e-6)
    assert result.verdict == "inconclusive"


@pytest.mark.parametrize(
    ("values", "verdict", "reason"),
    [
        ({0: 0.9}, "inconclusive", "one shared seed"),
        ({5: 0.9}, "inconclusive", "no seed shared"),
        ({0: 0.905, 1: 0.905}, "inconclusive", "same difference +0.005"),  # 2 seeds: sign-flip p = 0.5
        ({0: 0.95, 1: 0.95}, "inconclusive", "same difference +0.05"),
    ],
)
def test_edge_cases_few_seeds_and_zero_variance(values, verdict, reason):
    result = paired_difference(values, {0: 0.9, 1: 0.9}, margin=0.01, higher_is_better=True)
    assert result.verdict == verdict and reason in result.reason


@pytest.mark.parametrize("higher_is_better", [True, False])
def test_identical_values_without_a_margin_give_no_direction(higher_is_better):
    result = paired_difference({0: 1.0, 1: 1.0}, {0: 1.0, 1: 1.0}, margin=None, higher_is_better=higher_is_better)
    assert result.verdict == "inconclusive" and result.p_value == 1.0 and result.mean == 0.0
    many = {s: 1.0 for s in range(8)}  # even where a constant difference could be a direction, zero is none
    assert paired_difference(many, many, margin=None, higher_is_better=higher_is_better).verdict == "inconclusive"
    assert paired_difference(many, many, margin=0.01, higher_is_better=higher_is_better).verdict == "on par"


def test_the_same_memory_on_every_seed_is_not_better():
    runs = [
        {"mechanism": name, "attention": name, "options": "{}", "options_from": "defaults", "seed": seed,
         "status": "ok", "reason": "", "peak_mem_mb": 42.0}
        for name in ("full", "local") for seed in range(3)
    ]  # fmt: skip
    local = next(s for s in summarize_mechanisms(runs, "peak_mem_mb") if s["mechanism"] == "local")
    assert local["verdict"] == "inconclusive" and local["difference"].p_value == 1.0


def test_equal_differences_give_one_verdict_and_p_value_however_they_round():
    """0.4 - 0.3 and 0.1 - 0.0 are both 0.1; in floating point the first three differ in their last bits."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no precision warning from a t-test on rounding noise
        rounded = paired_difference({0: 0.4, 1: 0.4, 2: 0.4}, {0: 0.3, 1: 0.3, 2: 0.3}, margin=None,
                                    higher_is_better=True)  # fmt: skip
        exact = paired_difference({0: 0.1, 1: 0.1, 2: 0.1}, {0: 0.0, 1: 0.0, 2: 0.0}, margin=None,
                                  higher_is_better=True)  # fmt: skip
        noisy = paired_difference({0: 0.4, 1: 0.1, 2: 0.7}, {0: 0.3, 1: 0.0, 2: 0.6}, margin=None,
                                  higher_is_better=True)  # fmt: skip
    for result in (rounded, exact, noisy):
        assert (result.verdict, result.p_value) == ("inconclusive", 0.25)


@pytest.mark.parametrize(
    ("n", "p_value", "verdict_within_margin", "verdict_outside"),
    [(3, 0.25, "inconclusive", "inconclusive"), (5, 0.0625, "on par", "inconclusive"), (6, 0.03125, "on par", "worse")],
)
def test_a_constant_difference_has_the_sign_flip_tests_p_value(n, p_value, verdict_within_margin, verdict_outside):
    """n equal differences: the exact sign-flip test's two-sided p is 2 / 2^n (only the observed signs and their
    mirror reach the observed |mean|); its intervals are the point from n = 5 (90%) and n = 6 (95%) on."""
    reference = {s: 0.9 for s in range(n)}
    within = paired_difference({s: 0.895 for s in range(n)}, reference, margin=0.01, higher_is_better=True)
    outside = paired_difference({s: 0.8 for s in range(n)}, reference, margin=0.01, higher_is_better=True,
                                bounds=(0.0, 1.0))  # fmt: skip
    assert within.p_value == pytest.approx(p_value) and outside.p_value == pytest.approx(p_value)
    assert within.verdict == verdict_within_margin and outside.verdict == verdict_outside
    if n < 6:  # no finite interval: every difference accuracy can take
        assert (outside.low, outside.high) == (-1.0, 1.0)
    else:
        assert outside.low == outside.high == pytest.approx(-0.1)


def test_paired_intervals_are_clipped_to_what_the_difference_can_take():
    values, reference = {0: 0.05, 1: 0.30, 2: 0.02}, {0: 0.98, 1: 0.97, 2: 0.99}
    free = paired_difference(values, reference, margin=0.01, higher_is_better=True)
    clipped = paired_difference(values, reference, margin=0.01, higher_is_better=True, bounds=(0.0, 1.0))
    assert free.low < -1.0  # an accuracy difference below -1: impossible
    assert clipped.low == -1.0 and clipped.high == free.high and clipped.verdict == free.verdict == "worse"
    assert clipped.low90 == max(free.low90, -1.0)


def test_the_smallest_on_par_margin_is_the_largest_end_of_the_90_percent_interval():
    result = paired_difference({0: 1.1, 1: 2.2, 2: 3.3}, {0: 1.0, 1: 2.0, 2: 3.0}, margin=None, higher_is_better=True)
    assert result.on_par_margin == pytest.approx(abs(result.high90))
    assert paired_difference({0: 1.1, 1: 2.2, 2: 3.3}, {0: 1.0, 1: 2.0, 2: 3.0}, margin=result.on_par_margin * 1.0001,
                             higher_is_better=True).verdict == "on par"  # fmt: skip
    assert paired_difference({0: 1.1, 1: 2.2, 2: 3.3}, {0: 1.0, 1: 2.0, 2: 3.0}, margin=result.on_par_margin * 0.9999,
                             higher_is_better=True).verdict != "on par"  # fmt: skip


def test_a_negative_margin_is_refused():
    with pytest.raises(ValueError, match="margin must be >= 0, got -0.1"):
        paired_difference({0: 1.0}, {0: 1.0}, margin=-0.1, higher_is_better=True)


def test_default_margins_are_the_documented_ones():
    assert default_margin("val_acc") == 0.01 and default_margin("val_f1") == 0.01
    assert default_margin("val_loss") == 0.02 and default_margin("test_bleu") == 0.5
    assert default_margin("val_ppl", reference_mean=20.0) == pytest.approx(0.4)
    assert default_margin("tokens_per_s") is None


def test_intervals_of_bounded_metrics_are_clipped():
    interval = summarize([1.0, 1.0, 0.9], bounds=(0.0, 1.0))
    assert interval.high == 1.0 and interval.low < interval.mean < interval.high
    unclipped = summarize([1.0, 1.0, 0.9])
    assert unclipped.high > 1.0 and unclipped.low == interval.low


def rows(values: dict[str, list[float]]) -> list[dict]:
    return [
        {"mechanism": name, "attention": name.split("-")[0], "options": json.dumps({}), "options_from": "defaults",
         "seed": seed, "status": "ok", "reason": "", "val_acc": value, "tokens_per_s": 1000.0}
        for name, per_seed in values.items() for seed, value in enumerate(per_seed)
    ]  # fmt: skip


def test_the_compare_summary_gives_every_mechanism_its_paired_verdict_against_the_reference():
    runs = rows({
        "full": [0.90, 0.80, 0.95],
        "local": [0.80, 0.70, 0.86],
        "nystrom": [0.901, 0.8015, 0.9505],
        "lsh": [0.99, 0.60, 0.90],
    })  # fmt: skip
    summary = {s["mechanism"]: s for s in summarize_mechanisms(runs)}
    assert summary["full"]["verdict"] == "reference"
    assert summary["local"]["verdict"] == "worse"
    assert summary["nystrom"]["verdict"] == "on par"
    assert summary["lsh"]["verdict"] == "inconclusive"
    assert [s["mechanism"] for s in sorted(summary.values(), key=lambda s: s["order"])] == [
        "nystrom", "full", "lsh", "local"
    ]  # best mean first  # fmt: skip
    flat = {r["mechanism"]: r for r in summary_table_rows(list(summary.values()), "val_acc", ["val_acc"])}
    assert flat["local"]["delta"] == pytest.approx(-0.0966667)
    assert flat["local"]["delta_lo"] < flat["local"]["delta"] < flat["local"]["delta_hi"] < 0
    assert 0 < flat["local"]["p_value"] < 0.05
    assert flat["full"]["delta"] is None and flat["full"]["verdict"] == "reference"
    assert flat["nystrom"]["margin"] == 0.01 and flat["nystrom"]["metric"] == "val_acc"


def test_another_reference_and_margin_and_no_reference():
    runs = rows({"full": [0.9, 0.8, 0.95], "local": [0.8, 0.7, 0.86]})
    summary = {s["mechanism"]: s for s in summarize_mechanisms(runs, reference="local", margin=0.5)}
    assert summary["local"]["verdict"] == "reference" and summary["full"]["verdict"] == "on par"
    alone = summarize_mechanisms(rows({"local": [0.8, 0.7, 0.86]}))
    assert alone[0]["verdict"] == "-" and alone[0]["difference"] is None


def test_zoo_report_uses_the_same_paired_verdicts(tmp_path):
    import csv

    from experiments.compare.report import main as report_main

    experiment, bench = tmp_path / "experiment", tmp_path / "bench"
    experiment.mkdir()
    bench.mkdir()
    runs = rows({"full": [0.90, 0.80, 0.95], "local": [0.80, 0.70, 0.86], "nystrom": [0.901, 0.8015, 0.9505]})
    for row in runs:
        row["train_mem_mb"] = 10.0
    with open(experiment / "runs.csv", "w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=list(runs[0]))
        writer.writeheader()
        writer.writerows(runs)
    timings = [("full", 1024, 10.0), ("local", 1024, 5.0), ("nystrom", 1024, 2.0)]
    (bench / "results.jsonl").write_text("".join(
        json.dumps({"kind": "time", "status": "ok", "mode": "fwd+bwd", "dtype": "float32", "level": "core",
                    "causal": False, "attention": name, "options": {}, "seq_len": n, "time_ms_median": ms}) + "\n"
        for name, n, ms in timings
    ))  # fmt: skip
    assert report_main(["--compare", str(experiment), "--bench", str(bench)]) == 0
    report = (experiment / "report.md").read_text()
    local = next(line for line in report.splitlines() if line.startswith("| local |"))
    assert "| worse |" in local and "-0.097 [" in local
    assert "| on par |" in next(line for line in report.splitlines() if line.startswith("| nystrom |"))
    assert "nystrom 5.0x (+0.001" in report and "on par)" in report and "local 2.0x (-0.097" in report
    assert (experiment / "pareto.png").read_bytes()[:4] == b"\x89PNG"


def test_every_summary_gives_the_smallest_on_par_margin_and_the_gap_to_the_control(tmp_path):
    from experiments.compare.summary import write_summary

    runs = rows({
        "full": [0.90, 0.80, 0.95],
        "nystrom": [0.85, 0.70, 0.92],
        "self_only": [0.30, 0.25, 0.40],
    })  # fmt: skip
    summary = {s["mechanism"]: s for s in write_summary(tmp_path, runs, ["# t"])}
    nystrom, control = summary["nystrom"]["difference"], summary["self_only"]["difference"]
    assert summary["nystrom"]["gap_fraction"] == pytest.approx(nystrom.mean / control.mean)
    assert summary["self_only"]["gap_fraction"] == pytest.approx(1.0) and summary["full"]["gap_fraction"] is None
    with open(tmp_path / "summary.csv") as file:
        flat = {r["mechanism"]: r for r in csv.DictReader(file)}
    assert float(flat["nystrom"]["on_par_margin"]) == pytest.approx(max(abs(nystrom.low90), abs(nystrom.high90)))
    assert float(flat["nystrom"]["gap_fraction"]) == pytest.approx(nystrom.mean / control.mean)
    markdown = (tmp_path / "summary.md").read_text()
    assert "| verdict | on par from δ | Δ / Δ control |" in markdown
    line = next(row for row in markdown.splitlines() if row.startswith("| nystrom |"))
    assert f"| {nystrom.on_par_margin:.3f} | {nystrom.mean / control.mean:.2f} |" in line
    without = tmp_path / "without"
    without.mkdir()
    write_summary(without, [r for r in runs if r["mechanism"] != "self_only"], ["# t"])
    assert "Δ / Δ control" not in (without / "summary.md").read_text()


def test_a_mechanism_judged_worse_is_never_on_the_pareto_front():
    from experiments.compare.report import pareto_front
    from experiments.stats import Interval

    def point(name: str, speedup: float, accuracy: float, verdict: str) -> dict:
        return {"summary": {"mechanism": name, "verdict": verdict}, "speedup": speedup,
                "metric": Interval(3, accuracy, 0.0, accuracy, accuracy)}  # fmt: skip

    points = [point("full", 1.0, 0.99, "reference"), point("self_only", 1.2, 0.02, "worse"),
              point("moba", 0.8, 0.99, "on par"), point("fast", 1.5, 0.97, "inconclusive")]  # fmt: skip
    assert [p["summary"]["mechanism"] for p in pareto_front(points, lower_better=False)] == ["full", "fast"]
