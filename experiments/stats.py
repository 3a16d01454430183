"""Statistics over seeds: per-mechanism intervals, and the paired comparison with a reference that gives verdicts.

Per mechanism, the 95% Student-t interval of its mean over n seeds, ``mean ± t_{0.975, n-1} · s / √n``, clipped
to the metric's range (an accuracy interval never runs past 1).

Against a reference mechanism (default ``full``), runs are paired by seed: seed s of both shares the data order
and the initialisation seed. Over the seeds both finished, d_s = metric(mechanism, s) - metric(reference, s);
the paired t-test gives the mean difference, its intervals and a two-sided p-value (``scipy.stats``). The
verdict follows one rule, with an equivalence margin δ in the metric's units:

1. ``on par``: the 90% interval of the mean difference lies inside ±δ (two one-sided tests at α = 0.05). This
   comes first: a detectable difference smaller than the margin is on par.
2. else ``better`` or ``worse``: the 95% interval excludes 0 (the sign says which, by the metric's direction);
3. else ``inconclusive``;
4. the reference itself is ``reference``.

A difference's intervals are clipped to what it can take (for accuracy, ``[-1, 1]``). Beside each verdict the
summaries give the **smallest margin at which ``on par`` would hold**, ``max(|low90|, |high90|)``, so a reader can
apply their own δ. Overlapping per-mechanism intervals are never read as equivalence.

Edge cases. With fewer than two shared seeds the verdict is ``inconclusive`` (there is no spread to test against).
When every seed gives the same difference (no spread beyond floating-point rounding: max - min ≤ 1e-12 times the
largest |value|, so 0.4 - 0.3 and 0.1 - 0.0 are alike) the t-statistic is undefined, and the exact sign-flip
(randomisation) test takes the t-test's place: it assumes nothing about the spread, and for n equal nonzero
differences its two-sided p-value is 2^(1-n) (0.25 at n = 3, 0.0625 at 5, 0.031 at 6), the smallest any test of n
paired seeds can give; for a zero difference p = 1. Its intervals are that test inverted: the point d where
2^(1-n) is below the interval's α (95%: n ≥ 6; 90%: n ≥ 5), else every value the difference can take. The rule
above then applies unchanged, so a constant difference is ``on par`` from 5 seeds and a direction from 6, and a
difference of exactly zero is never a direction.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from scipy.stats._distn_infrastructure import rv_continuous

Verdict = Literal["reference", "on par", "better", "worse", "inconclusive"]

#: δ by metric family, in the metric's units: accuracy-like 0.01, BLEU-like 0.5 points, loss 0.02 nats
#: (about 2% of perplexity); perplexity's margin is relative (see :func:`default_margin`).
DEFAULT_MARGINS = {"acc": 0.01, "f1": 0.01, "bleu": 0.5, "chrf": 0.5, "loss": 0.02}
PPL_RELATIVE_MARGIN = 0.02


#: the rule in words, for the Markdown every tool writes (after the margin: "δ = 0.01: " + RULE)
RULE = (
    "`on par` if its 90% interval lies inside ±δ, else `better`/`worse` if its 95% interval excludes 0, else "
    "`inconclusive`"
)


def margin_text(margin: float | None) -> str:
    """How the Markdown names δ."""
    return "no margin (none given, and no default for this metric)" if margin is None else f"δ = {margin:g}"


def metric_bounds(metric: str) -> tuple[float | None, float | None]:
    """The range a metric can take: accuracy and F1 in [0, 1], BLEU and chrF in [0, 100], perplexity >= 1,
    losses, rates, memory and durations >= 0; anything else unbounded."""
    if metric.endswith(("acc", "f1")):
        return 0.0, 1.0
    if metric.endswith(("bleu", "chrf")):
        return 0.0, 100.0
    if metric.endswith("ppl"):
        return 1.0, None
    if metric.endswith(("loss", "_per_s", "mem_mb", "_s")):
        return 0.0, None
    return None, None


def default_margin(metric: str, reference_mean: float | None = None) -> float | None:
    """δ for ``metric`` (module docstring): by the metric's family; for perplexity 2% of the reference's mean,
    the 0.02-nat loss margin carried to perplexity (d ppl / ppl = d loss). None where no default exists."""
    if metric.endswith("ppl"):
        return None if reference_mean is None else PPL_RELATIVE_MARGIN * reference_mean
    for family, margin in DEFAULT_MARGINS.items():
        if metric.endswith(family):
            return margin
    return None


@dataclass(frozen=True)
class Interval:
    """``n`` values summarised: ``mean``, sample ``std`` (0 for one value) and the 95% interval."""

    n: int
    mean: float
    std: float
    low: float
    high: float

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2


def _finite(values: Sequence[float | None]) -> list[float]:
    return [float(v) for v in values if v is not None and math.isfinite(v)]


def summarize(
    values: Sequence[float | None],
    confidence: float = 0.95,
    bounds: tuple[float | None, float | None] = (None, None),
) -> Interval | None:
    """The Student-t interval of the finite ``values`` (None when there is none), clipped to ``bounds``. One
    value gives a zero-width interval: a single seed says nothing about the spread (reported as n = 1)."""
    finite = _finite(values)
    n = len(finite)
    if n == 0:
        return None
    mean = sum(finite) / n
    if n == 1:
        return Interval(1, mean, 0.0, mean, mean)
    std = math.sqrt(sum((v - mean) ** 2 for v in finite) / (n - 1))
    half = float(_student_t().ppf(0.5 + confidence / 2, n - 1)) * std / math.sqrt(n)
    low, high = mean - half, mean + half
    if bounds[0] is not None:
        low = max(low, bounds[0])
    if bounds[1] is not None:
        high = min(high, bounds[1])
    return Interval(n, mean, std, low, high)


@dataclass(frozen=True)
class PairedDifference:
    """Mechanism minus reference over ``n`` shared seeds: the mean difference, its 95% interval
    (``low``, ``high``), its 90% interval (``low90``, ``high90``, the TOST interval), the paired t-test's
    two-sided ``p_value``, the ``margin`` δ and the resulting ``verdict`` with a one-line ``reason``."""

    n: int
    mean: float
    low: float
    high: float
    low90: float
    high90: float
    p_value: float
    margin: float | None
    verdict: Verdict
    reason: str

    @property
    def on_par_margin(self) -> float:
        """The smallest δ at which the verdict would be ``on par``: the largest absolute end of the 90% interval
        (NaN with fewer than two seeds; inf where the interval is unbounded)."""
        return max(abs(self.low90), abs(self.high90))


def difference_bounds(bounds: tuple[float | None, float | None]) -> tuple[float | None, float | None]:
    """The range of a difference of two values in ``bounds``: [lo - hi, hi - lo] when both ends are known, else
    unbounded (a loss >= 0 can differ by any amount)."""
    low, high = bounds
    return (None, None) if low is None or high is None else (low - high, high - low)


#: relative spread of the differences below which they count as one value (floating-point rounding)
SAME_DIFFERENCE_RTOL = 1e-12


def paired_difference(
    values: Mapping[int, float | None],
    reference: Mapping[int, float | None],
    *,
    margin: float | None,
    higher_is_better: bool,
    bounds: tuple[float | None, float | None] = (None, None),
) -> PairedDifference:
    """Compare ``values`` with ``reference`` (both seed -> metric) over the seeds both have a finite value for,
    and give the verdict of the module's rule. ``margin`` None: no equivalence test (never ``on par``).
    ``bounds``: the metric's range (:func:`metric_bounds`); the intervals are clipped to the difference's."""
    if margin is not None and not margin >= 0:
        raise ValueError(f"the equivalence margin must be >= 0, got {margin}")
    seeds = sorted(s for s in values if s in reference and len(_finite([values[s], reference[s]])) == 2)
    pairs = [(float(values[s]), float(reference[s])) for s in seeds]  # type: ignore[arg-type]
    differences = [a - b for a, b in pairs]
    n = len(differences)
    nan = float("nan")
    if n < 2:
        mean = differences[0] if differences else nan
        reason = "one shared seed: no spread to test against" if n else "no seed shared with the reference"
        return PairedDifference(n, mean, nan, nan, nan, nan, nan, margin, "inconclusive", reason)
    mean = sum(differences) / n
    rounding = SAME_DIFFERENCE_RTOL * max(abs(x) for pair in pairs for x in pair)
    if max(differences) - min(differences) <= rounding:
        mean = 0.0 if abs(mean) <= rounding else mean
        smallest_p = 2.0 ** (1 - n)  # every sign flip but the observed one and its mirror moves the mean
        p_value = 1.0 if mean == 0 else smallest_p
        low, high = (mean, mean) if smallest_p < 0.05 else (-math.inf, math.inf)
        low90, high90 = (mean, mean) if smallest_p < 0.10 else (-math.inf, math.inf)
        basis = (
            f"every seed gives the same difference {mean:+.4g}, so no t-test; the exact sign-flip test of {n} seeds "
            f"gives p = {p_value:.3g} (a constant difference is on par from 5 seeds, a direction from 6): "
        )
    else:
        std = math.sqrt(sum((d - mean) ** 2 for d in differences) / (n - 1))
        error = std / math.sqrt(n)
        t = _student_t()
        half95 = float(t.ppf(0.975, n - 1)) * error
        half90 = float(t.ppf(0.95, n - 1)) * error
        p_value = float(2 * t.sf(abs(mean) / error, n - 1))
        low, high, low90, high90 = mean - half95, mean + half95, mean - half90, mean + half90
        basis = ""
    floor, ceiling = difference_bounds(bounds)
    if floor is not None and ceiling is not None:
        low, low90 = max(low, floor), max(low90, floor)
        high, high90 = min(high, ceiling), min(high90, ceiling)
    if margin is not None and -margin <= low90 and high90 <= margin:
        verdict, reason = "on par", f"90% interval [{low90:+.4g}, {high90:+.4g}] inside ±{margin:g}"
    elif low > 0 or high < 0:
        verdict, reason = _direction(mean, higher_is_better), f"95% interval [{low:+.4g}, {high:+.4g}] excludes 0"
    else:
        inside = "" if margin is None else f"; 90% interval [{low90:+.4g}, {high90:+.4g}] not inside ±{margin:g}"
        verdict, reason = "inconclusive", f"95% interval [{low:+.4g}, {high:+.4g}] holds 0{inside}"
    return PairedDifference(n, mean, low, high, low90, high90, p_value, margin, verdict, basis + reason)


def _direction(difference: float, higher_is_better: bool) -> Verdict:
    return "better" if (difference > 0) == higher_is_better else "worse"


def _student_t() -> rv_continuous:
    """scipy's Student t distribution, imported on first use: the commands that only print help never load scipy."""
    from scipy import stats

    return stats.t
