"""Figures of ``zoo study approx``, drawn from its ``summary.csv`` alone (so ``--replot`` needs nothing else).

- ``error_vs_budget_<input>.png``: one panel per method, relative error vs its budget, one line per n (band:
  95% interval over samples); on Linformer/JL panels the SVD floor of the same inputs dashed in the same colour;
  a last panel with the mechanisms measured at their defaults, error vs n.
- ``theorem2_<input>.png``: the rank-k constructions (SVD floor, JL, Linformer random and learned), error vs n
  at each k, relative (top) and lemma-normalised (bottom, with JL's 1/sqrt(k) dotted). Theorem 2 says these
  lines are flat; a rising line is an error that grows with n.
"""

from __future__ import annotations

import math
from pathlib import Path

from experiments.studies.approx_methods import METHODS
from experiments.studies.common import number, pyplot, read_csv, save_figure

#: errors below this (exact limits, round-off) are drawn at it, so the log axes keep the approximations readable
FLOOR = 1e-6
#: the summary.csv columns the figures read
SUMMARY_READ = ("input", "model", "n", "method", "knob", "budget", "rel_mean", "rel_ci_low", "rel_ci_high",
                "lemma_mean", "lemma_ci_low", "lemma_ci_high")  # fmt: skip


def _points(rows: list[dict[str, str]], x: str, metric: str = "rel") -> tuple[list[float], ...]:
    """Sorted (x, mean, low, high) of the rows that have a value; values below FLOOR are drawn at FLOOR."""
    kept = sorted((float(r[x]), i, r) for i, r in enumerate(rows) if r[f"{metric}_mean"])
    values = [[xv, *(max(FLOOR, number(r[f"{metric}_{part}"])) for part in ("mean", "ci_low", "ci_high"))]
              for xv, _, r in kept]  # fmt: skip
    return tuple(list(column) for column in zip(*values, strict=True)) if values else ([], [], [], [])


def _order(method: str) -> tuple[int, str]:
    """Panels in the order of ``METHODS`` (the table), learned Linformer after the fixed ones, then the rest."""
    names = [m.name for m in METHODS]
    if method.startswith("linformer-learned"):
        return names.index("linformer-theorem2") * 2 + 1, method
    return (names.index(method) * 2 if method in names else 2 * len(names)), method


def _n_colors(plt, lengths: list[int]) -> dict[int, object]:
    colors = plt.cm.plasma([0.85 * i / max(1, len(lengths) - 1) for i in range(len(lengths))])
    return dict(zip(lengths, colors, strict=True))


def budget_figure(rows: list[dict[str, str]], input_kind: str, path: Path, tensorboard: Path) -> Path:
    plt = pyplot()
    rows = [r for r in rows if r["input"] == input_kind]
    lengths = sorted({int(r["n"]) for r in rows})
    color = _n_colors(plt, lengths)
    # one panel per method and per model its inputs came from (trained inputs: the full model, or each
    # Linformer model's own q, k, v for its learned E, F and the SVD floor there)
    swept = sorted(dict.fromkeys((r["method"], r["model"]) for r in rows if r["knob"] != "defaults"),
                   key=lambda pair: (_order(pair[0]), pair[1]))  # fmt: skip
    defaults = list(dict.fromkeys(r["method"] for r in rows if r["knob"] == "defaults"))
    panels = len(swept) + bool(defaults)
    columns = min(4, panels)
    lines = math.ceil(panels / columns)
    figure, axes = plt.subplots(
        lines, columns, figsize=(4.2 * columns, 3.4 * lines), squeeze=False, layout="constrained"
    )
    for ax in axes.flat[panels:]:
        ax.axis("off")
    for ax, (method, model) in zip(axes.flat, swept, strict=False):
        mine = [r for r in rows if r["method"] == method and r["model"] == model]
        knob = mine[0]["knob"]
        for n in lengths:
            x, mean, low, high = _points([r for r in mine if int(r["n"]) == n], "budget")
            if not x:
                continue
            ax.plot(x, mean, marker="o", markersize=3, color=color[n], label=f"n={n}")
            ax.fill_between(x, low, high, color=color[n], alpha=0.15)
            if knob == "k" and method != "svd":
                floor = [r for r in rows if r["method"] == "svd" and int(r["n"]) == n and r["model"] == model]
                fx, fmean, _, _ = _points(floor, "budget")
                ax.plot(fx, fmean, linestyle="--", linewidth=1, color=color[n])
        ax.set_xscale("symlog" if knob == "top_k" else "log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(knob)
        ax.set_title(method + ("" if model == "-" else f" ({model} model's q, k, v)"), fontsize=9)
        ax.grid(alpha=0.3, which="both")
    if defaults:
        ax = axes.flat[len(swept)]
        for method in defaults:
            x, mean, _, _ = _points([r for r in rows if r["method"] == method], "n")
            ax.plot(x, mean, marker="o", markersize=3, label=method)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("n")
        ax.set_title("at their defaults", fontsize=9)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3, which="both")
    for ax in axes[:, 0]:
        ax.set_ylabel("relative error")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    figure.legend(handles, labels, loc="outside right upper", fontsize=8)
    figure.suptitle(
        f"{input_kind} inputs: ||out - softmax(QK^T/sqrt d) V|| / ||softmax(QK^T/sqrt d) V||, mean and 95% interval"
        f" (dashed: SVD floor; below {FLOOR:g} drawn at {FLOOR:g})"
    )
    return save_figure(figure, path, tensorboard)


def theorem2_figure(rows: list[dict[str, str]], input_kind: str, path: Path, tensorboard: Path) -> Path | None:
    plt = pyplot()
    rows = [r for r in rows if r["input"] == input_kind and r["knob"] == "k"]
    if not rows:
        return None
    names = sorted(dict.fromkeys((r["method"], r["model"]) for r in rows), key=lambda pair: (_order(pair[0]), pair[1]))
    ks = sorted({int(r["budget"]) for r in rows})
    colors = dict(zip(ks, plt.cm.viridis([0.9 * i / max(1, len(ks) - 1) for i in range(len(ks))]), strict=True))
    figure, axes = plt.subplots(
        2, len(names), figsize=(3.8 * len(names), 6.4), squeeze=False, sharex=True, layout="constrained"
    )
    for column, (method, model) in enumerate(names):
        mine = [r for r in rows if r["method"] == method and r["model"] == model]
        for line, metric in enumerate(("rel", "lemma")):
            ax = axes[line, column]
            for k in ks:
                x, mean, low, high = _points([r for r in mine if int(r["budget"]) == k], "n", metric)
                if not x:
                    continue
                ax.plot(x, mean, marker="o", markersize=3, color=colors[k], label=f"k={k}")
                ax.fill_between(x, low, high, color=colors[k], alpha=0.15)
                if metric == "lemma" and method == "jl":
                    ax.axhline(1 / math.sqrt(k), color=colors[k], linestyle=":", linewidth=1)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.grid(alpha=0.3, which="both")
            if line == 0:
                ax.set_title(method + ("" if model == "-" else f"\n({model} model's q, k, v)"), fontsize=9)
            else:
                ax.set_xlabel("n")
        axes[0, column].legend(fontsize=7)
    axes[0, 0].set_ylabel("relative error")
    axes[1, 0].set_ylabel("lemma-normalised error\nRMS |err_ij| / (||P_i|| ||V_j||)")
    figure.suptitle(f"{input_kind} inputs: rank-k constructions vs n at fixed k (Theorem 2: flat lines)")
    return save_figure(figure, path, tensorboard)


def plot(directory: Path) -> list[Path]:
    rows = read_csv(directory / "summary.csv", SUMMARY_READ, what="the folder of a zoo study approx",
                    integers=("n", "budget"), numbers=SUMMARY_READ[6:])  # fmt: skip
    tensorboard = directory / "tensorboard"
    written = []
    for input_kind in dict.fromkeys(r["input"] for r in rows):
        written.append(budget_figure(rows, input_kind, directory / f"error_vs_budget_{input_kind}.png", tensorboard))
        theorem = theorem2_figure(rows, input_kind, directory / f"theorem2_{input_kind}.png", tensorboard)
        if theorem is not None:
            written.append(theorem)
    return written
