"""``fig3.png`` of ``zoo study mlm``, from its ``curves.csv`` and ``table.csv`` alone, in six panels after the
Linformer paper's Fig. 3 (curves: mean over the seeds logged at each step, band: +- one std where >= 2):

(a) k sweep at n = 512: full and Linformer (headwise) at each k; (b) the same at n = 1024;
(c) sharing none / headwise / kv / layerwise at n = 512 and the k of the sharing runs, full for reference;
(d) Linformer at that k as n grows (solid), full at the same n (dashed);
(e) final perplexity vs k, one line per n, full as horizontal lines; (f) final perplexity vs n, with the
unigram baseline of each n's evaluation text where the table has it (dotted).
Panels (e, f) use finished runs only (error bars: std over seeds) and the table's final perplexity of one
evaluation: test on the one evaluation text where any run has it, else the validation of old experiments (the
table's ``evaluation`` column; a CSV without it holds old experiments only).
"""

from __future__ import annotations

from pathlib import Path

from experiments.studies.common import number, pyplot, read_csv, save_figure

SHARINGS = ("none", "headwise", "kv", "layerwise")
#: how a run is judged: by test/ppl on the one evaluation text, or (old experiments) by val/ppl
TEST, OLD_VAL = "test", "val (old init)"
#: the columns of curves.csv and table.csv the figure reads
CURVE_COLUMNS = ("n", "attention", "k", "sharing", "seed", "step", "val_ppl")
TABLE_COLUMNS = ("n", "attention", "k", "sharing", "mean", "std")


def _mean_curve(rows: list[dict[str, str]]) -> tuple[list[int], list[float], list[float], int]:
    """(steps, mean, std, seeds) over the seeds of ``rows`` (one variant)."""
    by_step: dict[int, list[float]] = {}
    for row in rows:
        by_step.setdefault(int(row["step"]), []).append(float(row["val_ppl"]))
    steps = sorted(by_step)
    means, stds = [], []
    for step in steps:
        values = by_step[step]
        mean = sum(values) / len(values)
        var = sum((v - mean) ** 2 for v in values) / (len(values) - 1) if len(values) > 1 else 0.0
        means.append(mean)
        stds.append(var**0.5)
    return steps, means, stds, len({row["seed"] for row in rows})


def _draw(ax, rows, label, color, linestyle="-") -> None:
    if not rows:
        return
    steps, mean, std, seeds = _mean_curve(rows)
    ax.plot(steps, mean, color=color, linestyle=linestyle, label=f"{label} ({seeds} seed{'s' * (seeds != 1)})")
    if seeds > 1:
        ax.fill_between(steps, [m - s for m, s in zip(mean, std, strict=True)],
                        [m + s for m, s in zip(mean, std, strict=True)], color=color, alpha=0.15)  # fmt: skip


def _select(rows, *, n=None, attention=None, k=None, sharing=None):
    return [
        r for r in rows
        if (n is None or int(r["n"]) == n) and (attention is None or r["attention"] == attention)
        and (k is None or r["k"] == str(k)) and (sharing is None or r["sharing"] == sharing)
    ]  # fmt: skip


def _sharing_k(curves: list[dict[str, str]]) -> int | None:
    """The k of the sharing comparison: the k at which a non-headwise sharing ran."""
    ks = {int(r["k"]) for r in curves if r["attention"] == "linformer" and r["sharing"] not in ("", "headwise")}
    return min(ks) if ks else None


def plot(directory: Path) -> list[Path]:
    plt = pyplot()
    what = "the folder of a zoo study mlm"
    # curves.csv may hold no row: no run has logged a validation yet
    curves = read_csv(directory / "curves.csv", CURVE_COLUMNS, what=what, integers=("n", "seed", "step"),
                      numbers=("val_ppl",), allow_empty=True)  # fmt: skip
    table = read_csv(directory / "table.csv", TABLE_COLUMNS, what=what, integers=("n",),
                     numbers=("mean", "std"))  # fmt: skip
    lengths = sorted({int(r["n"]) for r in table})
    ks = sorted({int(r["k"]) for r in table if r["k"]})
    k_color = dict(zip(ks, plt.cm.viridis([0.9 * i / max(1, len(ks) - 1) for i in range(len(ks))]), strict=True))
    n_color = dict(zip(lengths, plt.cm.plasma([0.8 * i / max(1, len(lengths) - 1) for i in range(len(lengths))]),
                       strict=True))  # fmt: skip
    shared_k = _sharing_k(curves)
    figure, axes = plt.subplots(2, 3, figsize=(16, 9), layout="constrained")
    (a, b, c), (d, e, f) = axes

    for ax, n, letter in ((a, 512, "a"), (b, 1024, "b")):
        _draw(ax, _select(curves, n=n, attention="full"), "Transformer", "black")
        for k in ks:
            _draw(
                ax, _select(curves, n=n, attention="linformer", k=k, sharing="headwise"), f"Linformer k={k}", k_color[k]
            )
        ax.set_title(f"({letter}) n = {n}: projected dimension k")

    _draw(c, _select(curves, n=512, attention="full"), "Transformer", "black")
    if shared_k is not None:
        for sharing, color in zip(SHARINGS, plt.cm.tab10.colors, strict=False):
            _draw(c, _select(curves, n=512, attention="linformer", k=shared_k, sharing=sharing), sharing, color)
    sharing_k = "no sharing runs yet" if shared_k is None else f"k = {shared_k}"
    c.set_title(f"(c) n = 512, {sharing_k}: sharing")

    fixed_k = shared_k if shared_k is not None else (ks[len(ks) // 2] if ks else None)
    for n in lengths:
        _draw(
            d,
            _select(curves, n=n, attention="linformer", k=fixed_k, sharing="headwise"),
            f"Linformer n={n}",
            n_color[n],
        )
        _draw(d, _select(curves, n=n, attention="full"), f"Transformer n={n}", n_color[n], linestyle="--")
    d.set_title(f"(d) k = {fixed_k} as n grows (dashed: Transformer)")

    # one evaluation per panel: test where any run was tested, so old-init val rows never join its lines
    evaluation = TEST if any(r.get("evaluation") == TEST and r["mean"] for r in table) else OLD_VAL
    finished = [r for r in table if r["mean"] and (r.get("evaluation") or OLD_VAL) == evaluation]
    for n in lengths:
        headwise = [
            r for r in finished if int(r["n"]) == n and r["attention"] == "linformer" and r["sharing"] == "headwise"
        ]
        points = sorted((int(r["k"]), number(r["mean"]), number(r["std"])) for r in headwise)
        if points:
            x, y, err = zip(*points, strict=True)
            e.errorbar(x, y, yerr=err, marker="o", capsize=3, color=n_color[n], label=f"Linformer n={n}")
        for r in finished:
            if int(r["n"]) == n and r["attention"] == "full":
                e.axhline(number(r["mean"]), color=n_color[n], linestyle="--", linewidth=1, label=f"Transformer n={n}")
    e.set_xscale("log", base=2)
    e.set_xlabel("k")
    e.set_title("(e) final perplexity vs k")

    variants = [("full", "", "Transformer", "black")] + [
        ("linformer", str(k), f"Linformer k={k}", k_color[k]) for k in ks
    ]
    for attention, k, label, color in variants:
        mine = [r for r in finished if r["attention"] == attention and r["k"] == k and r["sharing"] in ("", "headwise")]
        points = sorted((int(r["n"]), number(r["mean"]), number(r["std"])) for r in mine)
        if points:
            x, y, err = zip(*points, strict=True)
            f.errorbar(x, y, yerr=err, marker="o", capsize=3, color=color, label=label)
    baselines = sorted({(int(r["n"]), number(r["unigram_ppl"])) for r in finished if r.get("unigram_ppl")})
    if baselines:
        x, y = zip(*baselines, strict=True)
        f.plot(x, y, color="gray", linestyle=":", marker="s", label="unigram (no context)")
    f.set_xscale("log", base=2)
    f.set_xlabel("n")
    f.set_title("(f) final perplexity vs n")

    from matplotlib.ticker import ScalarFormatter

    for ax in axes.flat:
        if ax in (a, b, c, d):  # curves fall by an order of magnitude; the final values (e, f) are close together
            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(ScalarFormatter())
            ax.yaxis.set_minor_formatter(ScalarFormatter())
        ax.grid(alpha=0.3, which="both")
        ax.set_ylabel("validation perplexity" if ax in (a, b, c, d) else f"final {evaluation} perplexity")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
        else:  # a panel whose runs have not finished yet says so instead of showing empty axes
            ax.text(0.5, 0.5, "no runs yet", transform=ax.transAxes, ha="center", va="center", color="gray")
    for ax in (a, b, c, d):
        ax.set_xlabel("updates")
    figure.suptitle("MLM perplexity (Linformer Fig. 3 at CPU scale): curves of validation, (e, f) final")
    return [save_figure(figure, directory / "fig3.png", directory / "tensorboard")]
